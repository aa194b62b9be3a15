"""Pure-jnp reference for DeepSeek Sparse Attention (DSA): the correctness oracle and CPU default.

DSA (DeepSeek-V3.2) = a *lightning indexer* that scores every (query, key) pair cheaply, a
per-query top-k token selection under the causal mask, and MLA attention restricted to the
selected tokens. Attention is in MLA's *absorbed* (MQA) form: every query head of a token attends
over the same latent rows kv[b, s] (value = the first ``v_dim`` channels, key = all channels).

Shapes (B batch, T queries, S keys, H query heads, HI indexer heads, D head dim, K top-k):

  indexer_scores(q_idx [B,T,HI,D], k_idx [B,S,D], w [B,T,HI]) -> scores [B,T,S] f32
      scores[b,t,s] = sum_j w[b,t,j] * relu(q_idx[b,t,j] . k_idx[b,s])
  select_topk(scores [B,T,S], topk, q_offset) -> indices [B,T,K] int32 (-1 = no key)
      key s is valid for query t iff s <= t + q_offset (q_offset: scalar or per-row [B])
  sparse_attention(q [B,T,H,D], kv [B,S,D], indices [B,T,K], scale, v_dim) -> o [B,T,H,v_dim]
  dense_causal_attention(q, kv, scale, v_dim, q_offset) -> o [B,T,H,v_dim]

The public functions are jitted (static: topk, approx, scale, v_dim, block_t; q_offset is traced,
so a per-row offset array does not recompile).

Conventions shared by every implementation (reference, XLA-chunked, Pallas):
  * logits, softmax and the output accumulation are f32; outputs are cast to q's dtype.
  * a query row with no valid key (all indices -1, or no causal key) outputs exactly 0, and its
    gradients are 0 (no NaN): this happens for padded rows / negative q_offset.
  * duplicate indices are not deduplicated: a key selected twice gets twice the weight
    (``select_topk`` never produces duplicates).

Not covered here: FP8 indexer arithmetic (DeepSeek runs the indexer in FP8; this is f32 math on
whatever dtype comes in), and the indexer training losses (they live in model/layers/dsa.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "indexer_scores",
    "select_topk",
    "causal_valid_mask",
    "sparse_attention",
    "sparse_attention_fwd_with_lse",
    "dense_causal_attention",
]

_F32 = jnp.float32


def _hi(dtype) -> lax.Precision:
    # f32 inputs: full-precision matmuls (the oracle must not silently drop to bf16 passes);
    # low-precision inputs are exact in one pass anyway.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# --------------------------------------------------------------------------------------------
# Lightning indexer.
# --------------------------------------------------------------------------------------------
@jax.jit
def indexer_scores(q_idx: jax.Array, k_idx: jax.Array, w: jax.Array) -> jax.Array:
    """scores[b,t,s] = sum_j w[b,t,j] * relu(q_idx[b,t,j] . k_idx[b,s]); f32 [B,T,S].

    Materialises the [B,T,HI,S] per-head logits: fine as an oracle and for short sequences; the
    Pallas kernel fuses the ReLU-weighted head reduction and never materialises them.
    """
    assert q_idx.ndim == 4 and k_idx.ndim == 3 and w.ndim == 3, (q_idx.shape, k_idx.shape, w.shape)
    logits = jnp.einsum(
        "bthd,bsd->bths", q_idx, k_idx, preferred_element_type=_F32, precision=_hi(q_idx.dtype)
    )  # [B,T,HI,S]
    return jnp.einsum(
        "bths,bth->bts", jax.nn.relu(logits), w.astype(_F32), precision=lax.Precision.HIGHEST
    )  # [B,T,S]


# --------------------------------------------------------------------------------------------
# Top-k selection.
# --------------------------------------------------------------------------------------------
def causal_valid_mask(b: int, t: int, s: int, q_offset=0) -> jax.Array:
    """Bool [B or 1, T, S]: key s is visible to query t iff s <= t + q_offset.

    q_offset: python int, scalar array, or int array [B] (rows of different lengths).
    """
    off = jnp.asarray(q_offset, jnp.int32)
    if off.ndim == 0:
        off = off[None]
    assert off.ndim == 1 and off.shape[0] in (1, b), (off.shape, b)
    tpos = jnp.arange(t, dtype=jnp.int32)[None, :, None] + off[:, None, None]  # [B|1,T,1]
    spos = jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [1,1,S]
    return spos <= tpos


@functools.partial(jax.jit, static_argnames=("topk", "approx"))
def select_topk(scores: jax.Array, topk: int, *, q_offset=0, approx: bool = False) -> jax.Array:
    """Per-query top-k keys under the causal mask -> int32 [B,T,topk], -1 in unused slots.

    * valid keys for query t: s <= t + q_offset (q_offset scalar or per-row [B]);
    * slots are ordered by descending score; when fewer than ``topk`` keys are valid (early
      queries, short rows) the trailing slots are -1; ``topk > S`` is allowed (extra slots -1);
    * ``approx=True`` uses ``lax.approx_max_k`` (TPU-fast partial reduction, recall ~0.95; exact
      on CPU/GPU where it falls back to a sort). Validity is still exact: an invalid key is never
      returned, whatever the approximation.
    * NaN scores are treated as -inf (never preferred over a finite score); a valid key whose
      score is -inf may lose its slot to an invalid one (then that slot is -1).
    """
    assert scores.ndim == 3, scores.shape
    b, t, s = scores.shape
    topk = int(topk)
    assert topk >= 1, topk
    valid = causal_valid_mask(b, t, s, q_offset)  # [B|1,T,S]
    x = jnp.where(valid & ~jnp.isnan(scores), scores.astype(_F32), -jnp.inf)  # [B,T,S]
    valid = jnp.broadcast_to(valid, x.shape)
    if topk > s:  # pad with never-valid columns so top_k is defined
        x = jnp.pad(x, ((0, 0), (0, 0), (0, topk - s)), constant_values=-jnp.inf)
        valid = jnp.pad(valid, ((0, 0), (0, 0), (0, topk - s)), constant_values=False)
    if approx:
        _, idx = lax.approx_max_k(x, topk, recall_target=0.95)
    else:
        _, idx = lax.top_k(x, topk)  # [B,T,K]
    idx = idx.astype(jnp.int32)
    ok = jnp.take_along_axis(valid, idx, axis=-1) & (jnp.take_along_axis(x, idx, axis=-1) > -jnp.inf)
    return jnp.where(ok, idx, -1)


# --------------------------------------------------------------------------------------------
# Attention (MQA / absorbed-MLA form).
# --------------------------------------------------------------------------------------------
def _check_attn(q, kv, v_dim):
    assert q.ndim == 4 and kv.ndim == 3, (q.shape, kv.shape)
    assert q.shape[0] == kv.shape[0] and q.shape[-1] == kv.shape[-1], (q.shape, kv.shape)
    assert 0 < v_dim <= kv.shape[-1], (v_dim, kv.shape)


def _sparse_block(q, kv, indices, scale, v_dim):
    """q [B,t,H,D], kv [B,S,D], indices [B,t,K] -> (o [B,t,H,v_dim], lse [B,t,H]).

    Laid out for XLA:CPU (about 4x faster there than the textbook [B,t,H,K] form): one flat
    row gather, logits as [B,t,K,H] (K rows x H heads per token), and the value matmul over all
    D channels of the gathered rows, sliced to v_dim afterwards (no copy of a [B,t,K,v_dim]
    slice of the gather).
    """
    b, t, h, d = q.shape
    s = kv.shape[1]
    valid = indices >= 0  # [B,t,K]
    flat = jnp.where(valid, indices, 0) + (jnp.arange(b, dtype=jnp.int32) * s)[:, None, None]
    kv_sel = jnp.take(kv.reshape(b * s, d), flat.reshape(-1), axis=0).reshape(b, t, -1, d)
    logits = jnp.einsum(
        "btkd,bthd->btkh", kv_sel, q, preferred_element_type=_F32, precision=_hi(q.dtype)
    ) * scale  # [B,t,K,H]
    vmask = valid[..., None]  # [B,t,K,1]
    logits = jnp.where(vmask, logits, -jnp.inf)
    m = jnp.max(logits, axis=2, keepdims=True)  # [B,t,1,H]
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(vmask, jnp.exp(logits - m), 0.0)  # [B,t,K,H]
    l = jnp.sum(p, axis=2)  # [B,t,H]
    l_safe = jnp.where(l > 0, l, 1.0)
    o = jnp.einsum("btkh,btkd->bthd", p, kv_sel.astype(_F32), precision=lax.Precision.HIGHEST)
    o = o[..., :v_dim] / l_safe[..., None]  # [B,t,H,v_dim]
    lse = jnp.where(l > 0, m[:, :, 0, :] + jnp.log(l_safe), -jnp.inf)
    return o.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("scale", "v_dim", "block_t"))
def sparse_attention_fwd_with_lse(q, kv, indices, *, scale: float, v_dim: int, block_t=None):
    """Like :func:`sparse_attention` but also returns lse [B,T,H] f32 (-inf for empty rows).

    block_t: process queries in chunks of this many tokens (lax.map) to bound the [B,t,K,D]
    gather; None = all at once. The math per query is identical either way.
    """
    _check_attn(q, kv, v_dim)
    b, t, h, d = q.shape
    assert indices.shape[:2] == (b, t) and indices.ndim == 3, (indices.shape, q.shape)
    if block_t is None or block_t >= t:
        return _sparse_block(q, kv, indices, scale, v_dim)
    nb = -(-t // block_t)
    pad = nb * block_t - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ip = jnp.pad(indices, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
    qc = qp.reshape(b, nb, block_t, h, d).swapaxes(0, 1)  # [nb,B,bt,H,D]
    ic = ip.reshape(b, nb, block_t, -1).swapaxes(0, 1)  # [nb,B,bt,K]
    o, lse = lax.map(lambda a: _sparse_block(a[0], kv, a[1], scale, v_dim), (qc, ic))
    o = o.swapaxes(0, 1).reshape(b, nb * block_t, h, v_dim)[:, :t]
    lse = lse.swapaxes(0, 1).reshape(b, nb * block_t, h)[:, :t]
    return o, lse


def sparse_attention(q, kv, indices, *, scale: float, v_dim: int, block_t=None) -> jax.Array:
    """Token-sparse MQA attention: o[b,t,h] = softmax_k(scale q[b,t,h].kv[b,idx_k]) kv[b,idx_k,:v_dim].

    q [B,T,H,D], kv [B,S,D] (shared by all heads; first v_dim channels = values),
    indices [B,T,K] int (entries < 0 are skipped) -> o [B,T,H,v_dim] in q's dtype.
    A row whose indices are all < 0 outputs 0. Differentiable (gather -> scatter-add by autodiff).
    """
    return sparse_attention_fwd_with_lse(q, kv, indices, scale=scale, v_dim=v_dim, block_t=block_t)[0]


def _dense_block(q, kv, valid, scale, v_dim):
    """q [B,t,H,D], kv [B,S,D], valid [B|1,t,S] -> o [B,t,H,v_dim] (empty rows -> 0)."""
    logits = jnp.einsum(
        "bthd,bsd->bths", q, kv, preferred_element_type=_F32, precision=_hi(q.dtype)
    ) * scale  # [B,t,H,S]
    vmask = valid[:, :, None, :]  # [B|1,t,1,S]
    logits = jnp.where(vmask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(vmask, jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bths,bsv->bthv", p, kv[..., :v_dim].astype(_F32),
                   precision=lax.Precision.HIGHEST)  # [B,t,H,V]
    return (o / jnp.where(l > 0, l, 1.0)).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "v_dim", "block_t"))
def dense_causal_attention(q, kv, *, scale: float, v_dim: int, q_offset=0, block_t=None):
    """Dense causal MQA attention (the baseline DSA is compared with); same conventions.

    Query t sees keys s <= t + q_offset (scalar or per-row [B]); rows with no key output 0.
    block_t: chunk queries (lax.map) to bound the [B,t,H,S] logits; None = all at once.
    Cost is the full T x S rectangle (masked, no block skipping): this is the simple XLA baseline.
    """
    _check_attn(q, kv, v_dim)
    b, t, h, d = q.shape
    s = kv.shape[1]
    off = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (b,))
    if block_t is None or block_t >= t:
        return _dense_block(q, kv, causal_valid_mask(b, t, s, off), scale, v_dim)
    nb = -(-t // block_t)
    pad = nb * block_t - t
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block_t, h, d).swapaxes(0, 1)
    starts = jnp.arange(nb, dtype=jnp.int32) * block_t

    def one(a):
        qb, st = a
        return _dense_block(qb, kv, causal_valid_mask(b, block_t, s, off + st), scale, v_dim)

    o = lax.map(one, (qc, starts))
    return o.swapaxes(0, 1).reshape(b, nb * block_t, h, v_dim)[:, :t]
