"""The main job: SFT from scratch, then GRPO over three sandbox-verified domains, then held-out
evaluation, on 2 CPU cores.

    python scripts/demo.py                                   # configs/rl.py:demo (time: README)
    python scripts/demo.py --config configs/rl.py:smoke      # the same pipeline, smaller
    python scripts/demo.py --config.rl.steps=300             # any field is overridable

Writes to <workdir>: sft/ and rl/ (orbax checkpoints, TensorBoard events, metrics.jsonl),
demo_results.json (per-domain pass@1 before/after with 95% intervals, greedy and sampled; the DSA
indexer's recall of the true top-k attention keys on held-out text at random init, after the
indexer warm-up, after SFT and after RL),
demo_plot.png (RL reward and held-out val pass@1 per domain against RL step). Prints the
per-domain before/after table. Re-running resumes finished phases from their checkpoints
(--noresume starts over).
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
_SAMPLES = flags.DEFINE_integer("eval_samples", 4, "sampled completions per test task")


def _eval_both(config, variables, tasks, worker_greedy, worker_sampled, n):
    import jax

    from rl.pipeline import evaluate
    g = evaluate(worker_greedy, variables, tasks, jax.random.key(1),
                 batch_prompts=config.eval.batch_prompts)
    s = evaluate(worker_sampled, variables, tasks, jax.random.key(2), n_samples=n,
                 batch_prompts=max(1, config.eval.batch_prompts // n))
    return {"greedy": g, "sampled": s}


def _table(before, after, mode):
    lines = [f"held-out pass@1 ({mode})",
             f"{'domain':<12}{'tasks':>6}{'SFT':>8}{'95% CI':>16}{'SFT+RL':>9}{'95% CI':>16}"
             f"{'delta':>8}"]
    ci = lambda r: f"[{100 * r['pass@1_lo']:.1f},{100 * r['pass@1_hi']:.1f}]"
    for d, b in before[mode].items():
        if not isinstance(b, dict):
            continue
        a = after[mode][d]
        lines.append(f"{d:<12}{b['tasks']:>6}{100 * b['pass@1']:>7.1f}%{ci(b):>16}"
                     f"{100 * a['pass@1']:>8.1f}%{ci(a):>16}"
                     f"{100 * (a['pass@1'] - b['pass@1']):>+7.1f}")
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
    if _DRY.value:
        from rl.loop import validate_run_config
        print(validate_run_config(_CONFIG.value, phases=('sft', 'rl')))
        return
    _common.setup_jax()
    import dataclasses

    from model.tokenizer import load_tokenizer
    from rl.loop import (
        _model,
        _open_pool,
        heldout_text,
        load_rl_variables,
        load_sft_variables,
        load_task_splits,
        load_warmup_variables,
        make_rollout_worker,
        run_rl,
        run_sft,
    )
    from rl.sampler import SamplingConfig

    config = _CONFIG.value
    os.makedirs(config.workdir, exist_ok=True)
    t0 = time.time()
    print(f"[demo] workdir {config.workdir}: SFT {config.sft.steps} steps, RL "
          f"{config.rl.steps} steps ({config.rl.algo.name}), families {config.tasks.families}")
    run_sft(config, resume=_RESUME.value)
    t_sft = time.time() - t0

    model, tok = _model(config), load_tokenizer(config.tokenizer)
    pool, verifier = _open_pool(config)
    try:
        test = [t for t, _ in load_task_splits(config)["test"]]
        base = SamplingConfig(max_new_tokens=config.rl.max_new_tokens, temperature=0.0,
                              eos_id=tok.eos_id, speculative=config.rl.speculative,
                              draft_tokens=config.rl.draft_tokens)
        w_greedy = make_rollout_worker(config.rl, model, tok, base, verifier, pool, group_size=1,
                                       tasks=test)
        w_sampled = make_rollout_worker(config.rl, model, tok,
                                        dataclasses.replace(base, temperature=1.0), verifier,
                                        pool, group_size=_SAMPLES.value, tasks=test)
        before = _eval_both(config, load_sft_variables(config, model), test, w_greedy, w_sampled,
                            _SAMPLES.value)
        t_eval0 = time.time()
        val_curve = []
        run_rl(config, resume=_RESUME.value, pool=pool,
               on_eval=lambda step, res: val_curve.append((step, res)))
        t_rl = time.time() - t_eval0
        rl_vars = load_rl_variables(config, model)
        after = _eval_both(config, rl_vars, test, w_greedy, w_sampled, _SAMPLES.value)
    finally:
        pool.close()

    # DSA indexer recall of the true top-k attention keys on held-out demonstrations, per stage
    import jax
    text, valid = heldout_text(config, tok)
    stages = {"random init": model.init(jax.random.key(config.seed)),
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
              "config": config.to_dict()}
    with open(os.path.join(config.workdir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print()
    print(_table(before, after, "sampled"))
    print()
    print(_table(before, after, "greedy"))
    for mode in ("greedy", "sampled"):  # multi-turn domains: turns and tokens per episode
        for d, b in before[mode].items():
            if isinstance(b, dict) and "turns_mean" in b:
                a = after[mode][d]
                print(f"{d} episodes ({mode}): turns {b['turns_mean']:.2f} -> "
                      f"{a['turns_mean']:.2f}, tokens {b['episode_tokens_mean']:.0f} -> "
                      f"{a['episode_tokens_mean']:.0f} per episode")
    print("\nDSA indexer recall of the top-k attention keys (held-out text): " + ", ".join(
        f"{k} {v:.3f}" for k, v in recall.items()))
    print(f"\n[demo] {time.time() - t0:.0f} s total (SFT {t_sft:.0f} s, RL {t_rl:.0f} s). "
          f"Artifacts: {config.workdir}/demo_results.json, {plot}, TensorBoard: "
          f"{config.workdir}/{{sft,rl}}, final checkpoint: {config.workdir}/rl/checkpoints")


if __name__ == "__main__":
    app.run(main)
