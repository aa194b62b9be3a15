"""The main job end to end on the smoke setting, and the evaluation harness on HumanEval."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUMANEVAL = os.path.join(ROOT, "sandbox", "tasks", "data", "HumanEval.jsonl.gz")


@pytest.mark.parametrize("completions,expected", [("canonical", 1.0), ("empty", 0.0)])
def test_evaluate_script_on_humaneval(tmp_path, completions, expected):
    out = tmp_path / "res.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"),
                    "--humaneval", HUMANEVAL, f"--completions={completions}", f"--json={out}"],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert res["python_tests"]["tasks"] == 164
    assert res["python_tests"]["pass@1"] == expected


@pytest.mark.parametrize("completions,expected", [("canonical", 1.0), ("empty", 0.0)])
def test_evaluate_script_by_template(tmp_path, completions, expected):
    """--by_template on a task file of generated code tasks: one row per template, each
    template's tasks summing to the file's; the canonical solutions pass every template, empty
    completions none; --samples_out writes each task's completion and reward."""
    from sandbox.tasks import save_tasks
    from sandbox.tasks.domains import get_domain
    from sandbox.tasks.domains.base import draw_split

    tasks = [t for t, _ in draw_split(get_domain("code"), "test", 24, seed=0)]
    save_tasks(tasks, tmp_path / "code.jsonl")
    out, samples = tmp_path / "res.json", tmp_path / "samples.jsonl"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"),
                        f"--task_file={tmp_path / 'code.jsonl'}", f"--completions={completions}",
                        "--by_template", f"--json={out}", f"--samples_out={samples}"],
                       check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    res = json.loads(out.read_text())
    assert "_samples" not in res  # the samples go to their own file
    recs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(x["task_id"], x["template"], x["prompt"]) for x in recs] == [
        (t.id, t.meta["template"], t.prompt) for t in tasks]
    want = [t.canonical_solution if completions == "canonical" else "" for t in tasks]
    assert [x["text"] for x in recs] == want and {x["reward"] for x in recs} == {expected}
    by = res["code"]["by_template"]
    templates = sorted({t.meta["template"] for t in tasks})
    assert sorted(by) == templates and len(templates) > 5
    assert sum(v["tasks"] for v in by.values()) == 24
    for tpl, v in by.items():
        assert v["pass@1"] == expected and v["solved"] == expected * v["tasks"], tpl
        assert re.search(rf"^code\s+{tpl}\s+{v['tasks']}\s+{100 * expected:.1f}%", r.stdout,
                         re.M), r.stdout


@pytest.mark.slow
def test_demo_smoke_produces_every_artifact(tmp_path):
    import jax

    from configs import rl as rl_configs
    from model.config import ModelConfig
    from model.transformer import Model
    from train.weights import load_rl_variables, load_sft_variables

    work = tmp_path / "smoke"
    # Every phase and artifact of the smoke run, on less work: 10 SFT steps (still logged and
    # checkpointed twice), 4 held-out tasks per domain and 2 samples per task (the eval chunks
    # keep the 8-row shape of the RL batch).
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--config",
                        os.path.join(ROOT, "configs", "rl.py") + ":smoke",
                        f"--config.workdir={work}", "--config.sft.steps=10",
                        "--config.sft.log_every=5", "--config.sft.checkpoint_every=5",
                        "--config.tasks.test_per_domain=4", "--eval_samples=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for m in ("pass@1", "pass@2"):  # each checkpoint at its best val temperature, per metric
        assert f"held-out {m}, each checkpoint at the temperature with the best val {m}" in r.stdout
    assert "val pass@1 by sampling temperature" in r.stdout
    res = json.loads((work / "demo_results.json").read_text())
    env = res["environment"]  # what the numbers depend on outside the repository
    assert env["packages"]["jax"] == jax.__version__ and env["allocator"] in ("jemalloc", "system")
    temps = [float(t) for t in rl_configs.get_config("smoke").eval.temperatures]
    for when in ("before", "after"):
        sweep = res[when]["val_sweep"]
        assert [float(t) for t in sweep] == temps
        for m in ("pass@1", "pass@2"):  # the multi-step domain is scored as episodes
            assert set(res[when][m]) >= {"arithmetic", "code", "multistep"}
            for d, v in res[when][m].items():
                if not isinstance(v, dict):
                    continue
                # the temperature is the val sweep's best for this metric (greedy: no pass@2)
                at = {float(t): sweep[t][d].get(m) for t in sweep if m in sweep[t][d]}
                assert at[v["temperature"]] == max(at.values()), (when, m, d)
                assert v["samples"] == (1 if v["temperature"] == 0 else 2)
            ep = res[when][m]["multistep"]
            assert ep["turns_mean"] >= 1 and ep["episode_tokens_mean"] > 0
    assert "multistep episodes (test, pass@1's temperatures" in r.stdout
    # per generator template: the templates' tasks add up to each domain's, and the table lists
    # every template either checkpoint fails on some task (the smoke model fails most)
    failing = set()
    for when in ("before", "after"):
        for d, v in res[when]["pass@1"].items():
            if isinstance(v, dict):
                assert sum(t["tasks"] for t in v["by_template"].values()) == v["tasks"], d
                failing |= {(d, k) for k, t in v["by_template"].items() if t["pass@1"] < 1}
    # every test sample of both evaluations, apart from demo_results.json: per domain and
    # metric, the share of correct samples is that evaluation's pass@1
    assert all("_samples" not in res[when] for when in ("before", "after"))
    for when, name in (("before", "sft"), ("after", "rl")):
        recs = [json.loads(x) for x in (work / f"samples_{name}.jsonl").read_text().splitlines()]
        for m in ("pass@1", "pass@2"):
            for d, v in res[when][m].items():
                if isinstance(v, dict):
                    mine = [x for x in recs if m in x["metrics"] and x["domain"] == d]
                    assert len(mine) == v["tasks"] * v["samples"], (name, m, d)
                    assert sum(x["reward"] >= 1 for x in mine) / len(mine) == v["pass@1"]
    table = r.stdout.split("held-out pass@1 by generator template")[1].split("\n\n")[0]
    rows = {tuple(line.split()[:2]) for line in table.splitlines()[2:]}
    assert failing and rows == failing, (rows, failing)
    assert (work / "demo_plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for phase in ("sft", "sft/indexer_warmup", "rl"):
        lines = (work / phase / "metrics.jsonl").read_text().splitlines()
        assert lines and all("step" in json.loads(x) for x in lines)
        assert any(p.name.startswith("events.out.tfevents") for p in (work / phase).iterdir())
    # the indexer warm-up ran (indexer KL logged), RL logged its off-policy correction, the
    # staleness of each batch, the sampler/trainer log-prob gap and the auxiliary terms
    warm = [json.loads(x) for x in (work / "sft/indexer_warmup/metrics.jsonl").open()]
    assert all("sft_indexer_warmup/indexer_kl" in m for m in warm)
    rl = [json.loads(x) for x in (work / "rl/metrics.jsonl").open() if '"rl/loss"' in x]
    for key in ("rl/staleness", "rl/tis_weight_mean", "rl/logp_gap/sampler_trainer_mean",
                "rl/indexer_kl", "rl/mtp_ce", "rl/score_reused_frac"):
        assert all(key in m for m in rl), key
    assert all(0.0 <= m["rl/score_reused_frac"] <= 1.0 for m in rl)
    assert [m["rl/staleness"] for m in rl] == [0] + [1] * (len(rl) - 1)  # one-batch lookahead
    assert set(res["indexer_recall"]) == {"random init", "after warm-up", "after SFT",
                                          "after RL"}
    config = rl_configs.get_config("smoke")
    config.workdir = str(work)
    model = Model(ModelConfig.from_dict(config.model))
    for load in (load_sft_variables, load_rl_variables):
        variables = load(config, model)
        out = model.apply(variables, jax.numpy.ones((1, 4), "int32"))
        assert out.logits.shape == (1, 4, config.model.vocab_size)
    # scripts/compare.py reads what the run wrote: against a second run dir that differs in one
    # config field (a copy whose recorded KL coefficient is changed), it reports that field, a
    # row per evaluation and domain, and writes the plot and JSON.
    import shutil
    other = tmp_path / "smoke_kl"
    shutil.copytree(work, other, ignore=shutil.ignore_patterns("checkpoints"))
    res["config"]["rl"]["algo"]["kl_coef"] = 0.5
    (other / "demo_results.json").write_text(json.dumps(res))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare.py"), str(work),
                        str(other), f"--out={tmp_path / 'cmp.png'}",
                        f"--json={tmp_path / 'cmp.json'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert cmp["config_diff"] == {"rl.algo.kl_coef": [config.rl.algo.kl_coef, 0.5]}
    assert {(x["eval"], x["domain"]) for x in cmp["heldout"]} == {
        (f"{p} {m}", d) for p in ("SFT", "SFT+RL") for m in ("pass@1", "pass@2")
        for d in ("arithmetic", "code", "multistep")}
    assert "rl/reward_mean" in cmp["curves"]["smoke"]
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
