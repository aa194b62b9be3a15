"""DSA benchmark: token-sparse (top-k) vs dense causal MQA attention by context length.

``python scripts/bench.py dsa [--quick]`` calls :func:`run`. Shapes come from
``arg_specs.bench_specs``: one DSA layer in absorbed-MLA form, H=16 heads, D=576 (512 latent +
64 rope), v_dim=512, top-k 256, indexer 16 heads x 128, f32 on CPU (bf16 on GPU/TPU).

Two measurements, side by side in one run:

* per-token cost at context length S: ``t`` queries at the end of an S-long context
  (q_offset = S - t), the regime of decode / chunked prefill where DSA pays off. Columns:
  dense attention (XLA), sparse attention alone (XLA gather path on CPU), indexer + top-k,
  sparse total (indexer + top-k + sparse attention), and on GPU/TPU the Pallas kernels.
  Full H=16 at every S (t x S dense logits stay small).
* full causal prefill (T = S) for the short lengths only: the XLA dense baseline computes the
  whole masked T x S rectangle (~9 TFLOP at S=16384 with these shapes, minutes on 2 cores), so
  prefill is timed up to S=2048 (quick: 512); the per-token table covers the long lengths.

The crossover is the context length where dense / sparse-total crosses 1 (log-linear
interpolation between measured lengths; "< S_min" if sparse already wins at the smallest).
Times are the median of a few repeats after one warm-up call
(pallas_kernels.check.median_seconds, no extra runs beyond `reps`).
"""

from __future__ import annotations

import math

import jax

from pallas_kernels.check import median_seconds
from pallas_kernels.dsa import arg_specs, ops

__all__ = ["run"]


def _time(fn, *args, reps: int) -> float:
    return median_seconds(fn, *args, reps=reps, budget_s=0.0)


def _crossover(lengths, ratios):
    """Smallest context where ratio (dense / sparse) reaches 1, log-linear interpolated."""
    pts = list(zip(lengths, ratios, strict=True))
    if pts[0][1] >= 1.0:
        return f"< {pts[0][0]}"
    for (s0, r0), (s1, r1) in zip(pts, pts[1:], strict=False):
        if r0 < 1.0 <= r1:
            a = (0.0 - math.log(r0)) / (math.log(r1) - math.log(r0))
            return int(round(math.exp(math.log(s0) + a * (math.log(s1) - math.log(s0)))))
    return f"> {pts[-1][0]}"


def _fns(spec, impl):
    kw = dict(scale=spec.scale, v_dim=spec.v_dim)
    dense = jax.jit(lambda q, kv: ops.dense_causal_attention(q, kv, q_offset=spec.q_offset, **kw))
    sparse = jax.jit(lambda q, kv, idx: ops.sparse_attention(q, kv, idx, impl=impl, **kw))

    def _select(qi, ki, w):
        scores = ops.indexer_scores(qi, ki, w, impl=impl)
        return ops.select_topk(scores, spec.topk, q_offset=spec.q_offset)

    return dense, sparse, jax.jit(_select)


def _dense_vs_sparse(a, idx, dense, sparse, select, reps) -> dict:
    """Milliseconds of the dense attention, the sparse attention on the given top-k and the
    indexer's top-k selection, and the dense / sparse ratios (attention alone and with the
    indexer)."""
    r = {"dense_ms": 1e3 * _time(dense, a["q"], a["kv"], reps=reps),
         "sparse_attn_ms": 1e3 * _time(sparse, a["q"], a["kv"], idx, reps=reps),
         "indexer_topk_ms": 1e3 * _time(select, a["q_idx"], a["k_idx"], a["w"], reps=reps)}
    r["sparse_total_ms"] = r["sparse_attn_ms"] + r["indexer_topk_ms"]
    r["ratio_attn"] = r["dense_ms"] / r["sparse_attn_ms"]
    r["ratio_total"] = r["dense_ms"] / r["sparse_total_ms"]
    return r


def _per_token(specs, reps, accel, dtype):
    rows = []
    for spec in specs:
        spec = spec.with_dtype(dtype) if dtype != spec.dtype else spec
        a = arg_specs.make_args(spec)
        dense, sparse, select = _fns(spec, "xla")
        idx = select(a["q_idx"], a["k_idx"], a["w"])
        r = dict(S=spec.s, t=spec.t)
        r.update(_dense_vs_sparse(a, idx, dense, sparse, select, reps))
        if accel:
            _, sparse_p, select_p = _fns(spec, "pallas")
            r["pallas_attn_ms"] = 1e3 * _time(sparse_p, a["q"], a["kv"], idx, reps=reps)
            r["pallas_indexer_topk_ms"] = 1e3 * _time(select_p, a["q_idx"], a["k_idx"], a["w"], reps=reps)
            r["ratio_pallas_total"] = r["dense_ms"] / (r["pallas_attn_ms"] + r["pallas_indexer_topk_ms"])
        rows.append(r)
        print(_fmt_row(r, accel), flush=True)
    return rows


def _prefill(lengths, reps, dtype):
    rows = []
    for s in lengths:
        spec = arg_specs.DSAArgSpec(f"prefill{s}", b=1, t=s, s=s, h=16, d=576, v_dim=512, topk=256,
                                    hi=16, di=128, dtype=dtype)
        a = arg_specs.make_args(spec)
        dense, sparse, select = _fns(spec, "auto")
        idx = select(a["q_idx"], a["k_idx"], a["w"])
        r = dict(S=s, t=s)
        r.update(_dense_vs_sparse(a, idx, dense, sparse, select, reps))
        rows.append(r)
        print(_fmt_row(r, False), flush=True)
    return rows


_HEAD = f"{'S':>6} {'t':>6} {'dense ms':>10} {'sparse ms':>10} {'idx+topk':>10} {'sp total':>10} {'d/sp':>6} {'d/tot':>6}"


def _fmt_row(r, accel):
    s = (f"{r['S']:>6} {r['t']:>6} {r['dense_ms']:>10.2f} {r['sparse_attn_ms']:>10.2f} "
         f"{r['indexer_topk_ms']:>10.2f} {r['sparse_total_ms']:>10.2f} {r['ratio_attn']:>6.2f} "
         f"{r['ratio_total']:>6.2f}")
    if accel:
        s += f" | pallas attn {r['pallas_attn_ms']:.2f} ms, idx+topk {r['pallas_indexer_topk_ms']:.2f} ms"
    return s


def run(quick: bool = False) -> dict:
    """Time sparse vs dense attention; print tables; return all numbers (ms) and crossovers."""
    backend = jax.default_backend()
    accel = backend != "cpu"
    dtype = "bfloat16" if accel else "float32"
    reps = 2 if quick else 3
    specs = arg_specs.bench_specs(quick)
    s0 = specs[0]
    print(f"DSA vs dense MQA attention, backend={backend}, dtype={dtype}, H={s0.h}, D={s0.d}, "
          f"v_dim={s0.v_dim}, top-k={s0.topk}, indexer {s0.hi}x{s0.di}")
    print(f"per-token cost: {s0.t} queries at the end of an S-long context")
    print(_HEAD + (" | pallas" if accel else ""))
    per_tok = _per_token(specs, reps, accel, dtype)
    lengths = [r["S"] for r in per_tok]
    out = {
        "backend": backend, "dtype": dtype,
        "shape": dict(h=s0.h, d=s0.d, v_dim=s0.v_dim, topk=s0.topk, hi=s0.hi, di=s0.di, t=s0.t),
        "per_token": per_tok,
        "crossover_attn": _crossover(lengths, [r["ratio_attn"] for r in per_tok]),
        "crossover_total": _crossover(lengths, [r["ratio_total"] for r in per_tok]),
    }
    if accel:
        out["crossover_pallas_total"] = _crossover(lengths, [r["ratio_pallas_total"] for r in per_tok])
    print(f"crossover (dense = sparse attention alone): S ~ {out['crossover_attn']}; "
          f"(dense = indexer + top-k + sparse): S ~ {out['crossover_total']}")
    pre_lengths = (256, 512) if quick else (512, 1024, 2048)
    print("full causal prefill (T = S), impl=auto; dense is the masked T x S rectangle")
    print(_HEAD)
    pre = _prefill(pre_lengths, reps, dtype)
    out["prefill"] = pre
    out["prefill_crossover_total"] = _crossover(list(pre_lengths), [r["ratio_total"] for r in pre])
    print(f"prefill crossover (dense = indexer + top-k + sparse): S ~ {out['prefill_crossover_total']}")
    return out


if __name__ == "__main__":
    run(quick=True)
