"""Pallas token-sparse attention in MQA (absorbed-MLA) form, forward and backward.

Every query head of token t attends to the same selected latent rows kv[b, indices[b,t,:]]:

  logits[h,k] = scale * q[b,t,h] . kv[b, idx_k]          (all D channels; D = v_dim + rope)
  o[b,t,h]    = softmax_k(logits[h]) @ kv[b, idx_k, :v_dim]

Forward kernel, grid (B, T), one token per program (its H heads are the matmul M dimension):
the K selected indices are walked in chunks of ``attn_block_k``; each chunk's rows are fetched
(flavour-specific, below), the [H, block_k] logits are formed as two matmuls (value/latent
channels + rope channels, so every tile is a clean power of two on Triton for 512 + 64), and an
online softmax accumulates o in f32. Entries < 0 are masked to -inf (their fetch is clamped to
row 0, which is finite and weighted 0). The kernel also writes lse [B,T,H] (f32, -inf for rows
without any valid index; such rows output 0).

Row fetch per flavour (see config.py):
  "gpu": ``kv_ref[idx_chunk, pl.ds(...)]``: a vector-indexed load (Triton pointer gather);
  "tpu": kv stays in HBM (``pl.ANY``); the indices are read from SMEM and one DMA per row fills
         a double-buffered VMEM [2, block_k, D] scratch, chunk c+1 in flight while c computes.
         The SMEM copy of the indices is flattened to 1-D, one block per token, padded with -1
         to a power of two >= 128 (``_smem_len``): a per-token [B, T, K] block squeezes the
         second-minor T axis, which Mosaic's block rule rejects (it never lowered before).

Backward (``jax.custom_vjp``), grid (B, T_chunk): a second Pallas kernel recomputes p from lse,
forms dS = p * (dP - delta) with delta = rowsum(o * do) - dlse, and writes
  dq[t]            = scale * dS @ kv_sel                        (Pallas, f32 accumulation)
  contrib[t, k, :] = scale * dS^T @ q  (+ p^T @ do on the value channels)   f32 [K, D] per token
The contributions are scatter-added into dkv by XLA (``.at[idx].add``, invalid slots dropped),
in token chunks of ``bwd_chunk_t`` so the f32 [B, chunk, K, D] buffer stays bounded. Scatter-add
in JAX keeps one code path for TPU (no atomics) and GPU.

Covered: any B, T, S, H, K (padded to block_k with -1), v_dim <= D (D == v_dim: no rope part),
f32 and bf16 (f32 softmax/accumulators; bf16 matmul operands, as in flash attention), gradients
for q and kv, and the lse output's cotangent. Not covered: indices >= S (undefined, not checked
in-kernel), FP8 kv cache, deduplication of repeated indices (counted twice, as in the reference),
multi-token-per-program tiling (each program handles one token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dsa.config import DSABlockConfig, get_config

__all__ = ["sparse_attention"]

_NEG_INF = float("-inf")


def _next_pow2(x: int) -> int:
    return 1 << (int(x) - 1).bit_length()


# --------------------------------------------------------------------------------------------
# Layout: split channels into value/latent part [:v_dim] and rope part [v_dim:], pad per flavour.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Layout:
    h: int  # real heads
    hp: int  # padded heads
    da: int  # value/latent channels (= v_dim)
    dap: int  # padded
    dr: int  # rope channels (D - v_dim), may be 0
    drp: int  # padded (0 if dr == 0)
    k: int  # real top-k
    kp: int  # padded to block_k

    @property
    def dq(self) -> int:  # padded total channels
        return self.dap + self.drp


def _layout(h, d, v_dim, k, cfg: DSABlockConfig) -> _Layout:
    dr = d - v_dim
    if cfg.backend == "gpu":  # Triton: power-of-two tiles, tl.dot dims >= 16
        hp = max(16, _next_pow2(h))
        dap = max(16, _next_pow2(v_dim))
        drp = max(16, _next_pow2(dr)) if dr else 0
    else:
        hp, dap, drp = h, v_dim, dr
    bk = cfg.attn_block_k
    return _Layout(h=h, hp=hp, da=v_dim, dap=dap, dr=dr, drp=drp, k=k, kp=pl.cdiv(k, bk) * bk)


def _pad_channels(x, lay: _Layout):
    """[..., D] -> [..., dap + drp] (zero padding inside each channel group)."""
    if lay.dap == lay.da and lay.drp == lay.dr:
        return x
    pad = [(0, 0)] * (x.ndim - 1)
    parts = [jnp.pad(x[..., : lay.da], pad + [(0, lay.dap - lay.da)])]
    if lay.dr:
        parts.append(jnp.pad(x[..., lay.da:], pad + [(0, lay.drp - lay.dr)]))
    return jnp.concatenate(parts, axis=-1)


def _unpad_channels(x, lay: _Layout):
    if lay.dap == lay.da and lay.drp == lay.dr:
        return x
    parts = [x[..., : lay.da]]
    if lay.dr:
        parts.append(x[..., lay.dap: lay.dap + lay.dr])
    return jnp.concatenate(parts, axis=-1)


def _pad_heads(x, lay: _Layout):  # [B,T,H,C] -> [B,T,Hp,C]
    return x if lay.hp == lay.h else jnp.pad(x, ((0, 0), (0, 0), (0, lay.hp - lay.h), (0, 0)))


def _pad_k(idx, lay: _Layout):  # [B,T,K] -> [B,T,Kp], -1 padding
    return idx if lay.kp == lay.k else jnp.pad(
        idx, ((0, 0), (0, 0), (0, lay.kp - lay.k)), constant_values=-1)


# --------------------------------------------------------------------------------------------
# In-kernel helpers.
# --------------------------------------------------------------------------------------------
def _dot(a, b, contract, precision):
    """2-D dot_general with f32 accumulation; contract = (lhs_dim, rhs_dim)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=jnp.float32, precision=precision)


class _GatherFetch:
    """'gpu' flavour: vector-indexed loads straight from the kv block (Triton pointer gather)."""

    def __init__(self, idx_ref, kv_ref, lay: _Layout, bk: int):
        self.idx_ref, self.kv_ref, self.lay, self.bk = idx_ref, kv_ref, lay, bk

    def start(self, c, slot):
        del c, slot

    def index_row(self, c):  # [1, bk] int32 (validity is tested after broadcasting)
        return self.idx_ref[pl.ds(c * self.bk, self.bk)][None, :]

    def rows(self, c, slot):  # -> (ka [bk, dap], kr [bk, drp] | None)
        del slot
        i = self.idx_ref[pl.ds(c * self.bk, self.bk)]  # [bk]
        i = jnp.where(i >= 0, i, 0)
        ka = self.kv_ref[i, pl.ds(0, self.lay.dap)]
        kr = self.kv_ref[i, pl.ds(self.lay.dap, self.lay.drp)] if self.lay.drp else None
        return ka, kr


class _DmaFetch:
    """'tpu' flavour: per-row DMAs HBM -> double-buffered VMEM, indices read from SMEM."""

    def __init__(self, idx_smem, idx_vmem, kv_hbm, buf, sem, lay: _Layout, bk: int):
        self.idx_smem, self.idx_vmem, self.kv_hbm = idx_smem, idx_vmem, kv_hbm
        self.buf, self.sem, self.lay, self.bk = buf, sem, lay, bk
        self.b = pl.program_id(0)

    def _copy(self, row, j, slot):
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.make_async_copy(self.kv_hbm.at[self.b, pl.ds(row, 1)],
                                     self.buf.at[slot, pl.ds(j, 1)], self.sem.at[slot])

    def start(self, c, slot):
        def body(j, carry):
            r = self.idx_smem[c * self.bk + j]
            self._copy(jnp.maximum(r, 0), j, slot).start()  # invalid -> row 0 (weighted 0)
            return carry

        lax.fori_loop(0, self.bk, body, 0)

    def index_row(self, c):  # [1, bk] int32, from the VMEM copy of the indices
        start = pl.multiple_of(c * self.bk, self.bk)
        return self.idx_vmem[:, pl.ds(start, self.bk)]

    def rows(self, c, slot):
        def body(j, carry):  # every row copy has the same size: wait once per row
            self._copy(0, j, slot).wait()
            return carry

        lax.fori_loop(0, self.bk, body, 0)
        ka = self.buf[slot, :, pl.ds(0, self.lay.dap)]
        kr = self.buf[slot, :, pl.ds(self.lay.dap, self.lay.drp)] if self.lay.drp else None
        return ka, kr


def _run_chunks(fetch, n_chunks: int, body, init):
    """Loop over index chunks; the fetch of chunk c+1 is started before chunk c computes."""
    fetch.start(0, 0)

    def step(c, carry):
        slot = c % 2

        @pl.when(c + 1 < n_chunks)
        def _():
            fetch.start(c + 1, 1 - slot)

        ka, kr = fetch.rows(c, slot)
        return body(c, ka, kr, fetch.index_row(c), carry)

    return lax.fori_loop(0, n_chunks, step, init)


# --------------------------------------------------------------------------------------------
# Forward kernel.
# --------------------------------------------------------------------------------------------
def _fwd_body(q_ref, o_ref, lse_ref, fetch, *, lay: _Layout, bk: int, scale: float, precision):
    # q_ref [Hp, Dq], o_ref [Hp, Dap], lse_ref [Hp, 1]
    qa = q_ref[:, pl.ds(0, lay.dap)]  # [Hp, Dap]
    qr = q_ref[:, pl.ds(lay.dap, lay.drp)] if lay.drp else None  # [Hp, Drp]

    def body(c, ka, kr, irow, carry):
        m, l, acc = carry  # [Hp,1], [Hp,1], [Hp,Dap] f32
        s = _dot(qa, ka, (1, 1), precision)  # [Hp, bk]
        if kr is not None:
            s = s + _dot(qr, kr, (1, 1), precision)
        # broadcast the int32 index row first, compare second (no i1 vector broadcasts)
        s = jnp.where(jnp.broadcast_to(irow, s.shape) >= 0, s * scale, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new > _NEG_INF, m_new, 0.0)  # all-masked so far: avoid inf - inf
        p = jnp.exp(s - m_use)  # masked -> exp(-inf) = 0
        alpha = jnp.exp(m - m_use)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + _dot(p.astype(ka.dtype), ka, (1, 0), precision)
        return m_new, l, acc

    hp = qa.shape[0]
    init = (jnp.full((hp, 1), _NEG_INF, jnp.float32), jnp.zeros((hp, 1), jnp.float32),
            jnp.zeros((hp, lay.dap), jnp.float32))
    m, l, acc = _run_chunks(fetch, lay.kp // bk, body, init)
    has = l > 0.0
    o_ref[...] = (acc / jnp.where(has, l, 1.0)).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), _NEG_INF)


def _gpu_fwd_kernel(idx_ref, q_ref, kv_ref, o_ref, lse_ref, **kw):
    fetch = _GatherFetch(idx_ref, kv_ref, kw["lay"], kw["bk"])
    _fwd_body(q_ref, o_ref, lse_ref, fetch, **kw)


def _tpu_fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, o_ref, lse_ref, buf, sem, **kw):
    fetch = _DmaFetch(idx_smem, idx_vmem, kv_hbm, buf, sem, kw["lay"], kw["bk"])
    _fwd_body(q_ref, o_ref, lse_ref, fetch, **kw)


# --------------------------------------------------------------------------------------------
# Backward kernel: dq and per-token dkv contributions.
# --------------------------------------------------------------------------------------------
def _bwd_body(q_ref, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref, fetch, *, lay: _Layout, bk: int,
              scale: float, precision):
    # q_ref [Hp,Dq], do_ref [Hp,Dap], lse_ref/delta_ref [Hp,1]; dq_ref [Hp,Dq]; dkv_ref [Kp,Dq] f32
    qa = q_ref[:, pl.ds(0, lay.dap)]
    qr = q_ref[:, pl.ds(lay.dap, lay.drp)] if lay.drp else None
    do = do_ref[...]
    lse = lse_ref[...]  # [Hp, 1]; -inf for rows without any valid index (their p is 0)
    delta = delta_ref[...]
    lse_use = jnp.where(lse > _NEG_INF, lse, jnp.inf)  # exp(s - inf) = 0 for empty rows

    def body(c, ka, kr, irow, carry):
        dqa, dqr = carry
        s = _dot(qa, ka, (1, 1), precision)
        if kr is not None:
            s = s + _dot(qr, kr, (1, 1), precision)
        p = jnp.exp(s * scale - lse_use)  # [Hp, bk]
        p = jnp.where(jnp.broadcast_to(irow, p.shape) >= 0, p, 0.0)
        dp = _dot(do, ka, (1, 1), precision)  # [Hp, bk]
        ds = p * (dp - delta)  # [Hp, bk]
        ds_c = ds.astype(ka.dtype)
        dqa = dqa + _dot(ds_c, ka, (1, 0), precision)
        start = pl.multiple_of(c * bk, bk)
        dka = scale * _dot(ds_c, qa, (0, 0), precision) + _dot(p.astype(do.dtype), do, (0, 0), precision)
        dkv_ref[pl.ds(start, bk), pl.ds(0, lay.dap)] = dka  # [bk, Dap]
        if kr is not None:
            dqr = dqr + _dot(ds_c, kr, (1, 0), precision)
            dkv_ref[pl.ds(start, bk), pl.ds(lay.dap, lay.drp)] = scale * _dot(ds_c, qr, (0, 0), precision)
        return dqa, dqr

    hp = qa.shape[0]
    init = (jnp.zeros((hp, lay.dap), jnp.float32), jnp.zeros((hp, max(lay.drp, 1)), jnp.float32))
    dqa, dqr = _run_chunks(fetch, lay.kp // bk, body, init)
    dq_ref[:, pl.ds(0, lay.dap)] = (scale * dqa).astype(dq_ref.dtype)
    if lay.drp:
        dq_ref[:, pl.ds(lay.dap, lay.drp)] = (scale * dqr).astype(dq_ref.dtype)


def _gpu_bwd_kernel(idx_ref, q_ref, kv_ref, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref, **kw):
    fetch = _GatherFetch(idx_ref, kv_ref, kw["lay"], kw["bk"])
    _bwd_body(q_ref, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref, fetch, **kw)


def _tpu_bwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref,
                    buf, sem, **kw):
    fetch = _DmaFetch(idx_smem, idx_vmem, kv_hbm, buf, sem, kw["lay"], kw["bk"])
    _bwd_body(q_ref, do_ref, lse_ref, delta_ref, dq_ref, dkv_ref, fetch, **kw)


# --------------------------------------------------------------------------------------------
# pallas_call wrappers.
# --------------------------------------------------------------------------------------------
def _compiler_params(cfg: DSABlockConfig, interpret: bool):
    if interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        # The token axis carries no state: both grid axes are parallel (megacore split).
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    from jax.experimental.pallas import triton as pltr

    return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _token_spec(*tail):
    """BlockSpec selecting one (b, t) slice of a [B, T, *tail] array."""
    zeros = (0,) * len(tail)
    return pl.BlockSpec((None, None) + tuple(tail), lambda b, t: (b, t) + zeros)


def _smem_len(kp: int) -> int:
    """Length of one token's index block in SMEM (>= kp, -1 padded).

    Mosaic's block rules apply to SMEM blocks too: a per-token [B, T, Kp] block squeezes T, the
    second-minor dim (rejected: it must be a multiple of 8 or all of T), so the indices go to
    SMEM flattened to 1-D, one block per token, and a 1-D block must be a power of two >= 128
    or a multiple of 1024 (int32). Only SMEM holds the extra padding; the kernels walk kp.
    """
    if kp <= 1024:
        return max(128, _next_pow2(kp))
    return pl.cdiv(kp, 1024) * 1024


def _common_in_specs(lay: _Layout, cfg: DSABlockConfig, s: int, t: int):
    """(specs, scratch) for the idx / q / kv inputs of either kernel (t: the grid's tokens)."""
    if cfg.backend == "gpu":
        specs = [_token_spec(lay.kp), _token_spec(lay.hp, lay.dq),
                 pl.BlockSpec((None, s, lay.dq), lambda b, t: (b, 0, 0))]
        return specs, []
    from jax.experimental.pallas import tpu as pltpu

    specs = [
        pl.BlockSpec((_smem_len(lay.kp),), lambda b, i: (b * t + i,), memory_space=pltpu.SMEM),
        _token_spec(1, lay.kp),
        _token_spec(lay.hp, lay.dq),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    return specs, []


def _scratch(lay: _Layout, cfg: DSABlockConfig, kv_dtype):
    if cfg.backend == "gpu":
        return []
    from jax.experimental.pallas import tpu as pltpu

    return [pltpu.VMEM((2, cfg.attn_block_k, lay.dq), kv_dtype), pltpu.SemaphoreType.DMA((2,))]


def _idx_args(idx_p, cfg):
    b, t, kp = idx_p.shape
    if cfg.backend == "gpu":
        return (idx_p,)
    ks = _smem_len(kp)
    flat = jnp.pad(idx_p, ((0, 0), (0, 0), (0, ks - kp)), constant_values=-1).reshape(b * t * ks)
    return flat, idx_p.reshape(b, t, 1, kp)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _fwd_call(q, kv, idx, *, scale, v_dim, cfg: DSABlockConfig, interpret: bool):
    b, t, h, d = q.shape
    s = kv.shape[1]
    lay = _layout(h, d, v_dim, idx.shape[-1], cfg)
    qp = _pad_channels(_pad_heads(q, lay), lay)  # [B,T,Hp,Dq]
    kvp = _pad_channels(kv, lay)  # [B,S,Dq]
    idx_p = _pad_k(idx, lay)  # [B,T,Kp]
    kw = dict(lay=lay, bk=cfg.attn_block_k, scale=scale, precision=_precision(q.dtype))
    kernel = _gpu_fwd_kernel if cfg.backend == "gpu" else _tpu_fwd_kernel
    in_specs, _ = _common_in_specs(lay, cfg, s, t)
    o, lse = pl.pallas_call(
        functools.partial(kernel, **kw),
        grid=(b, t),
        in_specs=in_specs,
        out_specs=[_token_spec(lay.hp, lay.dap), _token_spec(lay.hp, 1)],
        out_shape=[jax.ShapeDtypeStruct((b, t, lay.hp, lay.dap), q.dtype),
                   jax.ShapeDtypeStruct((b, t, lay.hp, 1), jnp.float32)],
        scratch_shapes=_scratch(lay, cfg, kv.dtype),
        compiler_params=_compiler_params(cfg, interpret),
        interpret=interpret,
        name="dsa_sparse_attention_fwd",
    )(*_idx_args(idx_p, cfg), qp, kvp)
    return o[:, :, :h, :v_dim], lse[:, :, :h, 0]


def _bwd_chunk_call(q, kv, idx, do, lse, delta, *, scale, lay: _Layout, cfg, interpret):
    """One token chunk: padded inputs -> (dq [B,t,Hp,Dq] in q dtype, contrib [B,t,Kp,Dq] f32)."""
    b, t = q.shape[:2]
    s = kv.shape[1]
    kw = dict(lay=lay, bk=cfg.attn_block_k, scale=scale, precision=_precision(q.dtype))
    kernel = _gpu_bwd_kernel if cfg.backend == "gpu" else _tpu_bwd_kernel
    in_specs, _ = _common_in_specs(lay, cfg, s, t)
    in_specs = in_specs + [_token_spec(lay.hp, lay.dap), _token_spec(lay.hp, 1),
                           _token_spec(lay.hp, 1)]
    return pl.pallas_call(
        functools.partial(kernel, **kw),
        grid=(b, t),
        in_specs=in_specs,
        out_specs=[_token_spec(lay.hp, lay.dq), _token_spec(lay.kp, lay.dq)],
        out_shape=[jax.ShapeDtypeStruct((b, t, lay.hp, lay.dq), q.dtype),
                   jax.ShapeDtypeStruct((b, t, lay.kp, lay.dq), jnp.float32)],
        scratch_shapes=_scratch(lay, cfg, kv.dtype),
        compiler_params=_compiler_params(cfg, interpret),
        interpret=interpret,
        name="dsa_sparse_attention_bwd",
    )(*_idx_args(idx, cfg), q, kv, do, lse, delta)


def _bwd(q, kv, idx, o, lse, do, dlse, *, scale, v_dim, cfg: DSABlockConfig, interpret: bool):
    b, t, h, d = q.shape
    s = kv.shape[1]
    lay = _layout(h, d, v_dim, idx.shape[-1], cfg)
    # delta = rowsum(o * do) - dlse: the lse output's cotangent enters dS = p * (dP - delta).
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B,T,H]
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    row_pad = ((0, 0), (0, 0), (0, lay.hp - h))
    lse_p = jnp.pad(lse, row_pad, constant_values=_NEG_INF)[..., None]  # [B,T,Hp,1]
    delta_p = jnp.pad(delta, row_pad)[..., None]
    qp = _pad_channels(_pad_heads(q, lay), lay)  # [B,T,Hp,Dq]
    kvp = _pad_channels(kv, lay)  # [B,S,Dq]
    dop = _pad_heads(jnp.pad(do.astype(q.dtype), ((0, 0),) * 3 + ((0, lay.dap - v_dim),)), lay)
    idx_p = _pad_k(idx, lay)  # [B,T,Kp]
    call = functools.partial(_bwd_chunk_call, scale=scale, lay=lay, cfg=cfg, interpret=interpret)

    def scatter(dkv, idx_c, contrib):  # dkv [B,S,Dq] f32 += contrib [B,t,Kp,Dq] at idx_c
        tgt = jnp.where(idx_c >= 0, idx_c, s).reshape(b, -1)  # invalid -> out of range: dropped
        src = contrib.reshape(b, -1, lay.dq)
        return jax.vmap(lambda a, i, v: a.at[i].add(v, mode="drop"))(dkv, tgt, src)

    ct = min(cfg.bwd_chunk_t, t)
    dkv0 = jnp.zeros((b, s, lay.dq), jnp.float32)
    if ct >= t:
        dq, contrib = call(qp, kvp, idx_p, dop, lse_p, delta_p)
        dkv = scatter(dkv0, idx_p, contrib)
    else:
        n = pl.cdiv(t, ct)
        tpad = n * ct - t

        def chunks(x, fill=0):
            x = jnp.pad(x, ((0, 0), (0, tpad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
            return x.reshape((b, n, ct) + x.shape[2:]).swapaxes(0, 1)  # [n,B,ct,...]

        xs = (chunks(qp), chunks(idx_p, -1), chunks(dop), chunks(lse_p, _NEG_INF), chunks(delta_p))

        def step(dkv, x):
            qc, ic, dc, lc, ec = x
            dq_c, contrib = call(qc, kvp, ic, dc, lc, ec)
            return scatter(dkv, ic, contrib), dq_c

        dkv, dq = lax.scan(step, dkv0, xs)
        dq = dq.swapaxes(0, 1).reshape((b, n * ct) + dq.shape[3:])[:, :t]
    dq = _unpad_channels(dq[:, :, :h], lay).astype(q.dtype)
    dkv = _unpad_channels(dkv, lay).astype(kv.dtype)
    return dq, dkv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _sparse(q, kv, idx, scale, v_dim, cfg, interpret):
    return _fwd_call(q, kv, idx, scale=scale, v_dim=v_dim, cfg=cfg, interpret=interpret)


def _sparse_fwd(q, kv, idx, scale, v_dim, cfg, interpret):
    o, lse = _fwd_call(q, kv, idx, scale=scale, v_dim=v_dim, cfg=cfg, interpret=interpret)
    return (o, lse), (q, kv, idx, o, lse)


def _sparse_bwd(scale, v_dim, cfg, interpret, res, g):
    q, kv, idx, o, lse = res
    do, dlse = g
    dq, dkv = _bwd(q, kv, idx, o, lse, do, dlse, scale=scale, v_dim=v_dim, cfg=cfg,
                   interpret=interpret)
    return dq, dkv, None


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "v_dim", "config", "interpret", "kernel"))
def sparse_attention(q, kv, indices, *, scale: float, v_dim: int, interpret: bool = False,
                     config: DSABlockConfig | None = None, kernel: str | None = None):
    """Pallas sparse MQA attention -> (o [B,T,H,v_dim] in q's dtype, lse [B,T,H] f32).

    q [B,T,H,D], kv [B,S,D], indices [B,T,K] int32 (< 0 = skip). Differentiable in q and kv.
    kernel ("gpu" | "tpu" | None = the running platform's) picks the flavour when config is None.
    """
    assert q.ndim == 4 and kv.ndim == 3 and indices.ndim == 3, (q.shape, kv.shape, indices.shape)
    b, t, h, d = q.shape
    assert kv.shape[0] == b and kv.shape[2] == d, (q.shape, kv.shape)
    assert indices.shape[:2] == (b, t), (indices.shape, q.shape)
    assert 0 < v_dim <= d, (v_dim, d)
    cfg = config or get_config(t=t, s=kv.shape[1], topk=indices.shape[-1], heads=h, dim=d,
                               backend=kernel, interpret=bool(interpret))
    if cfg.backend == "tpu" and jnp.dtype(q.dtype).itemsize < 4:
        # The Mosaic compiler rejects the one-row DMAs into a VMEM tile of a 16-bit kv
        # ("Offsets along tiled dimensions must be aligned to tiles": a bf16 tile packs two
        # rows per sublane, so row r's slice is not tile-aligned); 32-bit rows are. The TPU
        # flavour therefore gathers from an f32 copy of kv (2x its bytes in HBM and per DMA)
        # and returns o in q's dtype (tests/pallas_kernels/test_tpu_compile.py).
        o, lse = _sparse(q.astype(jnp.float32), kv.astype(jnp.float32),
                         indices.astype(jnp.int32), float(scale), int(v_dim), cfg,
                         bool(interpret))
        return o.astype(q.dtype), lse
    return _sparse(q, kv.astype(q.dtype), indices.astype(jnp.int32), float(scale), int(v_dim),
                   cfg, bool(interpret))
