"""KDA benchmark: recurrent oracle vs chunked reference (vs the Pallas kernel on GPU/TPU).

`python scripts/bench.py kda [--quick]` calls `run(quick)`. Shapes come from
`arg_specs.BENCH` (`BENCH_QUICK` when quick): the DESIGN.md target (B=1, H=4, K=V=128, T=2048)
and B=1, H=16, K=V=128 at T in {2048, 8192}. For each shape, side by side in one process, f32:
tokens/s forward and forward+backward (grad of sum(o^2) w.r.t. q, k, v, g, beta) and the ratio
chunked / recurrent. The recurrent fwd+bwd rematerialises every 64 tokens (a plain scan would keep
a [B,H,K,V] state per token: 8.6 GB at H=16, T=8192). Median of `reps` runs after a warm-up
(pallas_kernels.check.median_seconds, no extra runs beyond `reps`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.check import median_seconds
from pallas_kernels.kda import arg_specs, reference


def _seconds(fn, args, reps):
    return median_seconds(fn, *args, reps=reps, budget_s=0.0)


def _impls(on_accel: bool):
    impls = {
        "recurrent": (
            lambda q, k, v, g, b: reference.kda_recurrent(q, k, v, g, b)[0],
            lambda q, k, v, g, b: reference.kda_recurrent(q, k, v, g, b, remat_every=64)[0],
        ),
        "chunked": (
            lambda q, k, v, g, b: reference.kda_chunked(q, k, v, g, b)[0],
            lambda q, k, v, g, b: reference.kda_chunked(q, k, v, g, b)[0],
        ),
    }
    if on_accel:
        from pallas_kernels.kda import pallas_kda  # noqa: PLC0415

        f = lambda q, k, v, g, b: pallas_kda.kda_pallas(q, k, v, g, b, interpret=False)[0]
        impls["pallas"] = (f, f)
    return impls


def run(quick: bool = False) -> dict:
    specs = arg_specs.BENCH_QUICK if quick else arg_specs.BENCH
    reps = 2 if quick else 3
    on_accel = jax.default_backend() != "cpu"
    impls = _impls(on_accel)
    results = {"backend": jax.default_backend(), "shapes": {}}
    header = f"{'shape':>18} {'impl':>10} {'fwd tok/s':>12} {'fwd+bwd tok/s':>14}"
    print(header)
    print("-" * len(header))
    for spec in specs:
        a = arg_specs.make_args(spec)
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
        row = {}
        for name, (fwd, fwd_for_grad) in impls.items():
            f = jax.jit(fwd)
            loss = lambda *xs, fn=fwd_for_grad: jnp.sum(jnp.square(fn(*xs).astype(jnp.float32)))
            fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
            t_f = _seconds(f, args, reps)
            t_fb = _seconds(fb, args, max(1, reps - 1))
            row[name] = {"fwd_tok_s": spec.tokens / t_f, "fwd_bwd_tok_s": spec.tokens / t_fb,
                         "fwd_s": t_f, "fwd_bwd_s": t_fb}
            print(f"{spec.name:>18} {name:>10} {row[name]['fwd_tok_s']:>12,.0f} "
                  f"{row[name]['fwd_bwd_tok_s']:>14,.0f}", flush=True)
        row["ratio_chunked_over_recurrent"] = {
            "fwd": row["chunked"]["fwd_tok_s"] / row["recurrent"]["fwd_tok_s"],
            "fwd_bwd": row["chunked"]["fwd_bwd_tok_s"] / row["recurrent"]["fwd_bwd_tok_s"],
        }
        r = row["ratio_chunked_over_recurrent"]
        print(f"{spec.name:>18} {'ratio':>10} {r['fwd']:>11.2f}x {r['fwd_bwd']:>13.2f}x")
        results["shapes"][spec.name] = {"B": spec.B, "T": spec.T, "H": spec.H, "K": spec.K,
                                        "V": spec.V, **row}
    return results


if __name__ == "__main__":
    run(quick=True)
