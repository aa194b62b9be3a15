"""Compare runs: held-out pass@1 with 95% intervals, training curves, and which config fields
differ between the runs.

    python scripts/compare.py runs/kl_0.01 runs/kl_0.1                       # table on stdout
    python scripts/compare.py runs/a runs/b --out runs/compare.png --json runs/compare.json

A run directory is a config's workdir as the scripts write it:
  - config: demo_results.json["config"] (scripts/demo.py), else rl/config.json or sft/config.json
    (written by the training loops' metrics writer);
  - held-out results: demo_results.json (before = SFT checkpoint, after = SFT+RL; pass@1 and
    pass@k, each at the temperature chosen on the val split; older runs: greedy and sampled
    pass@1), and any eval*.json written by `scripts/evaluate.py --json RUN_DIR/eval_<name>.json`;
  - training curves: rl/metrics.jsonl (reward, KL to the reference, entropy, completion length;
    val pass@1 per domain).
The table lists, per domain and evaluation, each run's pass@1 (pass@k for a demo's pass@k
evaluation) and interval; runs whose intervals do not overlap are marked. A second table lists,
per evaluation, the generator templates (results written with "by_template": rl.pipeline.evaluate)
whose pass@1 is not the same in every run: each run's pass@1 and tasks solved by any sample.
Nothing is re-evaluated here: this reads what the runs wrote.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: tests import the functions
    flags.DEFINE_string("out", "", "write the plot here (PNG); default: no plot")
    flags.DEFINE_string("json", "", "write the comparison (diff, table, curves) here")
    flags.DEFINE_list("ignore", ["workdir", "name"], "config fields never reported as "
                      "differences (they differ between any two runs)")

CURVES = ("rl/reward_mean", "rl/kl_ref", "rl/entropy", "rl/completion_len_mean")  # when logged


class RunError(ValueError):
    pass


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise RunError(f"{path} is not valid JSON ({e}); was the run interrupted while "
                       "writing it?") from None


def _cell(v: dict, metric: str) -> dict:
    return {"value": v[metric], "lo": v.get(metric + "_lo", math.nan),
            "hi": v.get(metric + "_hi", math.nan), "tasks": v["tasks"]}


def _templates(res: dict) -> dict:
    """{(domain, template): {"tasks", "pass@1", "solved"}} of an evaluation result's
    "by_template" entries (none in results written before them)."""
    return {(d, t): v for d, r in res.items() if isinstance(r, dict)
            for t, v in r.get("by_template", {}).items()}


def load_run(path: str) -> dict:
    """{"name", "path", "config" (flat), "heldout" {eval name: {domain: result}}, "templates"
    {eval name: {(domain, template): result}}, "curves" {metric: [(step, value)]}}. Raises
    RunError naming what is missing."""
    if not os.path.isdir(path):
        raise RunError(f"{path}: not a directory (give run directories, i.e. config workdirs)")
    demo = os.path.join(path, "demo_results.json")
    res = _read_json(demo) if os.path.exists(demo) else None
    config = (res or {}).get("config")
    for sub in ("rl", "sft"):
        p = os.path.join(path, sub, "config.json")
        if config is None and os.path.exists(p):
            config = _read_json(p)
    if config is None:
        raise RunError(f"{path}: no config found (expected demo_results.json, rl/config.json or "
                       "sft/config.json, written by scripts/demo.py, train_rl.py, sft.py)")
    heldout = {}  # eval name -> {domain: {"value", "lo", "hi", "tasks"}}
    templates = {}  # eval name -> {(domain, template): {"tasks", "pass@1", "solved"}}
    if res is not None:
        for phase, label in (("before", "SFT"), ("after", "SFT+RL")):
            for mode, r in res.get(phase, {}).items():
                if mode == "val_sweep":  # per temperature on the val split: not a held-out row
                    continue
                metric = mode if mode.startswith("pass@") else "pass@1"  # older: greedy/sampled
                heldout[f"{label} {mode}"] = {d: _cell(v, metric) for d, v in r.items()
                                              if isinstance(v, dict)}
                templates[f"{label} {mode}"] = _templates(r)
    for p in sorted(glob.glob(os.path.join(path, "eval*.json"))):
        r = _read_json(p)
        name = os.path.splitext(os.path.basename(p))[0]
        heldout[name] = {
            d: _cell(v, "pass@1") for d, v in r.items() if isinstance(v, dict) and "pass@1" in v}
        templates[name] = _templates(r)
    curves = {}
    mpath = os.path.join(path, "rl", "metrics.jsonl")
    if os.path.exists(mpath):
        with open(mpath) as f:
            for n, line in enumerate(f, 1):
                try:
                    m = json.loads(line)
                except json.JSONDecodeError:
                    raise RunError(f"{mpath}:{n}: not a JSON line") from None
                for k, v in m.items():
                    if k in CURVES or (k.startswith("val/") and k.endswith("/pass1")):
                        curves.setdefault(k, []).append((m["step"], v))
    if not heldout and not curves:
        raise RunError(f"{path}: no held-out results (demo_results.json, eval*.json) and no "
                       "rl/metrics.jsonl: nothing to compare")
    return {"name": os.path.basename(os.path.normpath(path)), "path": path,
            "config": flatten(config), "heldout": heldout,
            "templates": {e: t for e, t in templates.items() if t}, "curves": curves}


def config_diff(runs: list[dict], ignore=("workdir", "name")) -> dict:
    """{field: [value per run]} for fields whose values differ (missing = '<unset>')."""
    keys = sorted(set().union(*(r["config"] for r in runs)))
    out = {}
    for k in keys:
        if k in ignore or any(k.startswith(i + ".") for i in ignore):
            continue
        vals = [r["config"].get(k, "<unset>") for r in runs]
        if any(json.dumps(v, default=str) != json.dumps(vals[0], default=str) for v in vals):
            out[k] = vals
    return out


def heldout_rows(runs: list[dict]) -> list[dict]:
    """One row per (evaluation, domain) present in any run: each run's (pass@k, lo, hi, tasks)
    or None, and whether some two runs' 95% intervals are disjoint."""
    rows = []
    evals = list(dict.fromkeys(e for r in runs for e in r["heldout"]))
    for e in evals:
        doms = sorted(set().union(*(r["heldout"].get(e, {}) for r in runs)))
        for d in doms:
            cells = []
            for r in runs:
                v = r["heldout"].get(e, {}).get(d)
                cells.append(None if v is None else (v["value"], v["lo"], v["hi"], v["tasks"]))
            have = [c for c in cells if c is not None]
            disjoint = any(a[2] < b[1] or b[2] < a[1] for a in have for b in have)
            rows.append({"eval": e, "domain": d, "cells": cells, "disjoint": disjoint})
    return rows


def template_rows(runs: list[dict]) -> list[dict]:
    """One row per (evaluation, domain, template) that some run's results split by template
    and whose pass@1 is not the same in every run that has it: each run's (pass@1, solved,
    tasks) or None."""
    rows = []
    evals = list(dict.fromkeys(e for r in runs for e in r["templates"]))
    for e in evals:
        keys = sorted(set().union(*(r["templates"].get(e, {}) for r in runs)))
        for d, t in keys:
            cells = [None if (v := r["templates"].get(e, {}).get((d, t))) is None else
                     (v["pass@1"], v["solved"], v["tasks"]) for r in runs]
            if len({c[0] for c in cells if c is not None}) > 1:
                rows.append({"eval": e, "domain": d, "template": t, "cells": cells})
    return rows


def format_report(runs: list[dict], diff: dict, rows: list[dict], trows=()) -> str:
    names = [r["name"] for r in runs]
    w = max(12, *(len(n) for n in names)) + 2
    lines = ["runs: " + ", ".join(f"{r['name']} ({r['path']})" for r in runs), "",
             "config fields that differ:" if diff else "config fields that differ: none"]
    for k, vals in diff.items():
        lines.append(f"  {k:<40}" + "".join(f"{json.dumps(v, default=str):>{w}}" for v in vals))
    lines += ["", f"{'held-out pass@k (%)':<34}" + "".join(f"{n:>{w + 14}}" for n in names)]
    for row in rows:
        cells = "".join(
            f"{'-':>{w + 14}}" if c is None else
            f"{100 * c[0]:>{w - 2}.1f} [{100 * c[1]:4.1f},{100 * c[2]:5.1f}]"
            for c in row["cells"])
        mark = "  * intervals disjoint" if row["disjoint"] else ""
        lines.append(f"{row['eval'] + ' / ' + row['domain']:<34}{cells}{mark}")
    if trows:
        lines += ["", "pass@1 (%) and tasks solved by any sample, per template, where the runs "
                  "differ"]
        lines.append(f"{'':<50}" + "".join(f"{n:>{w + 6}}" for n in names))
        for row in trows:
            cells = "".join(f"{'-':>{w + 6}}" if c is None else
                            f"{100 * c[0]:>{w - 1}.1f}% {c[1]:>2}/{c[2]:<2}" for c in row["cells"])
            label = f"{row['eval']} / {row['domain']} / {row['template']}"
            lines.append(f"{label:<50}{cells}")
    finals = {}
    for r in runs:
        for k, pts in r["curves"].items():
            tail = [v for _, v in pts[-10:]]
            finals.setdefault(k, {})[r["name"]] = sum(tail) / len(tail)
    if finals:
        lines += ["", f"{'training (mean of last 10 logs)':<34}" + "".join(
            f"{n:>{w + 14}}" for n in names)]
        for k, per in sorted(finals.items()):
            lines.append(f"{k:<34}" + "".join(
                f"{per[n]:>{w + 14}.4g}" if n in per else f"{'-':>{w + 14}}" for n in names))
    return "\n".join(lines)


def plot(runs: list[dict], rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    curve_keys = [k for k in CURVES if any(k in r["curves"] for r in runs)]
    val_keys = sorted({k for r in runs for k in r["curves"] if k.startswith("val/")})
    n = 1 + len(curve_keys) + (1 if val_keys else 0)
    cols = min(3, n)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(n / cols)),
                             squeeze=False)
    axes = axes.ravel()
    ax = axes[0]  # held-out pass@1 with intervals, grouped by (eval, domain)
    x = np.arange(len(rows))
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        ys = [np.nan if row["cells"][i] is None else 100 * row["cells"][i][0] for row in rows]
        lo = [0 if row["cells"][i] is None else 100 * (row["cells"][i][0] - row["cells"][i][1])
              for row in rows]
        hi = [0 if row["cells"][i] is None else 100 * (row["cells"][i][2] - row["cells"][i][0])
              for row in rows]
        ax.bar(x + (i - (len(runs) - 1) / 2) * width, ys, width, yerr=[lo, hi], capsize=2,
               label=r["name"])
    ax.set_xticks(x, [f"{row['eval']}\n{row['domain']}" for row in rows], rotation=60,
                  fontsize=6, ha="right")
    ax.set(ylabel="held-out pass@k (%), 95% CI", title="held-out")
    ax.legend(fontsize=7)
    for ax, k in zip(axes[1:], curve_keys):
        for r in runs:
            if k in r["curves"]:
                s, v = zip(*r["curves"][k])
                ax.plot(s, v, label=r["name"])
        ax.set(xlabel="RL step", title=k)
        ax.legend(fontsize=7)
    if val_keys:
        ax = axes[1 + len(curve_keys)]
        for r in runs:
            for k in val_keys:
                if k in r["curves"]:
                    s, v = zip(*r["curves"][k])
                    ax.plot(s, 100 * np.asarray(v), marker="o", label=f"{r['name']} {k[4:-6]}")
        ax.set(xlabel="RL step", ylabel="pass@1 (%)", title="val pass@1 during RL")
        ax.legend(fontsize=6)
    for ax in axes[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv):
    dirs = argv[1:]
    if len(dirs) < 2:
        raise app.UsageError("give at least two run directories: compare.py RUN_DIR RUN_DIR ...")
    try:
        runs = [load_run(d) for d in dirs]
    except RunError as e:
        sys.exit(f"compare.py: {e}")
    names = [r["name"] for r in runs]
    if len(set(names)) < len(names):  # same basename in different folders: use the paths
        for r in runs:
            r["name"] = r["path"]
    diff = config_diff(runs, ignore=tuple(FLAGS.ignore))
    rows = heldout_rows(runs)
    trows = template_rows(runs)
    print(format_report(runs, diff, rows, trows))
    if FLAGS.out:
        plot(runs, rows, FLAGS.out)
        print(f"\nplot: {FLAGS.out}")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"runs": [r["path"] for r in runs], "config_diff": diff, "heldout": rows,
                       "templates": trows, "curves": {r["name"]: r["curves"] for r in runs}},
                      f, indent=1, default=str)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
