"""The DSA layer's training forward picks among equal computations by length
(model/layers/dsa.py: sparse_path): dense causal attention when top-k covers every causal key,
masked-dense scores (causal & the top-k selection) while that is cheaper than the gather, the
token-sparse gather otherwise.

Covered: the rule's choices; masked_dense_attention equals sparse_attention on the same indices
(values and gradients), dense equals sparse when S <= top-k; the whole layer (output, indexer KL
and parameter gradients) on each path equals the token-sparse path forced by monkeypatching the
rule, at lengths below top-k, between top-k and the masked limit, and past it; with a decode
cache, the same by the cache's length, and the run-time dense choice while every row holds at
most top-k keys (model/layers/dsa.py: RUNTIME_DENSE_DECODE) equal to selecting at every step.
The indexer KL in query chunks (long training sequences) equals the one-pass KL (values and
gradients). Not covered: the timings (benchmarks/dsa.py measures the crossover).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers import dsa
from pallas_kernels.dsa import ops as dsa_ops

K = 8  # top-k of the layer tests


def test_rule_by_length():
    f32 = jnp.float32
    assert dsa.sparse_path(K, K, "auto", f32, 16, 24) == "dense"
    assert dsa.sparse_path(3, K, "auto", f32, 16, 24) == "dense"
    assert dsa.sparse_path(K + 1, K, "auto", f32, 16, 24) == "masked"
    assert dsa.sparse_path(dsa.MASKED_DENSE_MAX_RATIO * K, K, "auto", f32, 16, 24) == "masked"
    assert dsa.sparse_path(dsa.MASKED_DENSE_MAX_RATIO * K + 1, K, "auto", f32, 16, 24) == "sparse"
    big = dsa.MASKED_DENSE_MAX_SCORES + 1  # the scores would not fit: the gather's chunks do
    assert dsa.sparse_path(2 * K, K, "auto", f32, 16, 24, n_scores=big) == "sparse"


def test_masked_dense_equals_sparse_gather():
    B, S, H, D, V, k = 2, 20, 2, 12, 8, 6
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, S, H, D))
    kv = jax.random.normal(ks[1], (B, S, D))
    scores = jax.random.normal(ks[2], (B, S, S))
    g = jax.random.normal(ks[3], (B, S, H, V))
    idx = dsa_ops.select_topk(scores, k)
    mask = dsa.causal_mask(S, S, jnp.zeros((B,), jnp.int32)) & dsa.selected_key_mask(idx, S)
    assert int(mask.sum()) == int((idx >= 0).sum())  # the mask holds exactly the selection

    def sparse(q, kv):
        return jnp.sum(dsa_ops.sparse_attention(q, kv, idx, scale=0.3, v_dim=V) * g)

    def masked(q, kv):
        return jnp.sum(dsa.masked_dense_attention(q, kv, mask, 0.3, V) * g)

    assert float(jnp.abs(dsa.masked_dense_attention(q, kv, mask, 0.3, V)).mean()) > 0.1
    for a, b in zip(jax.jit(jax.value_and_grad(masked, (0, 1)))(q, kv),
                    jax.jit(jax.value_and_grad(sparse, (0, 1)))(q, kv)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    # S <= top-k: the selection is every causal key, so dense causal attention is the same
    idx_all = dsa_ops.select_topk(scores, S)
    np.testing.assert_allclose(
        np.asarray(dsa_ops.dense_causal_attention(q, kv, scale=0.3, v_dim=V)),
        np.asarray(dsa_ops.sparse_attention(q, kv, idx_all, scale=0.3, v_dim=V)),
        rtol=1e-5, atol=1e-6)


def _layer():
    cfg = dsa.DSAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=8,
                        index_rope_dim=4, index_topk=K, indexer_loss_weight=1.0)
    return dsa.DSALayer(cfg=cfg, d_model=24)


@pytest.mark.parametrize("T,path", [(6, "dense"), (3 * K, "masked"),
                                    (dsa.MASKED_DENSE_MAX_RATIO * K + 3, "sparse")])
def test_layer_paths_equal_the_sparse_gather(T, path, monkeypatch):
    layer = _layer()
    B = 2
    x = jax.random.normal(jax.random.key(1), (B, T, 24))
    valid = jnp.arange(T)[None] < jnp.array([[T], [T - 2]])
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = layer.init(jax.random.key(0), x, valid=valid, positions=pos)
    assert dsa.sparse_path(T, K, "auto", jnp.float32, 16, 24) == path

    def loss(p):
        out, _, aux = layer.apply(p, x, valid=valid, positions=pos)
        return jnp.sum(out * jnp.cos(jnp.arange(24.0))) + aux["indexer_kl"], (out, aux)

    (l_rule, (o_rule, a_rule)), g_rule = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    monkeypatch.setattr(dsa, "sparse_path", lambda *a, **k: "sparse")
    (l_sp, (o_sp, a_sp)), g_sp = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(o_rule), np.asarray(o_sp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(a_rule["indexer_kl"]), float(a_sp["indexer_kl"]),
                               rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g_rule), jax.tree.leaves(g_sp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_query_chunked_indexer_kl_equals_one_pass(stage):
    """dsa.indexer_kl_chunk = 8 at T = 21 (the last chunk padded): the indexer KL in query
    chunks, each recomputed in the backward (dsa.indexer_kl_chunked), on the dense stage
    (every causal key) and the sparse stage (the top-k selection, T past top-k): the layer's
    output, its indexer KL and every parameter gradient equal the one-pass KL's."""
    import dataclasses

    cfg = dataclasses.replace(_layer().cfg, indexer_stage=stage)
    layers = [dsa.DSALayer(cfg=dataclasses.replace(cfg, indexer_kl_chunk=n), d_model=24)
              for n in (0, 8)]
    B, T = 2, 21
    x = jax.random.normal(jax.random.key(1), (B, T, 24))
    valid = jnp.arange(T)[None] < jnp.array([[T], [T - 4]])
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = layers[0].init(jax.random.key(0), x, valid=valid, positions=pos)

    def step(layer):
        def loss(p):
            out, _, aux = layer.apply(p, x, valid=valid, positions=pos)
            return jnp.sum(out * jnp.cos(jnp.arange(24.0))) + aux["indexer_kl"], (out, aux)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l1, (o1, a1)), g1 = step(layers[0])
    (l2, (o2, a2)), g2 = step(layers[1])
    assert float(a1["indexer_kl"]) > 0
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_allclose(float(a2["indexer_kl"]), float(a1["indexer_kl"]), rtol=1e-5)
    idx_grads = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
        idx_grads += "idx_" in jax.tree_util.keystr(path) and bool(np.any(np.asarray(a) != 0))
    assert idx_grads >= 3  # the indexer's q, k and weight projections get the KL's gradient


def _cached_decode(layer, params, x, lengths, P, S, n):
    """Prefill of each row's prompt (lengths [B], the prompts padded to P = max(lengths)) into a
    cache of S rows, then n one-token steps: row b's token j sits at position lengths[b] + j.
    Returns the steps' outputs [B,n,D]."""
    B = x.shape[0]
    cache = dsa.DSALayer.init_cache(layer.cfg, B, S, jnp.float32)
    valid = jnp.arange(P)[None] < lengths[:, None]
    _, cache, _ = layer.apply(params, x[:, :P], valid=valid,
                              positions=jnp.broadcast_to(jnp.arange(P), (B, P)),
                              cache=cache, offset=jnp.zeros((B,), jnp.int32))
    outs = []
    for j in range(n):
        xj = jnp.take_along_axis(x, (lengths + j)[:, None, None], axis=1)  # [B,1,D]
        o, cache, _ = layer.apply(params, xj, valid=jnp.ones((B, 1), bool),
                                  positions=(lengths + j)[:, None], cache=cache,
                                  offset=lengths + j)
        outs.append(o)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("S,path", [(6, "dense"), (3 * K, "masked"),
                                    (dsa.MASKED_DENSE_MAX_RATIO * K + 3, "sparse")])
def test_cached_paths_equal_the_sparse_gather(S, path, monkeypatch):
    """With a decode cache of S rows the rule picks by S too: a prefill of the rows' prompts
    (lengths S-3 and S-5) then two one-token steps give the same outputs as the token-sparse
    gather forced by monkeypatching, and as the no-cache forward over the whole sequences."""
    layer = _layer()
    B, P = 2, S - 3
    x = jax.random.normal(jax.random.key(1), (B, P + 2, 24))
    lengths = jnp.array([P, P - 2])
    assert dsa.sparse_path(S, K, "auto", jnp.float32, 16, 24) == path
    params = layer.init(jax.random.key(0), x[:, :P], valid=jnp.ones((B, P), bool),
                        positions=jnp.broadcast_to(jnp.arange(P), (B, P)))

    def run(params):  # [B,2,24]
        return _cached_decode(layer, params, x, lengths, P, S, 2)

    taken, rule = [], dsa.sparse_path
    monkeypatch.setattr(dsa, "sparse_path", lambda *a, **k: taken.append(rule(*a, **k)) or taken[-1])
    o_rule = jax.jit(lambda p: run(p))(params)  # a fresh function: traced after each patch
    assert set(taken) == {path}, taken  # the prefill and both steps took the rule's path
    full, _, _ = layer.apply(params, x, valid=jnp.ones((B, P + 2), bool),
                             positions=jnp.broadcast_to(jnp.arange(P + 2), (B, P + 2)))
    want = jnp.stack([full[b, int(n):int(n) + 2] for b, n in enumerate(lengths)])  # [B,2,24]
    monkeypatch.setattr(dsa, "sparse_path", lambda *a, **k: "sparse")
    o_sp = jax.jit(lambda p: run(p))(params)
    np.testing.assert_allclose(np.asarray(o_rule), np.asarray(o_sp), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o_rule), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_decode_takes_the_dense_path_while_every_row_fits_topk(monkeypatch):
    """A cache longer than top-k (S = 3K: the masked path) decoded from short prompts: while
    every row holds at most top-k causal keys the layer attends densely at run time (no indexer,
    no selection), later steps select; the outputs equal the selection path run at every step
    and the no-cache forward. The dense branch is checked to be taken by making the selection
    path's output wrong at the steps that fit (a selection that ignored the fit would show)."""
    layer = _layer()
    B, P, S, n = 2, 4, 3 * K, 6  # prompts of 4 and 2 tokens, then 6 steps: rows cross K
    x = jax.random.normal(jax.random.key(1), (B, P + n, 24))
    lengths = jnp.array([P, P - 2])
    params = layer.init(jax.random.key(0), x[:, :P], valid=jnp.ones((B, P), bool),
                        positions=jnp.broadcast_to(jnp.arange(P), (B, P)))

    def run(params):  # [B,n,24]
        return _cached_decode(layer, params, x, lengths, P, S, n)

    assert dsa.sparse_path(S, K, "auto", jnp.float32, 16, 24) == "masked"
    o_rule = jax.jit(lambda p: run(p))(params)  # fresh functions: traced after each patch
    full, _, _ = layer.apply(params, x, valid=jnp.ones((B, P + n), bool),
                             positions=jnp.broadcast_to(jnp.arange(P + n), (B, P + n)))
    want = jnp.stack([full[b, int(m):int(m) + n] for b, m in enumerate(lengths)])
    np.testing.assert_allclose(np.asarray(o_rule), np.asarray(want), rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(dsa, "RUNTIME_DENSE_DECODE", False)
    o_sel = jax.jit(lambda p: run(p))(params)
    np.testing.assert_allclose(np.asarray(o_rule), np.asarray(o_sel), rtol=1e-5, atol=1e-6)
    # the attack: a selection path that is wrong everywhere changes only the steps past K
    monkeypatch.setattr(dsa, "RUNTIME_DENSE_DECODE", True)
    monkeypatch.setattr(dsa, "masked_dense_attention", lambda q, *a: jnp.zeros(
        q.shape[:3] + (a[-1],), q.dtype))
    o_bad = np.asarray(jax.jit(lambda p: run(p))(params))
    fits = np.asarray(jnp.max(lengths) + jnp.arange(n) + 1 <= K)  # step j: keys max(len)+j+1
    assert fits.any() and not fits.all()
    np.testing.assert_allclose(o_bad[:, fits], np.asarray(o_rule)[:, fits], rtol=1e-6, atol=1e-7)
    assert np.abs(o_bad[:, ~fits] - np.asarray(o_rule)[:, ~fits]).max() > 1e-3
