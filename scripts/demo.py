"""The main job: SFT from scratch, then GRPO over three sandbox-verified domains, then held-out
evaluation, on 2 CPU cores.

    python scripts/demo.py                                   # configs/rl.py:demo (time: README)
    python scripts/demo.py --config configs/rl.py:smoke      # the same pipeline, smaller
    python scripts/demo.py --config.rl.steps=300             # any field is overridable

Writes to <workdir>: sft/ and rl/ (orbax checkpoints, TensorBoard events, metrics.jsonl),
demo_results.json (each checkpoint, SFT and SFT+RL, at its best temperature: val pass@1 and
pass@k (k = --eval_samples) at each of eval.temperatures (0 = greedy), then per domain test
pass@1 at the temperature with the best val pass@1 and test pass@k at the one with the best val
pass@k, with 95% intervals, and per generator template pass@1 and the tasks any sample solved;
the DSA indexer's recall of the true top-k attention keys on held-out text at random init,
after the indexer warm-up (configs with one), after SFT and after RL), samples_sft.jsonl and
samples_rl.jsonl (every test sample of those evaluations: prompt, text or an episode's whole
transcript, reward, scoring details, temperature; `rl.pipeline.sample_record`),
demo_plot.png (RL reward and held-out val pass@1 per domain against RL step); demo_results.json
also records the environment (Python, package versions, allocator, XLA_FLAGS:
`_common.environment`). Prints the val
sweep, the per-domain before/after tables and the templates either checkpoint fails on some
test task (pass@1 and tasks solved, before and after). Re-running resumes finished phases from
their checkpoints when they came from the same config (else it stops, naming the fields that
differ: train/workdir.py); --noresume starts over, moving the previous sft/ and rl/ aside.
"""

import json
import os
import time

import _common  # noqa: F401
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo", "RL config")
_DRY = _common.define_dry_run()
_RESUME = flags.DEFINE_bool("resume", True, "reuse finished phases / checkpoints in workdir")
_SAMPLES = flags.DEFINE_integer("eval_samples", 4, "sampled completions per task (the k of "
                                "pass@k) at the temperatures > 0 of eval.temperatures")


def _table(before, after, metric):
    lines = [f"held-out {metric}, each checkpoint at the temperature with the best val {metric}",
             f"{'domain':<12}{'tasks':>6}{'T':>5}{'SFT':>8}{'95% CI':>14}{'T':>6}{'SFT+RL':>8}"
             f"{'95% CI':>14}{'delta':>8}"]
    ci = lambda r: f"[{100 * r[metric + '_lo']:.1f},{100 * r[metric + '_hi']:.1f}]"
    for d, b in before[metric].items():
        if not isinstance(b, dict):
            continue
        a = after[metric][d]
        lines.append(f"{d:<12}{b['tasks']:>6}{b['temperature']:>5.2g}{100 * b[metric]:>7.1f}%"
                     f"{ci(b):>14}{a['temperature']:>6.2g}{100 * a[metric]:>7.1f}%{ci(a):>14}"
                     f"{100 * (a[metric] - b[metric]):>+8.1f}")
    return "\n".join(lines)


def _template_table(before, after, metric="pass@1"):
    """Test pass@1 per generator template, SFT -> SFT+RL (each checkpoint at the domain's
    temperature for `metric`), for the templates either checkpoint fails on some task: where
    RL moved and where neither solves anything."""
    lines = [f"held-out pass@1 by generator template (at each checkpoint's {metric} "
             "temperature), templates below 100% in either",
             f"{'domain':<12}{'template':<16}{'tasks':>6}{'SFT':>8}{'SFT+RL':>8}{'delta':>8}"
             f"{'solved':>12}"]
    for d, b in before[metric].items():
        if not isinstance(b, dict):
            continue
        ta = after[metric][d].get("by_template", {})
        for tpl, tb in b.get("by_template", {}).items():
            a = ta.get(tpl)
            if a is None or min(tb["pass@1"], a["pass@1"]) >= 1.0:
                continue
            lines.append(f"{d:<12}{tpl:<16}{tb['tasks']:>6}{100 * tb['pass@1']:>7.1f}%"
                         f"{100 * a['pass@1']:>7.1f}%{100 * (a['pass@1'] - tb['pass@1']):>+8.1f}"
                         f"{tb['solved']:>7} -> {a['solved']}")
    return "\n".join(lines)


def _sweep_table(before, after):
    """Val pass@1 per domain at each swept temperature, SFT -> SFT+RL."""
    sb, sa = before["val_sweep"], after["val_sweep"]
    doms = [d for d, v in next(iter(sb.values())).items() if isinstance(v, dict)]
    lines = ["val pass@1 by sampling temperature (0 = greedy), SFT -> SFT+RL",
             f"{'T':>5}" + "".join(f"{d:>20}" for d in doms)]
    for t in sb:
        lines.append(f"{t:>5.2g}" + "".join(
            f"{100 * sb[t][d]['pass@1']:>11.1f} ->{100 * sa[t][d]['pass@1']:>5.1f}" for d in doms))
    return "\n".join(lines)


def _plot(path, rl_metrics, val_curve):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def smooth(xs, w=10):  # trailing mean over the last w steps that have a value
        xs = np.asarray(xs, float)
        out = np.full_like(xs, np.nan)
        for i in range(len(xs)):
            win = xs[max(0, i - w + 1): i + 1]
            if np.isfinite(win).any():
                out[i] = np.nanmean(win)
        return out

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in rl_metrics]
    for key in sorted({k for m in rl_metrics for k in m if k.startswith("rl/reward/")}):
        ax[0].plot(steps, smooth([m.get(key, float("nan")) for m in rl_metrics]), label=key[10:])
    ax[0].plot(steps, smooth([m.get("rl/reward_mean", float("nan")) for m in rl_metrics]), "k--",
               label="all")
    ax[0].set(xlabel="RL step", ylabel="mean reward of training rollouts (10-step mean)",
              title="reward")
    ax[0].legend()
    for d in sorted({d for _, r in val_curve for d in r if not d.startswith("_")}):
        ax[1].plot([s for s, _ in val_curve], [100 * r[d]["pass@1"] for _, r in val_curve],
                   marker="o", label=d)
    ax[1].set(xlabel="RL step", ylabel="held-out val pass@1 (%)", title="validation")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(_):
    config = _common.load_run_config(_CONFIG.value)
    if _DRY.value:
        _common.dry_run(config, ('sft', 'rl'))
        return
    _common.setup_jax()
    _common.stop_on_bad_config(config, ('sft', 'rl'))
    import functools

    import jax

    from model.tokenizer import load_tokenizer
    from rl.pipeline import evaluate_at_best_temperatures
    from rl.sampler import SamplingConfig
    from train.data import load_task_splits
    from train.models import config_model
    from train.rl import run_rl
    from train.rollouts import open_pool, workers_by_temperature
    from train.sft import heldout_text, run_sft
    from train.weights import load_rl_variables, load_sft_variables, load_warmup_variables
    from train.workdir import check_resumable

    if _RESUME.value:  # both phases' checkpoints must be this config's before anything runs
        with _common.stop_on_workdir_mismatch():
            check_resumable(config, "sft")
            check_resumable(config, "rl")
    os.makedirs(config.workdir, exist_ok=True)
    t0 = time.time()
    print(f"[demo] workdir {config.workdir}: SFT {config.sft.steps} steps, RL "
          f"{config.rl.steps} steps ({config.rl.algo.name}), domains {config.tasks.domains}")
    run_sft(config, resume=_RESUME.value)
    t_sft = time.time() - t0

    model, tok = config_model(config), load_tokenizer(config.tokenizer)
    pool, verifier = open_pool(config)
    try:
        splits = load_task_splits(config)
        val, test = ([t for t, _ in splits[k]] for k in ("val", "test"))
        base = SamplingConfig(max_new_tokens=config.rl.max_new_tokens, temperature=0.0,
                              eos_id=tok.eos_id, speculative=config.rl.speculative,
                              draft_tokens=config.rl.draft_tokens)
        worker_at = workers_by_temperature(config.rl, model, tok, base, verifier, pool,
                                           tasks=val + test)
        n = _SAMPLES.value
        evaluate = functools.partial(
            evaluate_at_best_temperatures, worker_at, val=val, test=test, rng=jax.random.key(1),
            temperatures=config.eval.temperatures, n_samples=n, ks=(1, n),
            batch_prompts=config.eval.batch_prompts, keep_samples=True)
        before = evaluate(load_sft_variables(config, model))
        t_eval0 = time.time()
        val_curve = []
        run_rl(config, resume=_RESUME.value, pool=pool,
               on_eval=lambda step, res: val_curve.append((step, res)))
        t_rl = time.time() - t_eval0
        rl_vars = load_rl_variables(config, model)
        after = evaluate(rl_vars)
    finally:
        pool.close()

    # DSA indexer recall of the true top-k attention keys on held-out demonstrations, per stage
    text, valid = heldout_text(config, tok)
    # the random init placed on the device as the restored stages are: one recall program for
    # all of them (jit compiles a program per argument placement)
    stages = {"random init": jax.device_put(model.init(jax.random.key(config.seed)),
                                            jax.devices()[0]),
              "after warm-up": load_warmup_variables(config, model),
              "after SFT": load_sft_variables(config, model), "after RL": rl_vars}
    recall = {k: float(model.indexer_recall(v, text, valid)["mean"])
              for k, v in stages.items() if v is not None}

    with open(os.path.join(config.workdir, "rl", "metrics.jsonl")) as f:
        rl_metrics = [json.loads(line) for line in f if '"rl/reward_mean"' in line]
    plot = os.path.join(config.workdir, "demo_plot.png")
    _plot(plot, rl_metrics, val_curve)
    result = {"before": before, "after": after, "val_curve": val_curve,
              "indexer_recall": recall,
              "seconds": {"sft": t_sft, "rl": t_rl, "total": time.time() - t0},
              "config": config.to_dict(), "environment": _common.environment()}
    for name, res in (("sft", before), ("rl", after)):  # every test sample, apart
        with open(os.path.join(config.workdir, f"samples_{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in res.pop("_samples"))
    with open(os.path.join(config.workdir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    metrics = [m for m in before if m != "val_sweep"]
    print()
    print(_sweep_table(before, after))
    for m in metrics:
        print()
        print(_table(before, after, m))
    for m in metrics:  # multi-turn domains: turns and tokens per episode
        for d, b in before[m].items():
            if isinstance(b, dict) and "turns_mean" in b:
                a = after[m][d]
                print(f"{d} episodes (test, {m}'s temperatures {b['temperature']:g} -> "
                      f"{a['temperature']:g}): turns {b['turns_mean']:.2f} -> "
                      f"{a['turns_mean']:.2f}, tokens {b['episode_tokens_mean']:.0f} -> "
                      f"{a['episode_tokens_mean']:.0f} per episode")
    print()
    print(_template_table(before, after))
    print("\nDSA indexer recall of the top-k attention keys (held-out text): " + ", ".join(
        f"{k} {v:.3f}" for k, v in recall.items()))
    print(f"\n[demo] {time.time() - t0:.0f} s total (SFT {t_sft:.0f} s, RL {t_rl:.0f} s). "
          f"Artifacts: {config.workdir}/demo_results.json, "
          f"{config.workdir}/samples_{{sft,rl}}.jsonl, {plot}, TensorBoard: "
          f"{config.workdir}/{{sft,rl}}, final checkpoint: {config.workdir}/rl/checkpoints")


if __name__ == "__main__":
    app.run(main, flags_parser=_common.parse_flags)
