"""scripts/compare.py: config differences, held-out rows with intervals (disjoint ones marked),
training curves, and clear errors for directories that are not runs. Run directories here are
written with the training loop's own MetricsWriter and evaluate()'s result layout; the smoke demo
test (tests/rl/test_demo.py) runs compare.py on a directory the real pipeline wrote."""

import json
import os
import subprocess
import sys

import pytest

from rl.metrics import MetricsWriter
from scripts.compare import (
    RunError,
    config_diff,
    format_report,
    heldout_rows,
    load_run,
    template_rows,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dom(p, lo, hi, n=200):
    return {"tasks": n, "pass@1": p, "pass@1_lo": lo, "pass@1_hi": hi}


def _run(path, kl, after_p, rewards):
    cfg = {"workdir": str(path), "name": "demo", "rl": {"algo": {"kl_coef": kl, "name": "grpo"},
                                                        "steps": len(rewards)}}
    w = MetricsWriter(str(path / "rl"), tensorboard=False, config=cfg)
    for i, r in enumerate(rewards):
        w.write(i + 1, {"reward_mean": r, "kl_ref": 0.01 * i}, "rl/")
    w.close()
    (path / "eval_test_greedy.json").write_text(json.dumps(
        {"arithmetic": _dom(after_p, after_p - 0.05, after_p + 0.05), "_sandbox_failed": 0}))


def test_diff_rows_and_curves(tmp_path):
    _run(tmp_path / "a", 0.01, 0.30, [0.1, 0.2, 0.3])
    _run(tmp_path / "b", 0.1, 0.60, [0.1, 0.1])
    a, b = load_run(str(tmp_path / "a")), load_run(str(tmp_path / "b"))
    assert config_diff([a, b]) == {"rl.algo.kl_coef": [0.01, 0.1], "rl.steps": [3, 2]}
    rows = heldout_rows([a, b])
    assert [(r["eval"], r["domain"], r["disjoint"]) for r in rows] == [
        ("eval_test_greedy", "arithmetic", True)]
    assert rows[0]["cells"][0][:3] == pytest.approx((0.30, 0.25, 0.35))
    assert a["curves"]["rl/reward_mean"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    # overlapping intervals are not marked
    _run(tmp_path / "c", 0.1, 0.33, [0.1])
    assert not heldout_rows([a, load_run(str(tmp_path / "c"))])[0]["disjoint"]


def test_cli_table_plot_and_errors(tmp_path):
    _run(tmp_path / "a", 0.01, 0.30, [0.1, 0.2])
    _run(tmp_path / "b", 0.1, 0.60, [0.1, 0.3])
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "compare.py")]
    r = subprocess.run(cmd + [str(tmp_path / "a"), str(tmp_path / "b"),
                              f"--out={tmp_path / 'c.png'}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "rl.algo.kl_coef" in r.stdout and "intervals disjoint" in r.stdout
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty").mkdir()
    r = subprocess.run(cmd + [str(tmp_path / "a"), str(tmp_path / "empty")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "no config found" in r.stderr
    r = subprocess.run(cmd + [str(tmp_path / "a")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode != 0 and "at least two run directories" in r.stderr
    with pytest.raises(RunError, match="not a directory"):
        load_run(str(tmp_path / "missing"))


def test_demo_results_layouts(tmp_path):
    """A demo's pass@k evaluation shows pass@k (not pass@1) and its interval; the val sweep is
    not a held-out row; an older demo's greedy/sampled layout still reads as pass@1."""
    sweep = {"0.0": {"code": _dom(0.8, 0.7, 0.9, 64)}}
    p4 = {"code": {**_dom(0.5, 0.4, 0.6), "pass@4": 0.9, "pass@4_lo": 0.85, "pass@4_hi": 0.95,
                   "temperature": 1.0}}
    for name, phase in (("new", {"val_sweep": sweep, "pass@1": {"code": _dom(0.8, 0.75, 0.85)},
                                 "pass@4": p4}),
                        ("old", {"greedy": {"code": _dom(0.8, 0.75, 0.85)}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "demo_results.json").write_text(json.dumps(
            {"config": {"name": name}, "before": phase, "after": phase}))
    new, old = load_run(str(tmp_path / "new")), load_run(str(tmp_path / "old"))
    assert set(new["heldout"]) == {f"{p} {m}" for p in ("SFT", "SFT+RL")
                                   for m in ("pass@1", "pass@4")}
    assert new["heldout"]["SFT pass@4"]["code"] == {"value": 0.9, "lo": 0.85, "hi": 0.95,
                                                    "tasks": 200}
    assert old["heldout"]["SFT greedy"]["code"]["value"] == 0.8


def test_template_rows(tmp_path):
    """Per-template rows list only the templates whose pass@1 differs between the runs, with
    each run's solved / tasks; a run whose results carry no by_template shows '-'."""
    def by(linear, odd):
        return {"linear": {"tasks": 7, "pass@1": linear / 7, "solved": linear},
                "odd": {"tasks": 3, "pass@1": odd / 3, "solved": odd},
                "add": {"tasks": 5, "pass@1": 1.0, "solved": 5}}

    for name, linear, odd in (("a", 0, 2), ("b", 3, 2)):
        _run(tmp_path / name, 0.01, 0.5, [0.1])
        (tmp_path / name / "eval_tpl.json").write_text(json.dumps(
            {"code": {**_dom(0.5, 0.4, 0.6, 15), "by_template": by(linear, odd)}}))
    _run(tmp_path / "old", 0.01, 0.5, [0.1])  # written before by_template
    (tmp_path / "old" / "eval_tpl.json").write_text(json.dumps({"code": _dom(0.5, 0.4, 0.6, 15)}))
    runs = [load_run(str(tmp_path / n)) for n in ("a", "b", "old")]
    rows = template_rows(runs)
    assert [(r["eval"], r["domain"], r["template"]) for r in rows] == [
        ("eval_tpl", "code", "linear")]
    assert rows[0]["cells"] == [(0.0, 0, 7), (3 / 7, 3, 7), None]
    report = format_report(runs, {}, heldout_rows(runs), rows)
    line = next(x for x in report.splitlines() if x.startswith("eval_tpl / code / linear"))
    assert line.split()[-5:] == ["0.0%", "0/7", "42.9%", "3/7", "-"]
    assert template_rows(runs[:1]) == []  # one run: nothing differs
