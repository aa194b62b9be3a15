"""Public entry points for DeepSeek Sparse Attention (DSA). See DESIGN.md section 3.

  indexer_scores(q_idx, k_idx, w)                      -> scores [B,T,S] f32
  select_topk(scores, topk, *, q_offset=0, approx=False) -> indices [B,T,topk] int32 (-1 = none)
  sparse_attention(q, kv, indices, *, scale, v_dim)    -> o [B,T,H,v_dim] (q's dtype)
  dense_causal_attention(q, kv, *, scale, v_dim, q_offset=0) -> o [B,T,H,v_dim]

Every op takes ``impl``; ``indexer_scores`` and ``sparse_attention`` resolve it through their
dispatch tables (``INDEXER_DISPATCH``, ``SPARSE_DISPATCH``; ``pallas_kernels.dispatch``):
  "auto"   -> the first of "pallas", "xla" that can take the call: "pallas" on GPU/TPU for f32 /
              bf16 inputs, "xla" otherwise (CPU: always); the choice is logged once;
  "xla"    -> the pure-jnp reference (``reference.py``), query-chunked to bound memory;
  "pallas" -> the Pallas kernels (``pallas_indexer.py``, ``pallas_attention.py``); a call they
              cannot take (other dtypes; sparse attention: v_dim not in (0, D]) raises
              ``dispatch.UnsupportedImpl`` before tracing.
The Pallas ops also take ``kernel`` and ``interpret`` (the rule of ``pallas_kernels.backend``):
``kernel`` "gpu" (Triton gather flavour) or "tpu" (Mosaic DMA flavour), None -> the running
platform's (the "gpu" flavour when interpreting on CPU), or ``config.backend`` when a config is
given; ``interpret=None`` -> interpret unless the platform compiles that flavour.
``impl="pallas", kernel="tpu", interpret=False`` forces the compiled Mosaic kernels (on a CPU
host: lowering only, e.g. under ``jax.export`` for "tpu").
A compiled Pallas call on a device mesh (model.sharding.use_mesh) runs under shard_map, each
device on its batch rows (and, for sparse attention, heads): ``pallas_kernels.partition``.
``select_topk`` and ``dense_causal_attention`` have no Pallas kernel (XLA's top_k / a dense
baseline); they accept ``impl`` for a uniform call signature and always run XLA.

All paths are differentiable: sparse_attention's Pallas path has a custom_vjp (dq by a Pallas
kernel, dkv by a JAX scatter-add of per-token contributions the kernel emits). indexer_scores'
Pallas path has a custom_vjp whose backward is the XLA formula (the indexer is trained through
its own KL loss in the dense warm-up; in the sparse stage its input is detached anyway).

Semantics (all impls): f32 logits/softmax; a query row with no valid key outputs 0 with zero
gradients; entries of ``indices`` < 0 are skipped; q_offset may be an int array [B].
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels import dispatch, partition
from pallas_kernels.dsa import reference

__all__ = [
    "indexer_scores",
    "select_topk",
    "sparse_attention",
    "sparse_attention_with_lse",
    "dense_causal_attention",
    "resolve_impl",
]

_IMPLS = ("auto", "xla", "pallas")


def _v_dim_fits(*, v_dim=None, D=None, **_) -> str | None:
    if v_dim is None or D is None or 0 < v_dim <= D:
        return None
    return f"v_dim={v_dim} is not in (0, D={D}] (the values are the first v_dim kv channels)"


def _table(op: str, *extra) -> dispatch.OpTable:
    # The kernels pad every shape to their tiles (any B, T, S, H, K, D) and are written and
    # tested for f32 and bf16 inputs (pallas_indexer.py, pallas_attention.py).
    return dispatch.OpTable(op, (
        dispatch.Impl("pallas", cannot=(dispatch.dtypes("float32", "bfloat16"), *extra),
                      auto_skips=(dispatch.pallas_compiles_here,)),
        dispatch.Impl("xla")))


INDEXER_DISPATCH = _table("dsa.indexer_scores")
SPARSE_DISPATCH = _table("dsa.sparse_attention", _v_dim_fits)
assert set(_IMPLS) == set(INDEXER_DISPATCH.names()) == set(SPARSE_DISPATCH.names())

# Query-chunk budgets for the XLA path: elements of the [B,t,K,D] gather / [B,t,H,S] logits.
_XLA_GATHER_BUDGET = 1 << 24
_XLA_LOGITS_BUDGET = 1 << 24


def resolve_impl(impl: str, table: dispatch.OpTable = SPARSE_DISPATCH, **facts) -> str:
    """The implementation `table`'s op runs for these facts (dtype, v_dim, D): 'auto' -> 'xla'
    on CPU, 'pallas' on GPU/TPU where the kernels take the call; an explicit impl the call
    cannot take raises `dispatch.UnsupportedImpl`."""
    return table.resolve(impl, **facts)


def _check_name(impl: str) -> None:
    """Ops without a Pallas kernel accept every impl name (a uniform signature) and run XLA."""
    SPARSE_DISPATCH.canonical(impl)


def _kernel_args(kernel, interpret, config):
    """-> (kernel flavour, interpret): config.backend wins when a config is given."""
    if config is not None:
        if kernel is not None and _backend.normalize_kernel(kernel) != config.backend:
            raise ValueError(f"kernel={kernel!r} contradicts config.backend={config.backend!r}")
        kernel = config.backend
    kernel, interpret = _backend.resolve(kernel, interpret, cpu_default="gpu")
    return kernel, interpret


def _chunk(t: int, per_token: int, budget: int):
    """Largest query chunk (power of two) keeping t_chunk * per_token <= budget; None = no chunk."""
    if t * per_token <= budget:
        return None
    c = 1
    while c * 2 * per_token <= budget and c * 2 < t:
        c *= 2
    return c


def indexer_scores(q_idx, k_idx, w, *, impl: str = "auto", interpret=None, config=None,
                   kernel=None):
    """Lightning-indexer scores: q_idx [B,T,HI,D], k_idx [B,S,D], w [B,T,HI] -> f32 [B,T,S].

    scores[b,t,s] = sum_j w[b,t,j] * relu(q_idx[b,t,j] . k_idx[b,s]). Not causally masked
    (select_topk applies the mask). config: a ``DSABlockConfig`` for the Pallas path;
    kernel / interpret: see the module docstring.
    """
    if resolve_impl(impl, INDEXER_DISPATCH, dtype=q_idx.dtype) == "xla":
        return reference.indexer_scores(q_idx, k_idx, w)
    from pallas_kernels.dsa import pallas_indexer

    kernel, interpret = _kernel_args(kernel, interpret, config)

    def run(q_idx, k_idx, w):
        return pallas_indexer.indexer_scores(q_idx, k_idx, w, interpret=interpret,
                                             config=config, kernel=kernel)

    if interpret:
        return run(q_idx, k_idx, w)
    # compiled, on a mesh: batch rows per device (the scores sum the heads: heads stay whole)
    return partition.per_device(run, (q_idx, k_idx, w), (("batch", None, None, None),
                                                         ("batch", None, None),
                                                         ("batch", None, None)),
                                ("batch", None, None))


def select_topk(scores, topk: int, *, q_offset=0, approx: bool = False, impl: str = "auto"):
    """Causal top-k -> int32 [B,T,topk]; -1 where fewer than topk keys are valid (or topk > S).

    Key s is valid for query t iff s <= t + q_offset; q_offset is an int, a scalar array, or an
    int array [B] (rows of different lengths in decode / chunked prefill). Slots are ordered by
    descending score, -1 slots last. approx=True uses lax.approx_max_k (validity stays exact).
    """
    _check_name(impl)  # validate only: XLA top_k on every backend
    return reference.select_topk(scores, topk, q_offset=q_offset, approx=approx)


def sparse_attention(q, kv, indices, *, scale: float, v_dim: int, impl: str = "auto",
                     interpret=None, config=None, kernel=None):
    """Token-sparse MQA attention (absorbed MLA): every head of token t attends to kv[b, indices[b,t]].

    q [B,T,H,D], kv [B,S,D] (shared across heads, values = kv[..., :v_dim]), indices [B,T,K]
    int32 with -1 = skip -> o [B,T,H,v_dim] in q's dtype. f32 softmax. A row with no index >= 0
    outputs 0 (and passes zero gradient). Indices must be < S (not checked on device).
    """
    return sparse_attention_with_lse(q, kv, indices, scale=scale, v_dim=v_dim, impl=impl,
                                      interpret=interpret, config=config, kernel=kernel)[0]


def sparse_attention_with_lse(q, kv, indices, *, scale: float, v_dim: int, impl: str = "auto",
                              interpret=None, config=None, kernel=None):
    """sparse_attention plus the per-head log-sum-exp lse [B,T,H] f32 (-inf for empty rows)."""
    indices = indices.astype(jnp.int32)
    if resolve_impl(impl, SPARSE_DISPATCH, dtype=q.dtype, v_dim=int(v_dim),
                    D=kv.shape[-1]) == "xla":
        b, t, k = indices.shape
        block_t = _chunk(t, b * k * kv.shape[-1], _XLA_GATHER_BUDGET)
        return reference.sparse_attention_fwd_with_lse(
            q, kv, indices, scale=scale, v_dim=v_dim, block_t=block_t)
    from pallas_kernels.dsa import pallas_attention

    kernel, interpret = _kernel_args(kernel, interpret, config)

    def run(q, kv, indices):
        return pallas_attention.sparse_attention(
            q, kv, indices, scale=float(scale), v_dim=int(v_dim), interpret=interpret,
            config=config, kernel=kernel)

    if interpret:
        return run(q, kv, indices)
    # compiled, on a mesh: batch rows and heads per device (pallas_kernels.partition)
    bthd = ("batch", None, "act_heads", None)
    return partition.per_device(run, (q, kv, indices),
                                (bthd, ("batch", None, None), ("batch", None, None)),
                                (bthd, ("batch", None, "act_heads")))


def dense_causal_attention(q, kv, *, scale: float, v_dim: int, q_offset=0, impl: str = "auto"):
    """Dense causal MQA attention, same layout/conventions as sparse_attention (baseline/tests).

    Query t sees keys s <= t + q_offset (int or per-row int array [B]). XLA on every backend.
    """
    _check_name(impl)
    b, t, h, _ = q.shape
    block_t = _chunk(t, b * h * kv.shape[1], _XLA_LOGITS_BUDGET)
    return reference.dense_causal_attention(q, kv, scale=scale, v_dim=v_dim, q_offset=q_offset,
                                            block_t=block_t)
