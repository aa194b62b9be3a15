"""Benchmark: expert-parallel MoE dispatch vs local dispatch on 8 host devices.

    python scripts/bench.py moe [--quick]

`run()` starts a child process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the
parent keeps its own devices) that times one MoE layer (routing + routed experts, no shared
expert), forward and forward+backward, for:

  local_dropless_1dev   dropless dispatch (sort + grouped matmul: moe.grouped_matmul "auto", i.e.
                        block-padded einsums on CPU, lax.ragged_dot on GPU/TPU) on one device
  local_capacity_1dev   capacity dispatch (scatter to [E,C,D] + batched einsum) on one device
  gspmd_capacity_8dev   the capacity path under jit with tokens split over the 8 devices and
                        experts over the "expert" axis; XLA's SPMD partitioner picks the comms
  ep_all_to_all_8dev    moe.expert_parallel="all_to_all" (shard_map + all_to_all, capacity)
  ep_all_to_all_dropless_8dev   the same with dispatch="dropless" (C = local tokens, exact)

and reports milliseconds per call (median) and the ratios of the expert-parallel path to the
others. On a CPU host the 8 "devices" share the machine's cores and all_to_all is a memcpy, so
the ratios measure dispatch overhead and partitioning quality, not interconnect bandwidth; the
same script on a GPU/TPU host (set the device count to the real one) measures the real thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(quick: bool) -> dict:
    from runtime.xla_env import configure_xla_env

    configure_xla_env()  # before jax is imported
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model import sharding as shd
    from model.config import MoEConfig
    from model.layers.moe import MoE

    n_dev = jax.device_count()
    E, k = 16, 2
    if quick:
        B, T, D, F, reps = 8, 64, 128, 256, 3
    else:
        B, T, D, F, reps = 16, 256, 256, 512, 5
    base = MoEConfig(num_experts=E, num_experts_per_tok=k, expert_dim=F, num_shared_experts=0,
                     router="sigmoid", dispatch="capacity", capacity_factor=1.25)
    x = jax.random.normal(jax.random.key(0), (B, T, D), jnp.float32)
    valid = jnp.ones((B, T), bool)
    variables = nn.meta.unbox(MoE(base, D).init(jax.random.key(1), x, valid=valid))

    def timed(fn, *args):
        out = fn(*args)
        jax.block_until_ready(out)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    def fns(cfg):
        mod = MoE(cfg, D)

        def fwd(v, x):
            return mod.apply(v, x, valid=valid)[0]

        def fwd_bwd(v, x):
            return jax.grad(lambda v, x: jnp.sum(jnp.square(fwd(v, x))), argnums=(0, 1))(v, x)

        return fwd, fwd_bwd

    results = {}
    one = jax.devices()[0]
    v1, x1 = jax.device_put(variables, one), jax.device_put(x, one)
    for name, dispatch in (("local_dropless_1dev", "dropless"),
                           ("local_capacity_1dev", "capacity")):
        fwd, fb = fns(dataclasses.replace(base, dispatch=dispatch))
        results[name] = {"fwd_ms": timed(jax.jit(fwd), v1, x1),
                         "fwd_bwd_ms": timed(jax.jit(fb), v1, x1)}

    mesh = shd.make_mesh({"expert": n_dev})
    boxed = jax.eval_shape(lambda: MoE(base, D).init(jax.random.key(1), x, valid=valid))
    sh = shd.logical_to_sharding(boxed, mesh)
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert")))
    vs = jax.device_put(variables, sh)
    for name, ep, dispatch in (("gspmd_capacity_8dev", "none", "capacity"),
                               ("ep_all_to_all_8dev", "all_to_all", "capacity"),
                               ("ep_all_to_all_dropless_8dev", "all_to_all", "dropless")):
        fwd, fb = fns(dataclasses.replace(base, expert_parallel=ep, dispatch=dispatch))
        with shd.use_mesh(mesh):
            f1, f2 = jax.jit(fwd), jax.jit(fb)
            results[name] = {"fwd_ms": timed(f1, vs, xs), "fwd_bwd_ms": timed(f2, vs, xs)}

    ep = results["ep_all_to_all_8dev"]
    ratios = {}
    for other in ("gspmd_capacity_8dev", "local_capacity_1dev", "local_dropless_1dev"):
        for key in ("fwd_ms", "fwd_bwd_ms"):
            ratios[f"ep_a2a_vs_{other}_{key[:-3]}"] = ep[key] / results[other][key]
    return {"devices": n_dev, "backend": jax.default_backend(),
            "shape": {"tokens": B * T, "d_model": D, "expert_dim": F, "experts": E, "top_k": k,
                      "capacity_factor": base.capacity_factor},
            "ms": results, "ratios (time EP / time other; < 1 = EP faster)": ratios}


def run(quick: bool = False, devices: int = 8) -> dict:
    """Run the benchmark in a child process with `devices` host devices; returns its results."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    # `-m` from the repository root: the child imports benchmarks.moe and the library from there
    cmd = [sys.executable, "-m", "benchmarks.moe", "--child"] + (["--quick"] if quick else [])
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"benchmarks.moe child failed:\n{r.stderr[-6000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    s = out["shape"]
    print(f"MoE layer, {s['tokens']} tokens, d_model {s['d_model']}, {s['experts']} experts "
          f"(top-{s['top_k']}, F {s['expert_dim']}), {out['devices']} {out['backend']} devices")
    for name, t in out["ms"].items():
        print(f"  {name:30s} fwd {t['fwd_ms']:9.2f} ms   fwd+bwd {t['fwd_bwd_ms']:9.2f} ms")
    for name, v in out["ratios (time EP / time other; < 1 = EP faster)"].items():
        print(f"  {name:50s} {v:6.2f}x")
    return out


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(_child("--quick" in sys.argv)))
    else:
        run(quick="--quick" in sys.argv)
