"""MXFP4 matmuls as Triton-style Pallas kernels (GPU): one program per output tile, K loop inside.

Coverage: dense `matmul` and `grouped_matmul` (MoE). Differences from the TPU kernels:
  * Triton programs run concurrently with no ordering, so there is no K grid axis with a carried
    accumulator: each program loops over K with `lax.fori_loop`, accumulating in registers.
  * Inputs are whole-array refs (no BlockSpec) and every load/store is masked by its row / column
    / K bounds (`plgpu.load(..., mask, other=0)`), so M, N and K need no alignment to the tiles.
    Masked-off weight bytes read as 0 (code 0, scale byte 0 -> value 0) and masked activations
    as 0, so the ragged K tail contributes exactly nothing.
  * Scale expansion is a broadcast + reshape (Triton handles it; Mosaic needs the one-hot dot).
  * Grouped: programs own one M tile each and loop over the (dynamic) range of experts that
    overlap it (`common.tile_group_ranges`), each expert's rows masked, so no two programs write
    the same output tile (the TPU kernel's consecutive-revisit scheme would race here).
All extents are powers of two (>= 16 for dot operands; see `config.check_config`).

Runs compiled on GPU and in interpret mode anywhere (CPU tests). Not yet run on a GPU (none was
available at the time of writing); the Triton lowering (fwd + bwd, test and benchmark shapes) is
checked from a CPU host by tests/pallas_kernels/test_lowering.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mxfp4 import common
from pallas_kernels.mxfp4.config import BlockConfig


def _tile_product(
    xe_ref,
    xo_ref,
    w_ref,
    s_ref,
    *,
    row0,
    rmask,
    col0,
    cmask,
    tm,
    tn,
    k2,
    tk2,
    cd,
    acc,
    expert=None,
):
    """acc + sum over K of x_even @ w_lo.T + x_odd @ w_hi.T for one (rows, cols) tile.

    xe/xo refs: [M, K/2]; w ref: [N, K/2] u8; s ref: [N, K/32] u8; with `expert`, w and s carry
    a leading expert axis ([E, N, K/2], [E, N, K/32]) indexed in the same (single) indexer, as
    the Triton lowering supports one indexer per load.
    """
    ts = tk2 // 16
    pre = () if expert is None else (expert,)

    def body(kk, acc):
        k0 = kk * tk2
        kmask = (k0 + jnp.arange(tk2)) < k2
        smask = (kk * ts + jnp.arange(ts)) < (k2 // 16)
        xm = rmask[:, None] & kmask[None, :]
        xe = plgpu.load(xe_ref.at[pl.ds(row0, tm), pl.ds(k0, tk2)], mask=xm, other=0)
        xo = plgpu.load(xo_ref.at[pl.ds(row0, tm), pl.ds(k0, tk2)], mask=xm, other=0)
        w = plgpu.load(
            w_ref.at[(*pre, pl.ds(col0, tn), pl.ds(k0, tk2))],
            mask=cmask[:, None] & kmask[None, :],
            other=0,
        )
        s = plgpu.load(
            s_ref.at[(*pre, pl.ds(col0, tn), pl.ds(kk * ts, ts))],
            mask=cmask[:, None] & smask[None, :],
            other=0,
        )
        s_rep = common.scale_to_f32(common.expand_scales_reshape(s.astype(jnp.int32)))
        we, wo = common.decode_tile(w, s_rep, cd)
        return acc + common.dot_nt(xe.astype(cd), we) + common.dot_nt(xo.astype(cd), wo)

    return lax.fori_loop(0, pl.cdiv(k2, tk2), body, acc)


def _matmul_kernel(xe_ref, xo_ref, w_ref, s_ref, o_ref, *, m, n, k2, tm, tn, tk2, cd):
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * tm, j * tn
    rmask = (row0 + jnp.arange(tm)) < m
    cmask = (col0 + jnp.arange(tn)) < n
    acc = _tile_product(
        xe_ref,
        xo_ref,
        w_ref,
        s_ref,
        row0=row0,
        rmask=rmask,
        col0=col0,
        cmask=cmask,
        tm=tm,
        tn=tn,
        k2=k2,
        tk2=tk2,
        cd=cd,
        acc=jnp.zeros((tm, tn), jnp.float32),
    )
    plgpu.store(
        o_ref.at[pl.ds(row0, tm), pl.ds(col0, tn)],
        acc.astype(o_ref.dtype),
        mask=rmask[:, None] & cmask[None, :],
    )


def _compiler_params(cfg: BlockConfig):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def matmul(x, blocks, scales, *, cfg: BlockConfig, interpret: bool):
    """x [M, K] (bf16/f32), blocks [N, K/32, 16] u8, scales [N, K/32] u8 -> [M, N] in x.dtype."""
    m, k = x.shape
    n = blocks.shape[0]
    cd = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    tm, tn, tk2 = cfg.block_m, cfg.block_n, cfg.block_k // 2
    k2 = k // 2
    xe, xo = common.split_even_odd(x, cd)
    w = blocks.reshape(n, k2)
    kernel = functools.partial(_matmul_kernel, m=m, n=n, k2=k2, tm=tm, tn=tn, tk2=tk2, cd=cd)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn)),
        compiler_params=_compiler_params(cfg),
        interpret=interpret,
        name="mxfp4_matmul_gpu",
    )(xe, xo, w, scales)


def _grouped_kernel(
    glo_ref,
    ghi_ref,
    start_ref,
    end_ref,
    xe_ref,
    xo_ref,
    w_ref,
    s_ref,
    o_ref,
    *,
    m,
    n,
    k2,
    tm,
    tn,
    tk2,
    cd,
):
    # glo/ghi: [num M tiles] expert range per tile; start/end: [E]; w: [E, N, K/2]; s: [E, N, K/32]
    i, j = pl.program_id(0), pl.program_id(1)
    row0, col0 = i * tm, j * tn
    rows = row0 + jnp.arange(tm)
    rmask = rows < m
    cmask = (col0 + jnp.arange(tn)) < n

    def per_group(g, out):
        lo, hi = start_ref[g], end_ref[g]
        mine = rmask & (rows >= lo) & (rows < hi)
        acc = _tile_product(
            xe_ref,
            xo_ref,
            w_ref,
            s_ref,
            expert=g,
            row0=row0,
            rmask=mine,
            col0=col0,
            cmask=cmask,
            tm=tm,
            tn=tn,
            k2=k2,
            tk2=tk2,
            cd=cd,
            acc=jnp.zeros((tm, tn), jnp.float32),
        )
        return jnp.where(mine[:, None], acc, out)

    out = lax.fori_loop(glo_ref[i], ghi_ref[i], per_group, jnp.zeros((tm, tn), jnp.float32))
    plgpu.store(
        o_ref.at[pl.ds(row0, tm), pl.ds(col0, tn)],
        out.astype(o_ref.dtype),
        mask=rmask[:, None] & cmask[None, :],
    )


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def grouped_matmul(x, blocks, scales, group_sizes, *, cfg: BlockConfig, interpret: bool):
    """x [M, K] sorted by expert, blocks [E, N, K/32, 16], scales [E, N, K/32], group_sizes [E]
    -> [M, N] in x.dtype; rows past sum(group_sizes) are 0."""
    m, k = x.shape
    e, n = blocks.shape[:2]
    cd = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    tm, tn, tk2 = cfg.block_m, cfg.block_n, cfg.block_k // 2
    k2 = k // 2
    xe, xo = common.split_even_odd(x, cd)
    w = blocks.reshape(e, n, k2)
    g_lo, g_hi = common.tile_group_ranges(group_sizes, m, tm)
    starts, ends = common.group_bounds(group_sizes)
    kernel = functools.partial(_grouped_kernel, m=m, n=n, k2=k2, tm=tm, tn=tn, tk2=tk2, cd=cd)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn)),
        compiler_params=_compiler_params(cfg),
        interpret=interpret,
        name="grouped_mxfp4_matmul_gpu",
    )(g_lo, g_hi, starts, ends, xe, xo, w, scales)
