"""MXFP4 matmuls as Mosaic-TPU-style Pallas kernels (BlockSpec pipeline, K grid axis).

Coverage: dense `matmul` (x [M, K] @ dequantize(w [N, K]).T) and `grouped_matmul` (MoE, tokens
sorted by expert, megablox-style work list in scalar prefetch). bf16 or f32 activations, packed
uint8 weights decoded in VMEM (common.decode_tile), float32 VMEM accumulator, output in x.dtype.
K not a multiple of block_k: the last K block is partial; its out-of-range lanes hold
unspecified data, so both the activation and the decoded weight tiles are masked to zero there.
Partial M / N edge blocks need no mask (rows and columns are independent; Pallas drops the
out-of-range part of output blocks).

Runs compiled on TPU, and in interpret mode anywhere (the CPU tests). Not yet run on a TPU
(none available to the authors at the time of writing); `config.check_config` and
`_check_tpu_blocks` encode the documented Mosaic block rules, and the Pallas -> Mosaic lowering
is checked from a CPU host by tests/pallas_kernels/test_lowering.py (Mosaic's own compiler
passes run only on a TPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mxfp4 import common
from pallas_kernels.mxfp4.config import BlockConfig

# Decoded [block_n, block_k / 2] int32/f32 temporaries dominate VMEM (2 MiB each at 256 x 2048).
VMEM_LIMIT_BYTES = 48 * 1024 * 1024


def _check_tpu_blocks(cfg: BlockConfig, m: int, n: int, k: int, interpret: bool) -> None:
    if interpret:
        return
    if not (cfg.block_k == k or cfg.block_k % 4096 == 0):
        raise ValueError(f"tpu: block_k must be K ({k}) or a multiple of 4096, got {cfg}")
    if not (cfg.block_n == n or cfg.block_n % 128 == 0):
        raise ValueError(f"tpu: block_n must be N ({n}) or a multiple of 128, got {cfg}")
    if not (cfg.block_m == m or cfg.block_m % 16 == 0):
        raise ValueError(f"tpu: block_m must be M ({m}) or a multiple of 16, got {cfg}")


def _expand(s_bytes, interpret: bool):
    # On TPU the lane repeat goes through the MXU (exact); in interpret mode a plain reshape is
    # the same values and cheaper.
    if interpret:
        return common.expand_scales_reshape(s_bytes)
    return common.expand_scales_onehot(s_bytes)


def _accumulate(xe_ref, xo_ref, w_ref, s_ref, acc_ref, *, k_idx, k2, tk2, cd, interpret):
    """acc += x_even @ w_lo.T + x_odd @ w_hi.T for one K block (masked past K)."""
    s_rep = common.scale_to_f32(_expand(s_ref[...].astype(jnp.int32), interpret))
    we, wo = common.decode_tile(w_ref[...], s_rep, cd)
    xe, xo = xe_ref[...], xo_ref[...]
    if k2 % tk2:  # static: only the ragged-K case pays for the mask
        lim = k2 - k_idx * tk2
        xcol = jax.lax.broadcasted_iota(jnp.int32, xe.shape, 1) < lim
        wcol = jax.lax.broadcasted_iota(jnp.int32, we.shape, 1) < lim
        xe, xo = jnp.where(xcol, xe, 0), jnp.where(xcol, xo, 0)
        we, wo = jnp.where(wcol, we, 0), jnp.where(wcol, wo, 0)
    acc_ref[...] += common.dot_nt(xe, we) + common.dot_nt(xo, wo)


def _matmul_kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, acc_ref, *, k2, tk2, cd, interpret):
    # xe/xo: [tm, tk2]  w: [tn, tk2] uint8  s: [tn, tk2/16] uint8  o: [tm, tn]  acc: [tm, tn] f32
    k_idx = pl.program_id(2)

    @pl.when(k_idx == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _accumulate(
        xe_ref,
        xo_ref,
        w_ref,
        s_ref,
        acc_ref,
        k_idx=k_idx,
        k2=k2,
        tk2=tk2,
        cd=cd,
        interpret=interpret,
    )

    @pl.when(k_idx == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def matmul(x, blocks, scales, *, cfg: BlockConfig, interpret: bool):
    """x [M, K] (bf16/f32), blocks [N, K/32, 16] u8, scales [N, K/32] u8 -> [M, N] in x.dtype."""
    m, k = x.shape
    n = blocks.shape[0]
    _check_tpu_blocks(cfg, m, n, k, interpret)
    cd = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    tm, tn, tk2 = cfg.block_m, cfg.block_n, cfg.block_k // 2
    k2 = k // 2
    xe, xo = common.split_even_odd(x, cd)  # [M, K/2] each
    w = blocks.reshape(n, k2)  # free: [N, K/32, 16] -> [N, K/2]
    grid = (pl.cdiv(m, tm), pl.cdiv(n, tn), pl.cdiv(k2, tk2))
    kernel = functools.partial(_matmul_kernel, k2=k2, tk2=tk2, cd=cd, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=grid,
        in_specs=[
            pl.BlockSpec((tm, tk2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tm, tk2), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((tn, tk2), lambda i, j, kk: (j, kk)),
            pl.BlockSpec((tn, tk2 // 16), lambda i, j, kk: (j, kk)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
        name="mxfp4_matmul_tpu",
    )(xe, xo, w, scales)


def _grouped_kernel(
    tile_ref,
    group_ref,
    first_ref,
    wgroup_ref,
    start_ref,
    end_ref,
    xe_ref,
    xo_ref,
    w_ref,
    s_ref,
    o_ref,
    acc_ref,
    *,
    k2,
    tk2,
    tm,
    cd,
    interpret,
):
    # grid (N tiles, work items, K blocks). Scalar prefetch: per item tile/group/first/wgroup;
    # start/end: [E + 1] row ranges (entry E is the empty sentinel).
    # xe/xo: [tm, tk2]  w: [tn, tk2] (expert wgroup[i])  s: [tn, tk2/16]  o/acc: [tm, tn]
    del wgroup_ref  # used by the index maps only
    item = pl.program_id(1)
    k_idx = pl.program_id(2)
    g = group_ref[item]
    lo, hi = start_ref[g], end_ref[g]
    row0 = tile_ref[item] * tm
    has_rows = (hi > row0) & (lo < row0 + tm)

    @pl.when(k_idx == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(has_rows)
    def _():
        _accumulate(
            xe_ref,
            xo_ref,
            w_ref,
            s_ref,
            acc_ref,
            k_idx=k_idx,
            k2=k2,
            tk2=tk2,
            cd=cd,
            interpret=interpret,
        )

    @pl.when(k_idx == pl.num_programs(2) - 1)
    def _():
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= lo) & (rows < hi)
        prev = jnp.where(first_ref[item] == 1, jnp.zeros(o_ref.shape, o_ref.dtype), o_ref[...])
        o_ref[...] = jnp.where(mine, acc_ref[...].astype(o_ref.dtype), prev)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def grouped_matmul(x, blocks, scales, group_sizes, *, cfg: BlockConfig, interpret: bool):
    """x [M, K] sorted by expert, blocks [E, N, K/32, 16], scales [E, N, K/32], group_sizes [E]
    -> [M, N] in x.dtype; rows past sum(group_sizes) are 0."""
    m, k = x.shape
    e, n = blocks.shape[:2]
    _check_tpu_blocks(cfg, m, n, k, interpret)
    cd = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    tm, tn, tk2 = cfg.block_m, cfg.block_n, cfg.block_k // 2
    k2 = k // 2
    xe, xo = common.split_even_odd(x, cd)
    w = blocks.reshape(e, n, k2)
    tile, group, first, wgroup = common.work_items(group_sizes, m, tm)
    starts, ends = common.group_bounds(group_sizes)
    zero = jnp.zeros((1,), jnp.int32)
    starts, ends = jnp.concatenate([starts, zero]), jnp.concatenate([ends, zero])
    nk = pl.cdiv(k2, tk2)
    last_k = nk - 1

    def x_map(j, i, kk, tile, group, first, wgroup, st, en):
        return tile[i], kk

    def w_map(j, i, kk, tile, group, first, wgroup, st, en):
        # Sentinel items keep the previous block index, so the pipeline skips the fetch.
        return wgroup[i], j, jnp.where(group[i] < e, kk, last_k)

    def s_map(j, i, kk, tile, group, first, wgroup, st, en):
        return wgroup[i], j, jnp.where(group[i] < e, kk, last_k)

    def o_map(j, i, kk, tile, group, first, wgroup, st, en):
        return tile[i], j

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(pl.cdiv(n, tn), tile.shape[0], nk),
        in_specs=[
            pl.BlockSpec((tm, tk2), x_map),
            pl.BlockSpec((tm, tk2), x_map),
            pl.BlockSpec((None, tn, tk2), w_map),
            pl.BlockSpec((None, tn, tk2 // 16), s_map),
        ],
        out_specs=pl.BlockSpec((tm, tn), o_map),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    kernel = functools.partial(_grouped_kernel, k2=k2, tk2=tk2, tm=tm, cd=cd, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
        name="grouped_mxfp4_matmul_tpu",
    )(tile, group, first, wgroup, starts, ends, xe, xo, w, scales)
