"""Pallas lightning-indexer kernel: scores[b,t,s] = sum_j w[b,t,j] * relu(q_idx[b,t,j] . k_idx[b,s]).

Grid (B, T/block_t, S/block_s), all parallel. Each program loads a [block_s, D] key tile once
and, for every indexer head j, does one [block_t, D] x [D, block_s] matmul, applies ReLU and the
per-(token, head) weight, and accumulates into an f32 [block_t, block_s] tile: the [B,T,HI,S]
per-head logits of the reference are never materialised (the fusion that makes the indexer
cheap). Heads are a static (unrolled) loop: weights are read as a [block_t, 1] column of the
[block_t, HI] weight tile, a plain ref slice on both Triton and Mosaic.

Layout: q_idx is transposed to [B,HI,T,D] in the wrapper so each head's tile is a contiguous
leading-axis slice (no sublane-strided loads on TPU). T and S are zero-padded to the blocks
(padded keys get score 0, sliced off). On the "gpu" flavour D is zero-padded to a power of two
>= 16 (zeros do not change dot products; tl.dot wants operand dims >= 16). On the "tpu" flavour
the compiled score tile is (multiple of 8, multiple of 128) or the whole padded array (Mosaic's
block rule; `config.get_config` picks such tiles).

Covered: any B, T, S, HI, D; f32/bf16 inputs (f32 accumulation). Not covered: causal block
skipping (scores above the diagonal are computed and masked later by select_topk), FP8 inputs.
Backward: custom_vjp whose backward is the XLA formula (the indexer's training signal is its own
KL loss; its backward is not a hot path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dsa import reference
from pallas_kernels.dsa.config import DSABlockConfig, get_config

__all__ = ["indexer_scores"]


def _next_pow2(x: int) -> int:
    return 1 << (int(x) - 1).bit_length()


def _indexer_kernel(q_ref, k_ref, w_ref, o_ref, *, heads: int, precision):
    # q_ref [HI, bt, D], k_ref [bs, D], w_ref [bt, HI], o_ref [bt, bs] f32
    k = k_ref[...]  # [bs, D]
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(heads):  # static: HI is small (DeepSeek: 64)
        logits = lax.dot_general(
            q_ref[j], k, (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32, precision=precision)  # [bt, bs]
        wj = w_ref[:, pl.ds(j, 1)].astype(jnp.float32)  # [bt, 1]
        acc = acc + wj * jnp.maximum(logits, 0.0)
    o_ref[...] = acc


def _compiler_params(cfg: DSABlockConfig, n_grid: int, interpret: bool):
    if interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * n_grid)
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _indexer_fwd(q_idx, k_idx, w, *, cfg: DSABlockConfig, interpret: bool):
    b, t, hi, d = q_idx.shape
    s = k_idx.shape[1]
    bt, bs = cfg.idx_block_t, cfg.idx_block_s
    tp, sp = pl.cdiv(t, bt) * bt, pl.cdiv(s, bs) * bs
    if cfg.backend == "tpu" and not interpret and (bs % 128 and bs != sp or bt % 8 and bt != tp):
        raise ValueError(f"tpu indexer tiles must be (multiple of 8, multiple of 128) or cover "
                         f"the padded array ({tp}, {sp}); got block ({bt}, {bs}) in {cfg}")
    dp = max(16, _next_pow2(d)) if cfg.backend == "gpu" else d  # Triton: pow2, dots >= 16
    qt = jnp.pad(q_idx, ((0, 0), (0, tp - t), (0, 0), (0, dp - d))).transpose(0, 2, 1, 3)  # [B,HI,Tp,Dp]
    kp = jnp.pad(k_idx, ((0, 0), (0, sp - s), (0, dp - d)))  # [B,Sp,Dp]
    wp = jnp.pad(w, ((0, 0), (0, tp - t), (0, 0)))  # [B,Tp,HI]
    precision = lax.Precision.HIGHEST if q_idx.dtype == jnp.float32 else None
    kernel = functools.partial(_indexer_kernel, heads=hi, precision=precision)
    grid = (b, tp // bt, sp // bs)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, hi, bt, dp), lambda i, j, k: (i, 0, j, 0)),
            pl.BlockSpec((None, bs, dp), lambda i, j, k: (i, k, 0)),
            pl.BlockSpec((None, bt, hi), lambda i, j, k: (i, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, bt, bs), lambda i, j, k: (i, j, k)),
        out_shape=jax.ShapeDtypeStruct((b, tp, sp), jnp.float32),
        compiler_params=_compiler_params(cfg, len(grid), interpret),
        interpret=interpret,
        name="dsa_indexer_scores",
    )(qt, kp, wp)
    return out[:, :t, :s]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _indexer(q_idx, k_idx, w, cfg, interpret):
    return _indexer_fwd(q_idx, k_idx, w, cfg=cfg, interpret=interpret)


def _indexer_vjp_fwd(q_idx, k_idx, w, cfg, interpret):
    return _indexer(q_idx, k_idx, w, cfg, interpret), (q_idx, k_idx, w)


def _indexer_vjp_bwd(cfg, interpret, res, g):
    del cfg, interpret
    _, vjp = jax.vjp(reference.indexer_scores, *res)
    return vjp(g)


_indexer.defvjp(_indexer_vjp_fwd, _indexer_vjp_bwd)


def indexer_scores(q_idx, k_idx, w, *, interpret: bool = False,
                   config: DSABlockConfig | None = None, kernel: str | None = None):
    """Pallas indexer: q_idx [B,T,HI,D], k_idx [B,S,D], w [B,T,HI] -> f32 scores [B,T,S].

    kernel ("gpu" | "tpu" | None = the running platform's) picks the flavour when config is None.
    """
    assert q_idx.ndim == 4 and k_idx.ndim == 3 and w.ndim == 3, (q_idx.shape, k_idx.shape, w.shape)
    b, t, hi, d = q_idx.shape
    assert k_idx.shape[0] == b and k_idx.shape[2] == d and w.shape == (b, t, hi)
    cfg = config or get_config(t=t, s=k_idx.shape[1], dim=d, backend=kernel,
                               interpret=bool(interpret))
    return _indexer(q_idx, k_idx, w, cfg, bool(interpret))
