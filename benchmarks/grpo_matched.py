"""The project's side of the peer benchmark: the matched GRPO work (benchmarks/peers:MATCHED)
through this project's RL engine, in one fresh process (benchmarks/grpo_peer.py starts it).

    python -m benchmarks.grpo_matched --variant hybrid --steps 2 --reps 2
    python -m benchmarks.grpo_matched --variant dense --set rl.algo.kl_coef=0.0

Variants (the model; everything else is the same run):
  hybrid  the `tiny` preset's layout (KDA, KDA, KDA, DSA; sparse MoE after a dense first layer;
          one MTP module) widened to the peer's size: d_model 256, 4 heads of 64, vocab 512;
  dense   the same engine with 4 DSA layers in dense-attention mode (indexer warm-up stage, no
          indexer loss), a dense SwiGLU of 1024 and no MTP: the closest this model gets to the
          peer's plain transformer.

The run is configs/rl.py:demo with the matched work's fields (rl.prompts_per_batch 8,
rl.group_size 4, rl.max_prompt_len 32, rl.max_new_tokens 64, rl.temperature 0.9, rl.algo.kl_coef
0.04, optim: AdamW lr 1e-5, b2 0.999, weight decay 1e-4, no clipping, constant lr) and
rl.init_from=scratch; `--set a.b=value` overrides any field (as --config.a.b=value does for the
scripts), so engine options added later can be measured without touching this file. One
iteration is train/rl.py:run_rl's (with rl.overlap_scoring off: generate, wait for the scores,
train): the rollout worker (rl.pipeline.RolloutWorker via train.rollouts.make_rollout_worker) generates
and submits the rewards, train.rl.train_on_group builds the batch (rl.pipeline.build_train_batch, with
train.rollouts.RolloutForward's separate log-prob passes where rl.old_logp_pass and rl.ref_logp_pass
need them: by default neither runs, the step taking its own log-probs as the old ones and the
reference log-probs inside its program) and runs the train step (rl.train_step.make_train_step), all on the config's mesh (one
device), wired as train.rl.run_rl wires them (mirrored here: keep the two in step). As in run_rl,
the update's programs compile on a thread (train.rl.precompile_updates; `--set
rl.precompile=False` compiles each at its first call): from the train state's shapes during the
set-up, before the weights are made, when the rollout-time forward has nothing to run (the
default), else from the state, started with the first iteration.
The reward is the matched work's host function (even-id fraction) on a thread, in place of the
sandbox; its wait is the `score` sample. The GRPO part runs first, in a cold process with no persistent compilation cache,
so its first iteration holds every compile; then the sampler alone (the rollout worker's
generate) at 64 and 1 new tokens, batch 32 (8 prompts x 4) and 1.

Clock samples (the names tunix_grpo.py uses): setup (model, train state, reference, rollout
worker and programs built), iteration, rollout (RolloutWorker.start: prompts
encoded, generated, texts decoded, rewards submitted), logp_old, logp_ref, train_step, score;
sampler_b{B}_g{G}. The project's prefill and decode inside a rollout are one compiled program,
so the driver estimates the in-iteration prefill by the 1-token call (sampler_b32_g1).
Prints (and with --out writes) one JSON record.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import os
import sys
import tempfile
import time

from benchmarks.peers import MATCHED, Clock, emit, flops_per_row, loadavg

VARIANTS = ("hybrid", "dense")


def model_config(variant: str, spec: dict = MATCHED):
    """The model of a variant at the matched size (an ml_collections.ConfigDict)."""
    from configs import models

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    c = models.tiny()
    c.vocab_size = spec["vocab"]
    c.d_model = 256
    c.kda.update(dict(num_heads=4, head_dim=64))
    if variant == "hybrid":
        c.dsa.update(dict(num_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                          qk_rope_head_dim=32, v_head_dim=64))
        c.moe.update(dict(num_experts=8, num_experts_per_tok=2, expert_dim=64, dense_dim=1024))
        return c
    c.name = "dense_matched"
    c.layer_pattern = "D"
    c.dsa.update(dict(num_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
                      qk_rope_head_dim=32, v_head_dim=64, index_n_heads=1, index_head_dim=16,
                      index_rope_dim=0, index_topk=spec["prompt_len"] + spec["new_tokens"],
                      indexer_stage="dense_warmup", indexer_loss_weight=0.0))
    c.moe.update(dict(num_experts=0, dense_dim=1024, first_dense_layers=0, aux_loss_coef=0.0))
    c.mtp.depth = 0
    return c


def apply_overrides(config, items) -> None:
    """`a.b=value` strings onto an ml_collections config, each value cast to the field's type
    (True/False for booleans; a placeholder's declared type)."""
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set wants key=value (e.g. rl.algo.kl_coef=0.0), got {item!r}")
        node, *path = config, *key.split(".")
        *parents, last = path
        for name in parents:
            node = node[name]
        if last not in node:
            raise ValueError(f"--set {item!r}: the config has no field {key!r}")
        old = node[last]
        if isinstance(old, bool):
            if value not in ("True", "False", "true", "false"):
                raise ValueError(f"--set {item!r}: {key} is a boolean (True or False)")
            node[last] = value in ("True", "true")
        elif old is None:  # a typed placeholder (e.g. rl.mtp_loss_weight) or an untyped None
            try:
                kind = node.get_ref(last).get_type()
            except ValueError:
                kind = str
            node[last] = kind(value)
        else:
            node[last] = type(old)(value)


def run_config(variant: str, overrides=(), spec: dict = MATCHED):
    """configs/rl.py:demo with the matched work's fields, the variant's model and overrides,
    validated (train/run_config.py's RunConfig)."""
    from configs import rl as rl_configs

    c = rl_configs.demo()
    c.name = f"matched_{variant}"
    c.workdir = os.path.join(tempfile.gettempdir(), "grpo_matched")
    c.model = model_config(variant, spec)
    c.rl.update(dict(prompts_per_batch=spec["prompts"], group_size=spec["group"],
                     max_prompt_len=spec["prompt_len"], max_new_tokens=spec["new_tokens"],
                     temperature=spec["temperature"], top_p=spec["top_p"], top_k=0,
                     init_from="scratch", overlap_scoring=False))
    c.rl.algo.update(dict(kl_coef=spec["kl_coef"], clip_low=spec["clip"],
                          clip_high=spec["clip"]))
    c.optim.update(dict(lr=spec["lr"], warmup_steps=1, final_lr_frac=1.0, b1=spec["b1"],
                        b2=spec["b2"], eps=spec["eps"], weight_decay=spec["weight_decay"],
                        clip_norm=0.0))
    c.eval.every = 0
    apply_overrides(c, overrides)
    from train.run_config import RunConfig

    return RunConfig.from_config(c)


class IdTokenizer:
    """Token ids written as space-separated text (the peer's prompts); BOS 1, PAD 0, and an
    end-of-sequence id (-1) that is never sampled, so every row generates max_new_tokens."""

    pad_id, bos_id, eos_id = 0, 1, -1

    def chat_prompt(self, prompt: str) -> str:
        return prompt

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + [int(t) for t in text.split()] + [self.eos_id] * eos

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)


class EvenFractionReward:
    """The matched work's reward (fraction of even ids in the completion), scored on a host
    thread behind the verifier interface the rollout worker submits to."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    @staticmethod
    def score(text: str):
        ids = [int(t) for t in text.split()]
        return sum(i % 2 == 0 for i in ids) / max(1, len(ids)), {"status": "ok"}

    def submit(self, task, text: str):
        return self._pool.submit(self.score, text)

    def close(self):
        self._pool.shutdown()


def _prompt_texts(rng, n: int, spec: dict) -> list[str]:
    ids = rng.integers(3, spec["vocab"], (n, spec["prompt_len"] - 1))  # [n, P-1]
    return [" ".join(str(int(x)) for x in row) for row in ids]


def build_trainer(config):
    """The trainer's pieces as train/rl.py:run_rl builds them, in its order: (model, algo,
    on_mesh (mesh and rules kwargs), optimizer, abstract train state (train.state.abstract_rl_state),
    and a function () -> (initial variables, train state) that makes them). The matched work is
    GRPO: an algorithm with a critic is an error."""
    import train.models
    import train.state
    import train.weights
    from model import sharding as shd
    from rl.algorithms import algo_from_config

    model, algo = train.models.rl_model(config), algo_from_config(config.rl.algo)
    if algo.needs_values:
        raise ValueError(f"rl.algo {algo.name!r} trains a critic; the matched work is GRPO")
    mesh, rules = shd.mesh_from_config(config)
    on_mesh = dict(mesh=mesh, rules=rules)
    opt = train.state.rl_optimizers(config, algo)[0]
    abstract = train.state.abstract_rl_state(config, model, algo, **on_mesh)

    def init():
        init_vars = train.weights.initial_variables(config, model, **on_mesh)
        return init_vars, train.state.init_rl_state(config, model, algo, init_vars, **on_mesh)[0]
    return model, algo, on_mesh, opt, abstract, init


def matched_train_step(config, model, algo, opt, state, sampling, on_mesh):
    """The train step as run_rl makes it: the state's shardings (`state` real or abstract), the
    old-log-prob source of rl.old_logp_pass, the reference log-probs' place of
    rl.ref_logp_pass, rl.mtp_loss_weight, rl.micro_batches."""
    import jax

    import train.rollouts
    from rl.train_step import make_train_step

    r = config.rl
    return make_train_step(model, algo, opt, micro_batches=r.micro_batches, sampling=sampling,
                           state_shardings=jax.tree.map(lambda x: x.sharding, state),
                           old_logp=train.rollouts.old_logp_source(r, algo),
                           ref_logp=train.rollouts.ref_logp_source(r, algo),
                           mtp_loss_weight=r.mtp_loss_weight, **on_mesh)


def grpo(clock: Clock, config, steps: int, spec: dict = MATCHED) -> dict:
    """1 + steps iterations of the matched GRPO work; returns facts about the run and what the
    sampler-alone part needs."""
    import jax
    import numpy as np

    import train.rl
    import train.rollouts
    import train.weights
    from rl.train_step import make_logp_fn
    from sandbox.tasks.schema import Task

    t_start = time.perf_counter()  # setup: model, state, workers (compiles booked to "setup")
    r = config.rl
    tok, reward = IdTokenizer(), EvenFractionReward()
    sampling = train.rollouts.rollout_sampling(r, tok.eos_id)
    rng_np = np.random.default_rng(spec["seed"])
    batches = [[Task(id=f"b{k}p{i}", family="matched", prompt=text)
                for i, text in enumerate(_prompt_texts(rng_np, r.prompts_per_batch, spec))]
               for k in range(1 + steps)]

    # as run_rl: the train step made on the state's shapes and, where the rollout-time forward
    # has nothing to run (rl.old_logp_pass, rl.ref_logp_pass), its programs compiling on a
    # thread from there (train.rl.precompile_updates; rl.precompile) while the weights are made
    # and the first rollout runs; else from the state, with the first iteration
    model, algo, on_mesh, opt, abstract, init = build_trainer(config)
    raw_step = matched_train_step(config, model, algo, opt, abstract, sampling, on_mesh)
    precompile = functools.partial(
        train.rl.precompile_updates, batches[0], len(batches[0]) * r.group_size, r.group_size,
        algo=algo, width=train.rl.train_width(r, batches[0]), step_fn=raw_step, **on_mesh)
    ahead = train.rollouts.RolloutForward.planned(r, algo, abstract, **on_mesh)
    compiling = [precompile(abstract, forward=ahead)] if r.precompile and not ahead.runs else []

    init_vars, state = init()
    sample_model, to_sampler = train.rollouts.rollout_policy(config, model, **on_mesh)
    worker = train.rollouts.make_rollout_worker(r, sample_model, tok, sampling, reward, None,
                                      group_size=r.group_size, tasks=batches[0], **on_mesh)

    # the trainer as run_rl wires it: the reference tree shaped like the policy's, the separate
    # old- and reference-log-prob passes only where rl.old_logp_pass / rl.ref_logp_pass need
    # them (the logp_ref sample is then absent: the train step holds that forward)
    ref_vars = train.weights.reference_variables(init_vars, state) if algo.needs_ref else None
    logp_fn = make_logp_fn(model, sampling, **on_mesh)
    timed_old, timed_ref = clock.wrap(logp_fn, "logp_old"), clock.wrap(logp_fn, "logp_ref")

    def logp(variables, tokens, mask):  # [N,L] -> [N,L]; which pass it is, by its weights
        return (timed_ref if variables is ref_vars else timed_old)(variables, tokens, mask)

    forward = dataclasses.replace(ahead, logp_fn=logp, ref_vars=ref_vars)
    step_fn = clock.wrap(raw_step, "train_step")
    train_on = functools.partial(train.rl.train_on_group, algo=algo, width=train.rl.train_width(r, batches[0]),
                                 forward=forward, step_fn=step_fn, **on_mesh)
    start = clock.wrap(worker.start, "rollout", lambda pending: None)
    p0 = jax.tree.map(lambda x: np.array(x, copy=True), state.params)  # host copies
    rng = jax.random.key(config.seed + 1)
    generated = []

    def iteration(tasks, rng):
        nonlocal state
        if r.precompile and ahead.runs and not generated:  # untimed forward: no logp sample
            compiling.append(precompile(state, forward=dataclasses.replace(forward,
                                                                           logp_fn=logp_fn)))
        pending = start(to_sampler(state.variables), tasks, rng, version=int(state.step))
        group = pending.result()
        clock.add("score", group.score_wait_s)
        generated.append(int(group.completion_mask.sum()))
        for fut in filter(None, compiling):  # None: no precompile (multi-process)
            fut.result()
        compiling.clear()
        state, met, _ = train_on(group, state)
        return met

    timed_iteration = clock.wrap(iteration, "iteration", lambda met: None)
    jax.block_until_ready((state, ref_vars))
    clock.add("setup", time.perf_counter() - t_start)
    for tasks in batches:
        rng, sub = jax.random.split(rng)
        timed_iteration(tasks, sub)
    reward.close()
    clock.phase = "after_grpo"
    rows = r.prompts_per_batch * r.group_size
    change = float(np.sqrt(sum(np.sum((np.asarray(a) - np.asarray(b)) ** 2) for a, b in
                               zip(jax.tree.leaves(p0), jax.tree.leaves(state.params)))))
    if any(n != rows * r.max_new_tokens for n in generated) or not change > 0:
        raise RuntimeError(f"generated {generated} tokens per rollout (wanted "
                           f"{rows * r.max_new_tokens} each) and moved the parameters by "
                           f"{change}: the work is not the matched work")
    n_params = int(sum(x.size for x in jax.tree.leaves(state.params)))
    return {"params": n_params, "param_change_l2": change,
            "sampler": (worker, sample_model, to_sampler(state.variables), on_mesh)}


def sampler_alone(clock: Clock, config, worker, sample_model, variables, on_mesh, reps: int,
                  spec: dict = MATCHED, batches=(32, 1)) -> None:
    """1 warm-up + `reps` RolloutWorker.generate calls per (batch, new tokens) shape, the two
    lengths alternating: the rollout's own path (prompts encoded, generated as the worker does,
    e.g. with its prefix sharing or row refill, texts decoded), without the reward."""
    import jax
    import ml_collections
    import numpy as np

    import train.rollouts
    from sandbox.tasks.schema import Task

    r1 = ml_collections.ConfigDict(config.rl.to_dict())
    r1.max_new_tokens = 1
    tok = IdTokenizer()
    one = train.rollouts.make_rollout_worker(r1, sample_model, tok, train.rollouts.rollout_sampling(r1, tok.eos_id),
                                   None, None, group_size=config.rl.group_size, **on_mesh)
    rng = np.random.default_rng(spec["seed"] + 1)
    calls = {}
    for B in batches:
        for g, w in ((spec["new_tokens"], worker), (1, one)):
            calls[f"sampler_b{B}_g{g}"] = (clock.wrap(w.generate, f"sampler_b{B}_g{g}",
                                                      lambda group: None), B, g)
    for i in range(1 + reps):
        for name, (call, B, g) in calls.items():
            group = min(B, spec["group"])
            tasks = [Task(id=f"s{i}p{j}", family="matched", prompt=text)
                     for j, text in enumerate(_prompt_texts(rng, B // group, spec))]
            out = call(variables, tasks, jax.random.key(i), group_size=group)
            n = int(out.completion_mask.sum())
            if n != B * g:
                raise RuntimeError(f"{name}: {n} tokens generated, expected {B * g}")


def decode_flops_per_token(model, variables, batch: int, max_len: int) -> float:
    """XLA's count of the floating-point operations in one decode step of `batch` rows over a
    cache of `max_len` positions (`model.decode_step` compiled alone, not run; its cost
    analysis), per row: what the sampler's loop computes per generated token. Times the decode
    rate it gives the FLOP/s the decode sustains (benchmarks/grpo_peer.py's decode_gflop_s)."""
    import jax
    import jax.numpy as jnp

    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return flops_per_row(jax.jit(model.decode_step).lower(variables, tokens, cache).compile(),
                         batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", default="hybrid", choices=VARIANTS)
    p.add_argument("--steps", type=int, default=4, help="GRPO iterations after the first")
    p.add_argument("--reps", type=int, default=3,
                   help="timed sampler calls per shape (0: no sampler-alone part)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, e.g. rl.algo.kl_coef=0.0 model.mtp.loss_weight=0.1")
    p.add_argument("--out", help="also write the JSON record here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.reps < 0:
        p.error("--steps must be >= 1 and --reps >= 0")
    config = run_config(args.variant, args.set)  # a bad override fails before jax starts

    from runtime.xla_env import configure_xla_env

    configure_xla_env()  # the scripts' XLA flags (YNN fusions off); no persistent cache
    import importlib.metadata as md

    import jax

    clock = Clock()
    jax.monitoring.register_event_duration_secs_listener(clock.listen)
    from runtime.xla_env import allocator

    rec = {"side": args.variant, "overrides": args.set, "steps": args.steps,
           "allocator": allocator(),
           "versions": {k: md.version(k) for k in ("jax", "jaxlib", "flax", "optax")},
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_before": loadavg()}
    out = grpo(clock, config, args.steps)
    sampler = out.pop("sampler")
    if args.reps:
        sampler_alone(clock, config, *sampler, reps=args.reps)
        B = MATCHED["prompts"] * MATCHED["group"]
        rec["decode_flops_per_token"] = decode_flops_per_token(
            sampler[1], sampler[2], B, MATCHED["prompt_len"] + MATCHED["new_tokens"])
    rec.update(out, load_after=loadavg(), clock=clock.record(), spec=MATCHED,
               model=config.model.to_dict())
    emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
