"""`python scripts/bench.py rollouts [--quick]`: prefix sharing and row refill in the plain
sampler (rl/sampler.py) against the plain sampler, on the demo model's shapes (CPU).

Side by side in one process, alternating rounds, medians of the per-round times:
  * RL rollouts: 8 prompts x 4 samples (32 rows), prompts right-padded to 72 tokens, 48 new
    tokens at temperature 1: plain (every row prefilled), shared (each prompt prefilled once,
    `group_size=4`), refill (`slots=R`, shared prefill into a prompt bank) for a few R;
  * evaluation: 32 distinct prompts, greedy: plain vs refill;
  * multi-turn episodes (rl/agent.py, the demo's multistep tasks in sandbox sessions, rl.agent
    of the demo config): full (every turn re-reads its whole context) vs cached (each turn
    continues the episode's decode cache, `rl.agent.cache_turns`), as RL plays them (8 tasks x
    4 samples at T=1) and as evaluation does (32 tasks, greedy): seconds per batch (median),
    context positions prefilled, turns, and whether the episodes came out the same.
Reported per variant: seconds per generate call (median), generated tokens/s (real tokens, not
padding), decode-loop steps of the refill variants, and the ratio to plain.

Model: configs/models.py "demo". Full mode loads the demo RL checkpoint when one exists
(`DEMO_WORKDIR`, default runs/demo, the demo's workdir; realistic EOS lengths) and uses the demo's
real task prompts; quick mode (and a missing checkpoint) uses random init, where rows rarely
end before max_new_tokens, so refill cannot gain there. With ROLLOUT_BENCH_MESH set (a mesh
spec, e.g. "data=2"), the episodes run on that mesh of this process's devices, the variables
laid out by the model's shardings and the turn cache over the mesh:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 ROLLOUT_BENCH_MESH=data=2 \
        python scripts/bench.py rollouts

Not covered: the one-shot sampler on a mesh, MTP speculative decoding
(benchmarks/speculative.py).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np

WORKDIR = os.environ.get("DEMO_WORKDIR", os.path.join("runs", "demo"))
MESH_ENV = "ROLLOUT_BENCH_MESH"  # the episodes' mesh (module docstring); unset: no mesh


def _setup(quick: bool):
    from configs import rl as rl_configs
    from model.config import ModelConfig
    from model.tokenizer import load_tokenizer
    from model.transformer import Model
    from rl.pipeline import encode_prompts
    from train.data import load_task_splits
    from train.weights import load_rl_variables

    config = rl_configs.demo()
    model = Model(ModelConfig.from_dict(config.model))
    tok = load_tokenizer(config.tokenizer)
    source = "random init"
    variables = None
    if not quick and os.path.isdir(os.path.join(WORKDIR, "rl", "checkpoints")):
        config.workdir = WORKDIR
        variables = load_rl_variables(config, model)
        source = f"RL checkpoint {WORKDIR}"
    if variables is None:
        variables = model.init(jax.random.key(0))
    config.tasks.update(dict(train_per_domain=16, val_per_domain=16, test_per_domain=16))
    tasks = [t for t, _ in load_task_splits(config)["val"]]
    rng = np.random.default_rng(0)
    picks = [tasks[i] for i in rng.permutation(len(tasks))[:32]]
    prompts, lens = encode_prompts(tok, [t.prompt for t in picks], config.rl.max_prompt_len)
    return config, model, tok, variables, source, prompts, lens


def _rounds(variants: dict, rounds: int) -> dict:
    """variants: name -> fn() returning a SampleOutput. One warm call each (compile), then
    `rounds` rounds calling every variant in turn (the order rotates per round)."""
    names = list(variants)
    times = {n: [] for n in names}
    outs = {}
    compile_s = {}
    for n in names:
        t = time.perf_counter()
        outs[n] = jax.block_until_ready(variants[n]())
        compile_s[n] = time.perf_counter() - t
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            outs[n] = jax.block_until_ready(variants[n]())
            times[n].append(time.perf_counter() - t)
    res = {}
    base = statistics.median(times[names[0]])
    for n in names:
        o, med = outs[n], statistics.median(times[n])
        tokens = int(np.asarray(o.mask).sum())
        res[n] = {"s": round(med, 4), "min_s": round(min(times[n]), 4), "tokens": tokens, "tok_per_s": round(tokens / med, 1),
                  "first_call_s": round(compile_s[n], 2), "speedup_vs_plain": round(base / med, 3)}
        if o.finish_step is not None:
            res[n]["decode_steps"] = int(np.asarray(o.finish_step).max()) + 1
    return res


def run(quick: bool = False) -> dict:
    from rl.sampler import Sampler, SamplingConfig

    config, model, tok, variables, source, prompts, lens = _setup(quick)
    r = config.rl
    G, n_prompts = int(r.group_size), int(r.prompts_per_batch)
    rounds = 3 if quick else 11
    out = {"model": "demo", "variables": source, "rounds": rounds,
           "load_before": os.getloadavg()}
    rows_p = np.repeat(prompts[:n_prompts], G, axis=0)  # [32,72] groups of G copies
    rows_l = np.repeat(lens[:n_prompts], G)
    sampling = SamplingConfig(max_new_tokens=int(r.max_new_tokens), temperature=1.0,
                              eos_id=tok.eos_id)
    s = Sampler(model, sampling)
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    N = len(rows_p)
    slot_choices = (N // 2,) if quick else (N // 2, 3 * N // 4)
    variants = {"plain": lambda: s.generate(variables, rows_p, rows_l, next(keys)),
                "shared": lambda: s.generate(variables, rows_p, rows_l, next(keys),
                                             group_size=G)}
    for R in slot_choices:
        variants[f"refill_{R}"] = (lambda R=R: s.generate(variables, rows_p, rows_l, next(keys),
                                                          group_size=G, slots=R))
    print(f"rollouts: {n_prompts} prompts x {G} samples, prompt width {prompts.shape[1]}, "
          f"{r.max_new_tokens} new tokens, {source}", flush=True)
    out["rollouts"] = _rounds(variants, rounds)
    for n, v in out["rollouts"].items():
        print(f"  {n:>12}: {v}", flush=True)
    # exactness: the same rng through plain and shared (same draws when the logits agree)
    k = jax.random.key(123)
    a = s.generate(variables, rows_p, rows_l, k)
    b = s.generate(variables, rows_p, rows_l, k, group_size=G)
    out["shared_vs_plain"] = {
        "tokens_equal": bool(np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))),
        "logp_max_abs_diff": float(np.max(np.abs(np.asarray(a.logprobs)
                                                 - np.asarray(b.logprobs))))}
    print(f"  shared vs plain, same rng: {out['shared_vs_plain']}", flush=True)

    greedy = Sampler(model, SamplingConfig(max_new_tokens=int(r.max_new_tokens),
                                           temperature=0.0, eos_id=tok.eos_id))
    ev = {"plain": lambda: greedy.generate(variables, prompts, lens, next(keys))}
    for R in slot_choices:
        ev[f"refill_{R}"] = (lambda R=R: greedy.generate(variables, prompts, lens, next(keys),
                                                         slots=R))
    print(f"eval: {len(prompts)} distinct prompts, greedy", flush=True)
    out["eval"] = _rounds(ev, rounds)
    for n, v in out["eval"].items():
        print(f"  {n:>12}: {v}", flush=True)
    out["episodes"] = _episodes(config, model, tok, variables, 3 if quick else 5)
    out["load_after"] = os.getloadavg()
    return out


def _episodes(config, model, tok, variables, rounds: int) -> dict:
    """Agent rollouts with and without the turn cache, alternating per round (module doc)."""
    import dataclasses

    from model import sharding as shd
    from rl.agent import AgentRolloutWorker
    from rl.sampler import SamplingConfig
    from sandbox import SandboxPool
    from train.data import agent_env_config, load_task_splits

    a = config.rl.agent
    mesh = shd.make_mesh(os.environ[MESH_ENV]) if os.environ.get(MESH_ENV) else None
    if mesh is not None:
        variables = jax.device_put(variables, shd.variables_shardings(
            shd.model_shardings(model, mesh), variables, mesh))
    config.tasks.update(dict(domains="multistep", val_per_domain=32))
    tasks = [t for t, _ in load_task_splits(config)["val"]]
    base = SamplingConfig(max_new_tokens=int(a.turn_tokens), eos_id=tok.eos_id)
    shapes = {"rl": (tasks[:8], 4, 1.0), "eval": (tasks[:32], 1, 0.0)}
    out = {"mesh": None if mesh is None else dict(mesh.shape)}
    with SandboxPool(workers=int(config.sandbox.workers)) as pool:
        for shape, (ts, G, temp) in shapes.items():
            workers = {name: AgentRolloutWorker(
                model, tok, dataclasses.replace(base, temperature=temp), pool, group_size=G,
                width=int(a.width), env_config=agent_env_config(a), cache_turns=cached,
                mesh=mesh)
                for name, cached in (("full", False), ("cached", True))}
            times = {n: [] for n in workers}
            groups = {}
            for r in range(rounds + 1):  # round 0 compiles
                for n in (list(workers) if r % 2 else list(workers)[::-1]):
                    t = time.perf_counter()
                    groups[n] = workers[n].start(variables, ts, jax.random.key(r)).result()
                    if r:
                        times[n].append(time.perf_counter() - t)
            res = {}
            for n, g in groups.items():
                res[n] = {"s": round(statistics.median(times[n]), 3),
                          "prefill_positions": int(g.prefill_tokens),
                          "turns_mean": round(float(np.mean([d["turns"] for d in g.details])), 2),
                          "success": round(float(np.mean(g.rewards >= 1.0)), 3)}
            res["speedup"] = round(res["full"]["s"] / res["cached"]["s"], 3)
            res["same_episodes"] = bool(np.array_equal(groups["full"].completions,
                                                       groups["cached"].completions))
            print(f"episodes ({shape}: {len(ts)} tasks x {G}, T={temp:g}): {res}", flush=True)
            out[shape] = res
    return out
