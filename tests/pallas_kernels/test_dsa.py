"""DSA: indexer, causal top-k selection, sparse MQA attention (reference, XLA, Pallas interpret).

Shapes come from pallas_kernels/dsa/arg_specs.py. Pallas kernels run in interpret mode on CPU
(the ``interpret`` fixture); both kernel flavours ("gpu" gather, "tpu" DMA) are exercised. On a
GPU/TPU the platform's own flavour runs compiled, with the heuristic tiles for the shape (the
small CFGS tiles below are interpret-only: e.g. attn_block_k=4 is below tl.dot's 16), keeping
only their bwd_chunk_t; the foreign flavour still runs interpreted.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend
from pallas_kernels.dsa import arg_specs, ops, reference
from pallas_kernels.dsa.config import DSABlockConfig, get_config

SPECS = arg_specs.TEST_SPECS
IDS = [s.name for s in SPECS]

# Small blocks so every kernel loops over several chunks / grid steps at test sizes.
GPU_CFG = DSABlockConfig(backend="gpu", idx_block_t=16, idx_block_s=16, attn_block_k=4, bwd_chunk_t=64)
# Backward in token chunks (lax.scan over chunks, scatter-add per chunk, last chunk padded).
GPU_CHUNKED = DSABlockConfig(backend="gpu", attn_block_k=4, bwd_chunk_t=5)
TPU_CFG = DSABlockConfig(backend="tpu", idx_block_t=8, idx_block_s=24, attn_block_k=8, bwd_chunk_t=64)
CFGS = {"gpu": GPU_CFG, "gpu_chunked": GPU_CHUNKED, "tpu": TPU_CFG}


def _kw(flavour, spec, interpret, topk=None):
    """ops kwargs running `flavour`: interpreted with its small CFGS tiles, or compiled on its
    own platform with heuristic tiles (same bwd_chunk_t)."""
    cfg = CFGS[flavour]
    if interpret or not backend.compiles_here(cfg.backend):
        return dict(config=cfg, interpret=True)
    tiles = get_config(t=spec.t, s=spec.s, topk=topk or spec.topk, heads=spec.h, dim=spec.d,
                       backend=cfg.backend, interpret=False)
    return dict(config=dataclasses.replace(tiles, bwd_chunk_t=cfg.bwd_chunk_t), interpret=False)


def _indices(spec, args, topk=None):
    scores = reference.indexer_scores(args["q_idx"], args["k_idx"], args["w"])
    return ops.select_topk(scores, topk or spec.topk, q_offset=spec.offset_array)


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _n_valid(spec):
    """Number of causally valid keys per (b, t): clip(t + off + 1, 0, S) -> [B, T]."""
    off = np.broadcast_to(np.asarray(spec.q_offset).reshape(-1), (spec.b,))
    return np.clip(np.arange(spec.t)[None, :] + off[:, None] + 1, 0, spec.s)


def _close(a, b, tol):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol)


# ------------------------------------------------------------------------------- indexer
def test_indexer_hand_made(interpret):
    # B=1, T=2, HI=2, D=2, S=3. Key rows e0, e1, (1,1); query heads chosen so ReLU clips some.
    q_idx = jnp.array([[[[1.0, 2.0], [-1.0, 0.5]],
                        [[0.0, -3.0], [2.0, 2.0]]]])  # [1,2,2,2]
    k_idx = jnp.array([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # [1,3,2]
    w = jnp.array([[[0.5, 2.0], [1.0, -1.0]]])  # [1,2,2]
    # t=0: head0 dots (1, 2, 3), head1 dots (-1, .5, -.5) -> .5*(1,2,3) + 2*(0,.5,0) = (.5, 2, 1.5)
    # t=1: head0 dots (0,-3,-3) -> relu 0; head1 dots (2,2,4) -> -1*(2,2,4)
    expected = np.array([[[0.5, 2.0, 1.5], [-2.0, -2.0, -4.0]]], np.float32)
    np.testing.assert_allclose(reference.indexer_scores(q_idx, k_idx, w), expected, atol=1e-6)
    hand = arg_specs.DSAArgSpec("hand", b=1, t=2, s=3, h=2, d=2, v_dim=2, topk=3, hi=2, di=2)
    got = ops.indexer_scores(q_idx, k_idx, w, impl="pallas", **_kw("gpu", hand, interpret))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert got.dtype == jnp.float32


# (spec, kernel flavour, dtype): both flavours, odd sizes, bf16 inputs.
_INDEXER_CASES = [("odd_chunk", "tpu", "float32"), ("ragged_rows", "gpu", "float32"),
                  ("prefill_rope", "gpu", "bfloat16")]


@pytest.mark.parametrize("name,flavour,dtype", _INDEXER_CASES,
                         ids=["-".join(c) for c in _INDEXER_CASES])
def test_indexer_pallas_matches_reference_fwd_and_grad(name, flavour, dtype, interpret):
    spec = arg_specs.TEST_SPECS_BY_NAME[name]
    spec = spec.with_dtype(dtype) if dtype != spec.dtype else spec
    a = arg_specs.make_args(spec)
    args = (a["q_idx"], a["k_idx"], a["w"])
    f32 = tuple(x.astype(jnp.float32) for x in args)  # the oracle runs on the same (rounded) values
    cot = _normal(5, (spec.b, spec.t, spec.s))
    pal = lambda *x: ops.indexer_scores(*x, impl="pallas", **_kw(flavour, spec, interpret))

    def fwd_bwd(fn, xs):  # one compiled program: interpret-mode compiles dominate test time
        return jax.jit(lambda *x: (lambda o, vjp: (o, *vjp(cot)))(*jax.vjp(fn, *x)))(*xs)

    got, *g_pal = fwd_bwd(pal, args)
    ref, *g_ref = fwd_bwd(reference.indexer_scores, f32)
    assert got.shape == (spec.b, spec.t, spec.s) and got.dtype == jnp.float32
    # bf16 products are exact in f32: only accumulation order differs from the oracle
    _close(got, ref, 1e-5 if dtype == "float32" else 1e-3)
    for x, y, inp in zip(g_pal, g_ref, args, strict=True):
        assert x.dtype == inp.dtype
        _close(x, y, 1e-5 if dtype == "float32" else 2e-2)


# ------------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_select_topk_causal_and_exact(spec):
    a = arg_specs.make_args(spec)
    scores = np.asarray(reference.indexer_scores(a["q_idx"], a["k_idx"], a["w"]))
    idx = np.asarray(ops.select_topk(jnp.asarray(scores), spec.topk, q_offset=spec.offset_array))
    assert idx.shape == (spec.b, spec.t, spec.topk) and idx.dtype == np.int32
    n_valid = _n_valid(spec)
    off = np.broadcast_to(np.asarray(spec.q_offset).reshape(-1), (spec.b,))
    saw_short_row = False
    for b, t in itertools.product(range(spec.b), range(spec.t)):
        row = idx[b, t]
        n = min(spec.topk, n_valid[b, t])
        saw_short_row |= n < spec.topk
        assert (row[:n] >= 0).all() and (row[n:] == -1).all(), (b, t, row)
        assert (row[:n] <= t + off[b]).all() and (row[:n] < spec.s).all(), (b, t, row)
        assert len(set(row[:n].tolist())) == n
        # the selected keys are the n best valid keys (compare score multisets: ties allowed)
        valid_scores = np.sort(scores[b, t, : n_valid[b, t]])[::-1][:n]
        np.testing.assert_allclose(np.sort(scores[b, t, row[:n]])[::-1], valid_scores)
    assert saw_short_row  # every spec has early rows with fewer valid keys than top-k


def test_select_topk_offsets_topk_gt_s_and_approx():
    rng = np.random.default_rng(0)
    scores = jnp.asarray(rng.normal(size=(3, 5, 9)), jnp.float32)
    offs = np.array([0, 4, -2], np.int32)
    per_row = np.asarray(ops.select_topk(scores, 4, q_offset=jnp.asarray(offs)))
    for b, o in enumerate(offs):  # per-row offsets == scalar offset applied to that row alone
        np.testing.assert_array_equal(per_row[b], np.asarray(ops.select_topk(scores, 4, q_offset=int(o)))[b])
    # negative offset: queries 0 and 1 of row 2 see no key at all
    assert (per_row[2, :2] == -1).all() and (per_row[2, 2, 0] == 0) and (per_row[2, 2, 1:] == -1).all()
    # topk > S pads with -1
    big = np.asarray(ops.select_topk(scores, 12, q_offset=20))
    assert big.shape == (3, 5, 12) and (big[..., 9:] == -1).all()
    np.testing.assert_array_equal(np.sort(big[..., :9], -1), np.broadcast_to(np.arange(9), (3, 5, 9)))
    # a traced (jit) per-row offset works the same
    jitted = jax.jit(lambda s, o: ops.select_topk(s, 4, q_offset=o))(scores, jnp.asarray(offs))
    np.testing.assert_array_equal(np.asarray(jitted), per_row)
    # approx_max_k path keeps validity exact (and is exact on CPU)
    approx = np.asarray(ops.select_topk(scores, 4, q_offset=jnp.asarray(offs), approx=True))
    np.testing.assert_array_equal(np.sort(approx, -1), np.sort(per_row, -1))


# ------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("name,impl", [("no_rope_topk_gt_s", "xla"), ("odd_chunk", "xla"),
                                       ("ragged_rows", "xla"), ("ragged_rows", "pallas")])
def test_sparse_equals_dense_when_s_le_topk(name, impl, interpret):
    spec = arg_specs.TEST_SPECS_BY_NAME[name]
    a = arg_specs.make_args(spec)
    topk = max(spec.topk, spec.s)  # every valid key selected
    idx = _indices(spec, a, topk)
    pal_kw = _kw("gpu", spec, interpret, topk) if impl == "pallas" else {}
    o = ops.sparse_attention(a["q"], a["kv"], idx, scale=spec.scale, v_dim=spec.v_dim, impl=impl,
                             **pal_kw)
    dense = ops.dense_causal_attention(a["q"], a["kv"], scale=spec.scale, v_dim=spec.v_dim,
                                       q_offset=spec.offset_array)
    assert o.shape == (spec.b, spec.t, spec.h, spec.v_dim) and o.dtype == a["q"].dtype
    _close(o, dense, 1e-5)


def test_dense_reference_matches_numpy_and_chunking():
    spec = arg_specs.TEST_SPECS_BY_NAME["ragged_rows"]
    a = arg_specs.make_args(spec)
    idx = _indices(spec, a)
    kw = dict(scale=spec.scale, v_dim=spec.v_dim)
    # float64 brute force, with a negative offset on row 0 so its first queries see no key
    offs = np.array([-3, 30])
    q, kv = np.asarray(a["q"], np.float64), np.asarray(a["kv"], np.float64)
    want = np.zeros((spec.b, spec.t, spec.h, spec.v_dim))
    for b, t in itertools.product(range(spec.b), range(spec.t)):
        n = int(np.clip(t + offs[b] + 1, 0, spec.s))
        if n:
            lg = q[b, t] @ kv[b, :n].T * spec.scale  # [H, n]
            p = np.exp(lg - lg.max(-1, keepdims=True))
            want[b, t] = (p / p.sum(-1, keepdims=True)) @ kv[b, :n, : spec.v_dim]
    got = ops.dense_causal_attention(a["q"], a["kv"], q_offset=jnp.asarray(offs), **kw)
    _close(got, want, 1e-5)
    assert np.all(np.asarray(got)[0, :3] == 0.0)
    _close(reference.sparse_attention(a["q"], a["kv"], idx, block_t=3, **kw),
           reference.sparse_attention(a["q"], a["kv"], idx, **kw), 1e-6)
    _close(reference.dense_causal_attention(a["q"], a["kv"], q_offset=spec.offset_array, block_t=3, **kw),
           reference.dense_causal_attention(a["q"], a["kv"], q_offset=spec.offset_array, **kw), 1e-6)


def _fwd_and_grads(fn, q, kv, do):
    """(o, dq, dkv) for loss = sum(o * do), in one compiled program (interpret compiles dominate)."""

    @jax.jit
    def run(q, kv, do):
        o, vjp = jax.vjp(fn, q, kv)
        return (o, *vjp(do.astype(o.dtype)))

    return run(q, kv, do)


# Every spec on the gather ("gpu") flavour; the DMA ("tpu") flavour on one (interpret is slow).
# (prefill_rope runs on the gather flavour in bf16 below.)
_FWD_BWD_CASES = [
    ("odd_chunk", "gpu_chunked"), ("no_rope_topk_gt_s", "gpu"), ("ragged_rows", "gpu"),
    ("ragged_rows", "tpu")]


@pytest.mark.parametrize("name,flavour", _FWD_BWD_CASES, ids=[f"{n}-{f}" for n, f in _FWD_BWD_CASES])
def test_sparse_pallas_fwd_and_grads_match_reference(name, flavour, interpret):
    spec = arg_specs.TEST_SPECS_BY_NAME[name]
    a = arg_specs.make_args(spec)
    idx = _indices(spec, a)
    idx = idx.at[0, 1].set(-1)  # one row with no valid index at all: o = 0, zero gradient
    assert (np.asarray(idx) == -1).any(axis=-1).any()  # rows with fewer valid keys than top-k
    do = _normal(7, (spec.b, spec.t, spec.h, spec.v_dim))
    kw = dict(scale=spec.scale, v_dim=spec.v_dim)
    ref = lambda q, kv: reference.sparse_attention(q, kv, idx, **kw)
    pal = lambda q, kv: ops.sparse_attention(q, kv, idx, impl="pallas",
                                             **_kw(flavour, spec, interpret), **kw)
    o_ref, *g_ref = _fwd_and_grads(ref, a["q"], a["kv"], do)
    o_pal, *g_pal = _fwd_and_grads(pal, a["q"], a["kv"], do)
    _close(o_pal, o_ref, 1e-5)
    assert np.all(np.asarray(o_pal)[0, 1] == 0.0)
    for what, x, y in zip(("dq", "dkv"), g_pal, g_ref, strict=True):
        assert np.isfinite(np.asarray(x)).all(), what
        _close(x, y, 1e-5)
    assert np.all(np.asarray(g_pal[0])[0, 1] == 0.0)


@pytest.mark.parametrize("name,flavour", [("prefill_rope", "gpu"), ("odd_chunk", "tpu")])
def test_sparse_pallas_bf16(name, flavour, interpret):
    spec = arg_specs.TEST_SPECS_BY_NAME[name].with_dtype("bfloat16")
    a = arg_specs.make_args(spec)
    idx = _indices(spec, a)
    do = _normal(3, (spec.b, spec.t, spec.h, spec.v_dim))
    kw = dict(scale=spec.scale, v_dim=spec.v_dim)
    q32, kv32 = a["q"].astype(jnp.float32), a["kv"].astype(jnp.float32)
    ref = lambda q, kv: reference.sparse_attention(q, kv, idx, **kw)
    pal = lambda q, kv: ops.sparse_attention(q, kv, idx, impl="pallas",
                                             **_kw(flavour, spec, interpret), **kw)
    o_ref, *g_ref = _fwd_and_grads(ref, q32, kv32, do)
    o, *g_pal = _fwd_and_grads(pal, a["q"], a["kv"], do)
    assert o.dtype == jnp.bfloat16
    _close(o, o_ref, 2e-2)
    for x, y in zip(g_pal, g_ref, strict=True):
        assert x.dtype == jnp.bfloat16
        _close(x, y, 5e-2)


def test_sparse_pallas_lse_and_its_gradient(interpret):
    spec = arg_specs.TEST_SPECS_BY_NAME["odd_chunk"]
    a = arg_specs.make_args(spec)
    idx = _indices(spec, a)
    kw = dict(scale=spec.scale, v_dim=spec.v_dim)

    def loss(impl):
        def f(q, kv):
            pal_kw = _kw("gpu", spec, interpret) if impl == "pallas" else {}
            o, lse = ops.sparse_attention_with_lse(q, kv, idx, impl=impl, **pal_kw, **kw)
            return jnp.sum(o * o) + jnp.sum(jnp.tanh(lse))
        return jax.jit(jax.value_and_grad(f, (0, 1)))

    (l_pal, g_pal), (l_ref, g_ref) = loss("pallas")(a["q"], a["kv"]), loss("xla")(a["q"], a["kv"])
    _close(l_pal, l_ref, 1e-5)
    for x, y in zip(g_pal, g_ref, strict=True):
        _close(x, y, 1e-5)


# ------------------------------------------------------------------------------- config / api
def test_config_validation_and_heuristics():
    with pytest.raises(ValueError):
        DSABlockConfig(backend="gpu", attn_block_k=24)
    with pytest.raises(ValueError):
        DSABlockConfig(backend="cuda")
    DSABlockConfig(backend="tpu", attn_block_k=24)  # no power-of-two rule on Mosaic
    cfg = get_config(t=4096, s=4096, topk=2048, heads=16, dim=576)
    assert cfg.attn_block_k <= 2048 and cfg.bwd_chunk_t * 2048 * 576 * 4 <= 256 << 20
    small = get_config(t=5, s=7, topk=3, interpret=True)
    assert small.idx_block_t <= 8 and small.idx_block_s <= 16 and small.attn_block_k == 16
    with pytest.raises(ValueError):
        ops.sparse_attention(jnp.zeros((1, 1, 1, 4)), jnp.zeros((1, 1, 4)),
                             jnp.zeros((1, 1, 1), jnp.int32), scale=1.0, v_dim=4, impl="cuda")
