"""MXFP4 vs bf16 benchmark: `python scripts/bench.py mxfp4 [--quick]`.

Side by side in one run, per problem (decode-shaped M = 8, prefill-shaped M = 2048; shapes from
`arg_specs.BENCH_SPECS`):
  * weight bytes: MXFP4 (4.25 bits / element) vs bf16 -> ratio, expected 17/64 = 0.2656;
  * time of y = x @ W.T for bf16 W vs MXFP4 W through `mxfp4_matmul` (impl "auto": the XLA
    reference on CPU, which dequantizes every call, and the Pallas kernel on GPU/TPU), and on an
    accelerator also the XLA reference next to the kernel;
  * on GPU/TPU: achieved HBM bandwidth of the kernel = bytes it must read and write / time, as a
    fraction of the peak (H200: 4.8 TB/s; override with MXFP4_BENCH_PEAK_BW in bytes/s).
  * model decode (`model_decode`): tokens/s of the sampler (rl/sampler.py, prefill + decode
    loop) on the demo model with float experts vs packed MXFP4 experts (model/quant.py, grouped
    MXFP4 matmul), in f32 and in bf16 (activations and parameters), and the expert bytes ratio.
Timings are medians over repeats after a warm-up; nothing here asserts a speed.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels.check import median_seconds
from pallas_kernels.mxfp4 import arg_specs
from pallas_kernels.mxfp4.ops import dequantize, mxfp4_matmul

PEAK_BW = {"gpu": 4.8e12, "tpu": 8.19e11}  # bytes/s: H200 HBM3e; TPU v5e (override by env)


def _time(fn, *args, min_reps: int = 3, budget_s: float = 1.0) -> float:
    """Median wall seconds of fn(*args) after one warm-up (compile) call."""
    return median_seconds(fn, *args, reps=min_reps, budget_s=budget_s)


@jax.jit
def _bf16_matmul(x, w):
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def run(quick: bool = False) -> dict:
    platform = jax.default_backend()
    on_device = platform in ("gpu", "tpu")
    specs = arg_specs.BENCH_SPECS["quick" if quick else ("device" if on_device else "full")]
    peak = float(os.environ.get("MXFP4_BENCH_PEAK_BW", PEAK_BW.get(platform, 0.0)))
    budget = 0.3 if quick else 1.0
    results: dict = {"platform": platform, "device": str(jax.devices()[0]), "problems": {}}
    rows = []
    for spec in specs:
        x, w = arg_specs.make_matmul_args(spec)
        w_bf16 = dequantize(w, jnp.bfloat16)
        bytes_bf16 = spec.n * spec.k * 2
        r = {
            "m": spec.m,
            "n": spec.n,
            "k": spec.k,
            "bytes_mxfp4": w.nbytes,
            "bytes_bf16": bytes_bf16,
            "bytes_ratio": w.nbytes / bytes_bf16,
        }
        r["t_bf16_s"] = _time(_bf16_matmul, x, w_bf16, budget_s=budget)
        r["t_mxfp4_s"] = _time(lambda a, b: mxfp4_matmul(a, b), x, w, budget_s=budget)
        r["time_ratio"] = r["t_mxfp4_s"] / r["t_bf16_s"]
        if on_device:
            r["t_mxfp4_xla_s"] = _time(
                lambda a, b: mxfp4_matmul(a, b, impl="xla"), x, w, budget_s=budget
            )
            moved = w.nbytes + x.size * x.dtype.itemsize + spec.m * spec.n * x.dtype.itemsize
            r["kernel_bw_bytes_per_s"] = moved / r["t_mxfp4_s"]
            r["bf16_bw_bytes_per_s"] = (bytes_bf16 + 2 * x.size * 2) / r["t_bf16_s"]
            if peak:
                r["kernel_bw_fraction"] = r["kernel_bw_bytes_per_s"] / peak
                r["bf16_bw_fraction"] = r["bf16_bw_bytes_per_s"] / peak
        results["problems"][spec.name] = r
        rows.append((spec.name, r))

    impl = "pallas" if on_device else "xla (dequantize + dot)"
    print(f"MXFP4 vs bf16 on {results['device']} (mxfp4 path: {impl})")
    hdr = f"{'problem':<8} {'M':>5} {'N':>5} {'K':>5} {'bytes ratio':>11} {'bf16 ms':>9} "
    hdr += f"{'mxfp4 ms':>9} {'time ratio':>10}"
    if on_device:
        hdr += f" {'xla ms':>8} {'HBM frac':>8} {'bf16 frac':>9}"
    print(hdr)
    for name, r in rows:
        line = (
            f"{name:<8} {r['m']:>5} {r['n']:>5} {r['k']:>5} {r['bytes_ratio']:>11.4f} "
            f"{r['t_bf16_s'] * 1e3:>9.3f} {r['t_mxfp4_s'] * 1e3:>9.3f} {r['time_ratio']:>10.2f}"
        )
        if on_device:
            line += f" {r['t_mxfp4_xla_s'] * 1e3:>8.3f} {r.get('kernel_bw_fraction', 0):>8.1%}"
            line += f" {r.get('bf16_bw_fraction', 0):>9.1%}"
        print(line)
    results["model_decode"] = model_decode(quick)
    return results


def model_decode(quick: bool = False, batch: int = 8, new_tokens: int = 64) -> dict:
    """Sampler tokens/s, float vs MXFP4 experts, on the demo model (random init; tokens/s =
    batch x new_tokens / median generate time, prefill of a 32-token prompt included)."""
    import dataclasses

    import numpy as np

    from configs import models
    from model import quant
    from model.config import ModelConfig
    from model.transformer import Model
    from rl.sampler import Sampler, SamplingConfig

    if quick:
        batch, new_tokens = 4, 16
    base = ModelConfig.from_dict(models.get_config("demo"))
    sc = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, eos_id=-1)
    prompts = np.random.default_rng(0).integers(3, 250, (batch, 32)).astype(np.int32)
    lens = np.full(batch, 32, np.int32)
    out, rows = {}, []
    for dt in ("float32", "bfloat16"):
        cfg = dataclasses.replace(base, dtype=dt, param_dtype=dt)
        model = Model(cfg)
        variables = model.init(jax.random.key(0))
        qmodel, qvars = quant.inference_model(cfg, variables, experts="mxfp4")
        for name, m, v in ((f"{dt} experts", model, variables), (f"mxfp4 experts, {dt}",
                                                                   qmodel, qvars)):
            sampler = Sampler(m, sc)
            t = _time(lambda v_, s_=sampler: s_.generate(v_, prompts, lens,
                                                          jax.random.key(1)).tokens,
                      v, budget_s=0.5 if quick else 2.0)
            b = quant.expert_bytes(v["params"])
            out[name] = {"tokens_per_s": batch * new_tokens / t, "expert_bytes": b["experts"]}
            rows.append((name, out[name]))
        ref = out[f"{dt} experts"]
        q = out[f"mxfp4 experts, {dt}"]
        q["speed_vs_float"] = q["tokens_per_s"] / ref["tokens_per_s"]
        q["expert_bytes_vs_float"] = q["expert_bytes"] / ref["expert_bytes"]
    print(f"model decode on {jax.devices()[0]}: demo model, batch {batch}, {new_tokens} new "
          f"tokens (sampler incl. a 32-token prefill)")
    for name, r in rows:
        extra = (f"  {r['speed_vs_float']:.2f}x tokens/s, expert bytes "
                 f"{r['expert_bytes_vs_float']:.4f}x" if "speed_vs_float" in r else "")
        print(f"  {name:<24} {r['tokens_per_s']:>9.0f} tokens/s  experts {r['expert_bytes']:>8} "
              f"bytes{extra}")
    return out


if __name__ == "__main__":
    run()
