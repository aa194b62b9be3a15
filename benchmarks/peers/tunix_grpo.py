"""google-tunix 0.1.7 GRPO on the matched work (benchmarks/peers/__init__.py:MATCHED), then its
sampler alone (tunix_sampler.py), in one fresh process.

Run with the PEER's python from the repository root (scripts/setup_peers.sh makes the venv):

    ~/peer-venvs/tunix/bin/python -m benchmarks.peers.tunix_grpo --steps 2 --reps 2

GRPOLearner.train runs 1 + steps iterations (the first compiles) of tunix's own loop: rollout
with the vanilla engine on the actor's weights, reference log-probs (beta 0.04), the reward
function on the host, GRPO advantages, one AdamW update (num_iterations 1). The GRPO part runs
first, in a cold process, so its first iteration holds every compile. Clock samples (the same
names the project side uses): setup (models, cluster and learner built), iteration (tunix's _run_global_step), rollout (RLCluster.generate),
prefill / decode (the sampler's compiled functions inside it), logp_ref, logp_old (tunix skips
this pass when each batch is used for one update: old = the current log-probs, stop-gradient),
score (the reward function: synchronous in tunix), train_step (the jitted update, blocked on the
actor's state). Compile seconds come from jax.monitoring, booked to the sample running.

Prints (and with --out writes) one JSON record; the project never imports this module.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.peers import MATCHED, Clock, emit, loadavg
from benchmarks.peers.tunix_sampler import (
    IdTokenizer,
    make_model,
    measure,
    param_count,
    prompt_texts,
    versions,
)


def even_fraction(prompts, completions, **_):
    """The matched reward: the fraction of even ids among a completion's tokens."""
    out = []
    for text in completions:
        ids = [int(t) for t in text.split()]
        out.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


class _TimedStep:
    """tunix's jitted train step, timed; keeps `.func` (the trainer reads its jit cache size)."""

    def __init__(self, step, timed):
        self.func, self._timed = step.func, timed

    def __call__(self, *args, **kwargs):
        return self._timed(*args, **kwargs)


def grpo(clock: Clock, spec: dict, steps: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    t_start = time.perf_counter()  # setup: models, cluster, learner (compiles booked to "setup")
    P, G = spec["prompt_len"], spec["new_tokens"]
    rows = spec["prompts"] * spec["group"]
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    actor, reference = make_model(spec, spec["seed"]), make_model(spec, spec["seed"])
    optimizer = optax.adamw(spec["lr"], b1=spec["b1"], b2=spec["b2"], eps=spec["eps"],
                            weight_decay=spec["weight_decay"])
    cluster = rlc.RLCluster(
        actor=actor, reference=reference, tokenizer=IdTokenizer(spec["vocab"]),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rlc.RLTrainingConfig(actor_optimizer=optimizer,
                                                 eval_every_n_steps=10**9, max_steps=1 + steps),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=G, max_prompt_length=P, kv_cache_size=P + G,
                temperature=spec["temperature"], top_p=spec["top_p"], top_k=None)))
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=even_fraction,
        algo_config=grpo_learner.GRPOConfig(num_generations=spec["group"], num_iterations=1,
                                            beta=spec["kl_coef"], epsilon=spec["clip"]))
    model = cluster.actor_trainer.model

    sampler = cluster.rollout._sampler
    sampler._compiled_prefill_fn = clock.wrap(sampler._compiled_prefill_fn, "prefill",
                                              lambda s: s.token_buffer)
    sampler._compiled_decode_fn = clock.wrap(sampler._compiled_decode_fn, "decode",
                                             lambda s: s.token_buffer)
    generated = []
    generate = clock.wrap(cluster.generate, "rollout", lambda out: None)

    def counted_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        generated.append(int(sum(len(t) for t in out.tokens)))
        return out

    cluster.generate = counted_generate
    cluster.get_ref_per_token_logps = clock.wrap(cluster.get_ref_per_token_logps, "logp_ref")
    cluster.get_old_per_token_logps = clock.wrap(cluster.get_old_per_token_logps, "logp_old")
    learner._compute_rewards = clock.wrap(learner._compute_rewards, "score", lambda out: None)
    trainer = cluster.actor_trainer
    make_steps = trainer.jit_train_and_eval_step

    def timed_steps(*args, **kwargs):
        train_step, eval_step = make_steps(*args, **kwargs)
        timed = clock.wrap(train_step, "train_step", lambda out: (out, nnx.state(model)))
        return _TimedStep(train_step, timed), eval_step

    trainer.jit_train_and_eval_step = timed_steps
    learner._run_global_step = clock.wrap(learner._run_global_step, "iteration",
                                          lambda out: nnx.state(model))

    rng = np.random.default_rng(spec["seed"])

    def batches():
        for _ in range(1 + steps):
            yield {"prompts": np.array(prompt_texts(rng, spec["prompts"], spec))}

    before = jax.tree.map(lambda x: np.array(x, copy=True), nnx.state(model, nnx.Param))
    clock.add("setup", time.perf_counter() - t_start)
    learner.train(batches())
    clock.phase = "after_grpo"
    after = nnx.state(model, nnx.Param)
    change = float(np.sqrt(sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in
                               zip(jax.tree.leaves(before), jax.tree.leaves(after)))))
    n_iter = len(clock.samples.get("iteration", []))
    if n_iter != 1 + steps or any(n != rows * G for n in generated) or not change > 0:
        raise RuntimeError(f"tunix ran {n_iter} iterations (wanted {1 + steps}), generated "
                           f"{generated} tokens per rollout (wanted {rows * G} each) and moved its "
                           f"parameters by {change}: the work is not the matched work")
    return {"params": param_count(model), "param_change_l2": change}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="GRPO iterations after the first")
    p.add_argument("--reps", type=int, default=3,
                   help="timed sampler calls per shape (0: no sampler-alone part)")
    p.add_argument("--out", help="also write the JSON record here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 0:
        p.error("--steps must be >= 1 and --reps >= 0")
    import os

    import jax

    clock = Clock()
    jax.monitoring.register_event_duration_secs_listener(clock.listen)
    rec = {"side": "tunix", "versions": versions(), "load_before": loadavg(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "steps": args.steps}
    rec.update(grpo(clock, MATCHED, args.steps))
    if args.reps:
        rec["decode_flops_per_token"] = measure(clock, MATCHED, args.reps)["decode_flops_per_token"]
    rec.update(load_after=loadavg(), clock=clock.record(), spec=MATCHED)
    emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
