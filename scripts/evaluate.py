"""pass@k per domain for a checkpoint (or for given completions) through the sandbox.

    python scripts/evaluate.py --config configs/rl.py:demo                     # RL checkpoint,
                                                                               # test split, greedy
    python scripts/evaluate.py --config configs/rl.py:demo --checkpoint=sft --n_samples=8 --k=1,4 \
        --temperature=1.0
    python scripts/evaluate.py --config configs/rl.py:demo --temperatures=0,0.5,1 --n_samples=4 \
        --k=1,4                      # each domain's pass@k at its best val temperature (as the demo)
    python scripts/evaluate.py --config configs/rl.py:demo --checkpoint=sft --by_template \
        --samples_out=runs/demo/eval_sft_samples.jsonl   # which templates fail, and every text
    python scripts/evaluate.py --humaneval sandbox/tasks/data/HumanEval.jsonl.gz --completions=canonical
    python scripts/evaluate.py --humaneval sandbox/tasks/data/HumanEval.jsonl.gz --completions=empty
    python scripts/evaluate.py --agentbench=all --completions=canonical   # every runnable AgentBench
                                           # OS task played with its reference solution (100%)
    python scripts/evaluate.py --tb2_dir=sandbox/tasks/data/terminal_bench2 --completions=empty
    python scripts/evaluate.py --config configs/rl.py:demo --checkpoint=rl --agentbench=all \
        --config.model.max_seq_len=2048 --config.rl.agent.width=2048 --by_template \
        --samples_out=runs/demo/agentbench_transcripts.jsonl   # a checkpoint on AgentBench OS
    python scripts/evaluate.py --config configs/rl.py:demo --experts=mxfp4     # MXFP4 experts (PTQ)
    python scripts/evaluate.py --config configs/rl.py:demo --checkpoint=runs/demo/export \
        --experts=mxfp4                                    # an MXFP4 export (scripts/export.py)

--experts=mxfp4 samples with packed MXFP4 experts through the grouped MXFP4 matmul: a bf16/f32
checkpoint is quantised once on load (PTQ; no float copy of the experts is kept), an export
directory of scripts/export.py (a --checkpoint holding model.safetensors.index.json) is read as
stored. The modules that stay high precision are config.quant.high_precision. --experts=bf16
(default) samples the model as trained (an MXFP4 export is then dequantised).

--temperatures=T1,T2,... replaces --temperature: the checkpoint is swept over those temperatures
on the config's val split (0 = greedy, one sample per task), and each domain's test pass@k is
measured at the temperature with its best val pass@k (rl.pipeline.evaluate_at_best_temperatures;
pass@k for k > 1 at a sampled temperature).

pass@k uses the unbiased estimator over n_samples per task; pass@1 comes with a 95% Wilson
interval; multi-step (agent) domains also report turns used and tokens per episode (episode
success is their pass@1). Output: a table (--by_template: also one row per domain and generator
template, with the tasks any sample solved), --json FILE for the full result, and
--samples_out FILE.jsonl for every sample (its text, or an episode's whole transcript, reward
and scoring details; with --temperatures the test split's samples, each with its temperature
and the metrics whose evaluation drew it).
--completions=canonical|empty checks the harness itself on a HumanEval-format file (no model
involved): 100% and 0%; on episode task sets (--agentbench, --tb2_dir) canonical plays each
task's reference solution in a session (rl.envs.play_reference) and empty ends the episode at
once.

--agentbench=dev|test|all: AgentBench's operating-system tasks from the installed inspect-evals
package (sandbox/tasks/agentbench.py; the skipped ones are counted with their reasons);
--tb2_dir=DIR: Terminal-Bench 2 task folders (sandbox/tasks/terminal_bench.py). Both are played
as multi-turn episodes in sandbox sessions (config.rl.agent: their prompts are long, so a byte
model needs a wider row, --config.rl.agent.width and --config.model.max_seq_len); the table has
episode success with its 95% interval, turns and tokens per episode, --by_template the
breakdown by AgentBench label set / TB2 folder, and --samples_out every transcript.
"""

import json
import os

import _common  # noqa: F401
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo", "RL config")
_DRY = _common.define_dry_run()
_CKPT = flags.DEFINE_string("checkpoint", "rl", "rl | sft | hf (the released checkpoint of "
                            "config.hf_dir, configs/rl.py:hf) | a checkpoint directory")
_SPLIT = flags.DEFINE_enum("split", "test", ["val", "test"], "generator split to evaluate")
_TASKS = flags.DEFINE_string("task_file", "", "a task JSONL file instead of the generators")
_AB = flags.DEFINE_enum("agentbench", "", ["", "dev", "test", "all"],
                        "AgentBench OS tasks (inspect-evals package) of this split")
_TB2 = flags.DEFINE_string("tb2_dir", "", "a folder of Terminal-Bench 2 task folders")
_HE = flags.DEFINE_string("humaneval", "", "a HumanEval-format JSONL(.gz) file")
_COMP = flags.DEFINE_enum("completions", "model", ["model", "canonical", "empty"],
                          "what to score: model samples, or the file's canonical/empty solutions")
_N = flags.DEFINE_integer("n_samples", 1, "samples per task")
_K = flags.DEFINE_string("k", "1", "comma-separated k values for pass@k")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TEMPS = flags.DEFINE_string("temperatures", "", "comma-separated: sweep these on the val split "
                             "and report each domain's pass@k at its best one (test split)")
_JSON = flags.DEFINE_string("json", "", "write the result here")
_EXPERTS = flags.DEFINE_enum("experts", "bf16", ["bf16", "mxfp4"],
                             "expert weights to sample with (mxfp4: packed, grouped MXFP4 matmul)")
_SAMPLES_OUT = flags.DEFINE_string("samples_out", "", "write every sample here (JSONL: task id, "
                                   "domain, template, prompt, sample, reward, text, scoring "
                                   "details)")
_BY_TPL = flags.DEFINE_bool("by_template", False, "also print each domain's pass@1 and solved "
                            "tasks per generator template (the --json result always has them)")


def print_table(res: dict, title: str = "") -> None:
    if title:
        print(title)
    keys = sorted({k for v in res.values() if isinstance(v, dict) for k in v
                   if k.startswith("pass@") and not k.endswith(("_lo", "_hi"))})
    temp = any("temperature" in v for v in res.values() if isinstance(v, dict))
    w = max([14] + [len(d) + 2 for d, v in res.items() if isinstance(v, dict)])
    print(f"{'domain':<{w}}{'tasks':>7}" + (f"{'T':>6}" if temp else "")
          + "".join(f"{k:>10}" for k in keys) + "   95% CI pass@1")
    for dom, v in res.items():
        if not isinstance(v, dict):
            continue
        ep = (f"   {v['turns_mean']:.2f} turns, {v['episode_tokens_mean']:.0f} tokens/episode"
              if "turns_mean" in v else "")
        print(f"{dom:<{w}}{v['tasks']:>7}" + (f"{v['temperature']:>6.2g}" if temp else "")
              + "".join(f"{100 * v.get(k, float('nan')):>9.1f}%" for k in keys)
              + f"   [{100 * v['pass@1_lo']:.1f}, {100 * v['pass@1_hi']:.1f}]" + ep)


def print_templates(res: dict) -> None:
    """Per domain and generator template ("by_template" of rl.pipeline.evaluate): tasks,
    pass@1 and the tasks at least one sample solved."""
    if not any(isinstance(v, dict) and "by_template" in v for v in res.values()):
        print("(no task here names a generator template: meta['template'])")
        return
    w = max([14] + [len(d) + 2 for d in res])
    tw = max([18] + [len(str(tpl)) + 2 for v in res.values() if isinstance(v, dict)
                     for tpl in v.get("by_template", {})])
    print(f"{'domain':<{w}}{'template':<{tw}}{'tasks':>6}{'pass@1':>9}{'solved':>8}")
    for dom, v in res.items():
        for tpl, t in (v.get("by_template", {}) if isinstance(v, dict) else {}).items():
            print(f"{dom:<{w}}{tpl:<{tw}}{t['tasks']:>6}{100 * t['pass@1']:>8.1f}%{t['solved']:>8}")


def score_given(tasks, completions, verifier, keep_samples: bool = False) -> dict:
    from rl.metrics import wilson_interval
    from rl.pipeline import sample_record, task_domain, task_template, template_breakdown

    results = verifier.verify_batch(tasks, completions)
    per, per_tpl = {}, {}
    for t, (score, _) in zip(tasks, results):
        per.setdefault(task_domain(t), []).append(score >= 1.0)
        per_tpl.setdefault(task_domain(t), {}).setdefault(task_template(t), []).append(
            int(score >= 1.0))
    out = {}
    for d, ok in per.items():
        p = sum(ok) / len(ok)
        lo, hi = wilson_interval(p, len(ok))
        out[d] = {"tasks": len(ok), "pass@1": p, "pass@1_lo": lo, "pass@1_hi": hi}
        if any(tpl is not None for tpl in per_tpl[d]):
            out[d]["by_template"] = template_breakdown(per_tpl[d], 1)
    if keep_samples:
        out["_samples"] = [sample_record(t, 0, float(score), c, detail)
                           for t, c, (score, detail) in zip(tasks, completions, results)]
    return out


def score_episodes(tasks, pool, empty: bool, keep_samples: bool = False, threads: int = 4) -> dict:
    """Episode task sets without a model: each task's reference solution (or an empty episode)
    played in a session (rl.envs.play_reference); the table of score_given plus turns and
    tokens per episode."""
    from concurrent.futures import ThreadPoolExecutor

    from rl.envs import EnvConfig, SessionEnv, play_reference
    from rl.metrics import wilson_interval
    from rl.pipeline import sample_record, task_domain, task_template, template_breakdown

    def one(task):
        cfg = EnvConfig(max_turns=len(task.meta.get("solution") or []) + 2, command_timeout_s=30.0,
                        max_episode_tokens=1 << 20, session_disk_mb=64)
        env = SessionEnv([task], executor=pool, config=cfg)
        try:
            steps = play_reference(env, 0, empty=empty)
        finally:
            env.close()
        return steps[-1].reward if steps[-1].info.get("status") != "sandbox_error" else 0.0, \
            len(steps), steps[-1].info

    with ThreadPoolExecutor(max_workers=threads) as ex:
        played = list(ex.map(one, tasks))
    per, out = {}, {}
    for t, (reward, turns, info) in zip(tasks, played):
        per.setdefault(task_domain(t), []).append((t, reward, turns, info))
    for d, rows in per.items():
        p = sum(r >= 1.0 for _, r, _, _ in rows) / len(rows)
        lo, hi = wilson_interval(p, len(rows))
        by_tpl = {}
        for t, r, _, _ in rows:
            by_tpl.setdefault(task_template(t), []).append(int(r >= 1.0))
        out[d] = {"tasks": len(rows), "pass@1": p, "pass@1_lo": lo, "pass@1_hi": hi,
                  "turns_mean": sum(n for _, _, n, _ in rows) / len(rows),
                  "episode_tokens_mean": sum(i.get("tokens", 0) for *_, i in rows) / len(rows),
                  "by_template": template_breakdown(by_tpl, 1)}
    if keep_samples:
        out["_samples"] = [sample_record(t, 0, float(r), json.dumps(info, default=str), info)
                           for t, (r, _, info) in zip(tasks, played)]
    return out


def _episode_tasks() -> list:
    """--agentbench / --tb2_dir tasks (the skipped ones printed with their reasons)."""
    tasks = []
    if _AB.value:
        from sandbox.tasks.agentbench import load_agentbench_os
        found = load_agentbench_os(_AB.value)
        print(found.summary())
        tasks += found.tasks
    if _TB2.value:
        from sandbox.tasks.terminal_bench import load_tb2_dir
        found = load_tb2_dir(_TB2.value)
        print(found.summary())
        tasks += found.tasks
    return tasks


def write_samples(res: dict, path: str) -> None:
    """Move res["_samples"] (one record per task and sample) to a JSONL file at path."""
    samples = res.pop("_samples")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in samples:
            f.write(json.dumps(r) + "\n")
    print(f"{len(samples)} samples written to {path}")


def _temperatures() -> tuple:
    """--temperatures parsed and checked against the other flags (empty: not a sweep)."""
    if not _TEMPS.value:
        return ()
    try:
        temps = tuple(float(t) for t in _TEMPS.value.split(","))
    except ValueError:
        raise SystemExit(f"--temperatures={_TEMPS.value}: give comma-separated numbers, "
                         "e.g. 0,0.5,1") from None
    if _HE.value or _TASKS.value or _AB.value or _TB2.value or _COMP.value != "model":
        raise SystemExit("--temperatures chooses on the config's val split: use it with the "
                         "generator tasks and model completions (no --humaneval/--task_file)")
    if _SPLIT.value != "test":
        raise SystemExit("--temperatures chooses on the val split, so it reports the test "
                         "split: drop --split=val")
    if min(temps) < 0:
        raise SystemExit(f"--temperatures={_TEMPS.value}: temperatures must be >= 0")
    return temps


def main(_):
    config = _common.load_run_config(_CONFIG.value)  # a released checkpoint's run: its model
    if _DRY.value:  # section and tokenizer are the checkpoint's
        for f in (_HE.value, _TASKS.value, _TB2.value):
            if f and not os.path.exists(f):
                raise SystemExit(f"no such file: {f}")
        _temperatures()
        _common.dry_run(config, ('rl',))
        return
    temps = _temperatures()
    _common.setup_jax()
    import jax

    from model.tokenizer import load_tokenizer
    from rl.pipeline import evaluate
    from rl.sampler import SamplingConfig
    from train.data import load_task_splits
    from train.models import config_model
    from train.rollouts import make_rollout_worker, open_pool
    from train.weights import checkpoint_variables, load_sft_variables

    pool, verifier = open_pool(config)
    tables = None  # title -> result, when not the one table of `res`
    try:
        episodes = bool(_AB.value or _TB2.value)
        if episodes:
            tasks = _episode_tasks()
        elif _HE.value:
            from sandbox.tasks import load_humaneval
            tasks = load_humaneval(_HE.value)
        elif _TASKS.value:
            from sandbox.tasks import load_tasks
            tasks = load_tasks(_TASKS.value)
        else:
            tasks = [t for t, _ in load_task_splits(config)[_SPLIT.value]]
        if _COMP.value != "model" and episodes:
            res = score_episodes(tasks, pool, empty=_COMP.value == "empty",
                                 keep_samples=bool(_SAMPLES_OUT.value))
        elif _COMP.value != "model":
            comps = [t.canonical_solution if _COMP.value == "canonical" else "" for t in tasks]
            res = score_given(tasks, comps, verifier, keep_samples=bool(_SAMPLES_OUT.value))
        else:
            from model import interchange, quant

            model, tok = config_model(config), load_tokenizer(config.tokenizer)
            if os.path.exists(os.path.join(_CKPT.value, interchange.INDEX_FILE)):
                cfg, variables = interchange.import_safetensors(_CKPT.value)
            elif _CKPT.value == "sft":
                cfg, variables = model.cfg, load_sft_variables(config, model)
            elif _CKPT.value == "hf":
                cfg, variables = model.cfg, checkpoint_variables(config, model)
            else:
                from train.weights import load_rl_variables
                path = None if _CKPT.value == "rl" else _CKPT.value
                cfg, variables = model.cfg, load_rl_variables(config, model, path)
            model, variables = quant.inference_model(
                cfg, variables, experts=_EXPERTS.value,
                high_precision=quant.parse_modules(config.quant.high_precision))
            if _EXPERTS.value == "mxfp4":
                b = quant.expert_bytes(variables["params"])
                print(f"experts: {model.cfg.moe.expert_format}, {b['experts']} bytes "
                      f"({b['expert_ratio_vs_bf16']:.4f} of bf16), other {b['other']} bytes")
            ks = tuple(int(k) for k in _K.value.split(","))
            sampling = SamplingConfig(max_new_tokens=config.rl.max_new_tokens,
                                      temperature=_TEMP.value, eos_id=tok.eos_id,
                                      speculative=config.rl.speculative,
                                      draft_tokens=config.rl.draft_tokens)
            if temps:
                from rl.pipeline import evaluate_at_best_temperatures
                from train.rollouts import workers_by_temperature
                val = [t for t, _ in load_task_splits(config)["val"]]
                worker_at = workers_by_temperature(config.rl, model, tok, sampling, verifier,
                                                   pool, tasks=val + tasks)
                best = evaluate_at_best_temperatures(
                    worker_at, variables, val, tasks, jax.random.key(0), temperatures=temps,
                    n_samples=_N.value, ks=ks, batch_prompts=config.eval.batch_prompts,
                    keep_samples=bool(_SAMPLES_OUT.value))
                for t, r in best["val_sweep"].items():
                    print_table(r, f"val split, temperature {t:g}")
                tables = {f"test split: pass@{k} at the temperature with the best val "
                          f"pass@{k}": best[f"pass@{k}"] for k in ks}
                res = best
            else:
                worker = make_rollout_worker(config.rl, model, tok, sampling, verifier, pool,
                                             group_size=_N.value, tasks=tasks)
                # eval.batch_prompts rows per generate call whatever n_samples is (the demo's
                # shapes; multi-turn rows are sandbox sessions, capped by the pool)
                res = evaluate(worker, variables, tasks, jax.random.key(0), n_samples=_N.value,
                               ks=ks,
                               batch_prompts=max(1, config.eval.batch_prompts // _N.value),
                               keep_samples=bool(_SAMPLES_OUT.value))
        if _SAMPLES_OUT.value:
            write_samples(res, _SAMPLES_OUT.value)
        for title, r in (tables or {f"pass@k ({len(tasks)} tasks, completions={_COMP.value})":
                                    res}).items():
            print_table(r, title)
            if _BY_TPL.value:
                print_templates(r)
        if _JSON.value:
            os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
            with open(_JSON.value, "w") as f:
                json.dump(res, f, indent=2)
    finally:
        pool.close()


if __name__ == "__main__":
    app.run(main, flags_parser=_common.parse_flags)
