"""Chunked prefill (`Model.prefill(..., chunk=N)`, `SamplingConfig.prefill_chunk`) and the live
decode-state bytes against model/plan.py.

Covered: chunked == one-shot prefill in f32 (logits, hidden, every cache leaf up to each row's
length, and the next decode step) on the test model (KDA + sparse DSA with its indexer, MoE, a
right-padded batch, a remainder chunk) and on a dense-attention variant (DSA's dense MLA path,
NoPE, dense FFN); validation of the chunk size; the sampler's greedy output with and without
chunks; live cache bytes per sequence (nbytes of the prefilled cache pytree) equal to
`model.plan.decode_state_bytes` and to the closed form per layer kind, for the all-KDA,
all-DSA, hybrid and dense layouts. Not covered: capacity-dispatch MoE (drops differ per call,
see Model.prefill), long prompts (scripts/longctx.py measures 16K-token memory and speed).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ModelConfig
from model.plan import decode_state_bytes
from model.transformer import Model
from rl.sampler import Sampler, SamplingConfig

B, T, S, CHUNK = 2, 40, 48, 16  # 2 full chunks + a remainder of 8; top-k 16 < 40 keys
LENGTHS = (40, 19)  # the second row ends inside the second chunk


def _cfg(**over) -> ModelConfig:
    return models.build("test", **over)


VARIANTS = {
    # KDA + sparse DSA (indexer top-k), MoE (dropless), MTP: the test preset
    "hybrid_sparse_moe": {},
    # dense MLA attention (the DSA layer's dense path), NoPE, dense FFN, DSA first
    "dense_attention": {"layer_pattern": "DK", "dsa.indexer_stage": "dense_warmup",
                        "dsa.positions": "nope", "moe.num_experts": 0, "mtp.depth": 0},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def prefilled(request):
    """(model, variables, one-shot result, chunked result, decode logits of both); each result
    is (logits [B,T,V], cache, hidden [B,T,D])."""
    model = Model(_cfg(**VARIANTS[request.param]))
    variables = model.init(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (B, T), 3, 250)
    lengths = jnp.array(LENGTHS, jnp.int32)
    tokens = jnp.where(jnp.arange(T)[None] < lengths[:, None], tokens, 0)

    @jax.jit
    def run(variables, tokens, lengths):
        outs = []
        for chunk in (0, CHUNK):
            lg, cache, hid = model.prefill(variables, tokens, lengths, model.init_cache(B, S),
                                           chunk=chunk)
            nxt, _, _ = model.decode_step(variables, jnp.array([7, 9]), cache)
            outs.append(((lg, cache, hid), nxt))
        return outs

    (one, d_one), (chk, d_chk) = run(variables, tokens, lengths)
    return model, one, chk, d_one, d_chk


def test_chunked_prefill_equals_one_shot(prefilled):
    model, (lg1, c1, h1), (lg2, c2, h2), d1, d2 = prefilled
    tol = dict(rtol=2e-5, atol=2e-5)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(lg2[b, :n], lg1[b, :n], **tol)
        np.testing.assert_allclose(h2[b, :n], h1[b, :n], **tol)
    assert list(np.asarray(c2["lengths"])) == list(LENGTHS)
    assert list(np.asarray(c1["lengths"])) == list(LENGTHS)
    for kind, a, c in zip(model.cfg.layer_kinds(), c1["layers"], c2["layers"]):
        if kind == "K":  # O(1) state: compare whole
            np.testing.assert_allclose(c["state"], a["state"], **tol)
            np.testing.assert_allclose(c["conv"], a["conv"], **tol)
        else:  # rows at and past a row's length are scratch until decoding writes them
            for key in ("kv", "k_idx"):
                for b, n in enumerate(LENGTHS):
                    np.testing.assert_allclose(c[key][b, :n], a[key][b, :n], **tol)
    # the next token attends over both caches alike (scratch rows never read)
    np.testing.assert_allclose(d2, d1, **tol)
    # the chunked path is a different computation, not the one-shot program: differences exist
    # only at float rounding level, and the compare above is not vacuous (logits vary by row)
    assert float(jnp.std(lg1[0, :LENGTHS[0]])) > 1e-3


def _closed_form_bytes(cfg: ModelConfig, seq: int) -> int:
    """Per-sequence decode state written out per layer kind (the formula plan.py's numbers must
    agree with): KDA = f32 state H*K*V + conv window (W-1)*H*(2K+V) in the activation dtype;
    DSA = seq * (kv_lora_rank + qk_rope_head_dim + index_head_dim) in the activation dtype;
    plus the int32 length counter."""
    act = jnp.dtype(cfg.dtype).itemsize
    k, d = cfg.kda, cfg.dsa
    per = {"K": k.num_heads * k.k_dim * k.v_dim * 4
           + (k.conv_size - 1) * k.num_heads * (2 * k.k_dim + k.v_dim) * act,
           "D": seq * (d.kv_lora_rank + d.qk_rope_head_dim + d.index_head_dim) * act}
    return sum(per[kind] for kind in cfg.layer_kinds()) + 4


def _live_bytes(cache, batch: int) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(cache)) / batch


def test_live_cache_bytes_match_plan(prefilled):
    model, _, (_, cache, _), _, _ = prefilled
    live = _live_bytes(cache, B)
    planned = decode_state_bytes(model.cfg, S)["hybrid"]  # plan.py's entry for cfg's own layout
    assert abs(live - planned) <= 0.01 * planned, (live, planned)
    assert live == _closed_form_bytes(model.cfg, S)


@pytest.mark.parametrize("pattern,dtype", [("K", "float32"), ("D", "bfloat16"),
                                           ("KD", "bfloat16")])
def test_live_cache_bytes_per_layout(pattern, dtype):
    """All-KDA, all-DSA and a hybrid (bf16 activations: the latent KV in bf16, the KDA
    state in f32) after a real chunked prefill + one decode step of a 1-row batch."""
    cfg = _cfg(layer_pattern=pattern, num_layers=len(pattern), d_model=32, dtype=dtype,
               **{"moe.num_experts": 0, "moe.dense_dim": 32, "mtp.depth": 0})
    model = Model(cfg)
    variables = model.init(jax.random.key(0), seq_len=4)

    @jax.jit
    def run(variables):
        _, cache, _ = model.prefill(variables, jnp.full((1, 5), 4, jnp.int32),
                                    jnp.array([5]), model.init_cache(1, 24), chunk=2)
        return model.decode_step(variables, jnp.array([3]), cache)[1]

    live = _live_bytes(run(variables), 1)
    planned = decode_state_bytes(cfg, 24)
    assert abs(live - planned["hybrid"]) <= 0.01 * planned["hybrid"], (live, planned)
    assert live == _closed_form_bytes(cfg, 24)
    if pattern == "D":
        assert live == planned["all_dsa"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "16"])
def test_bad_chunk_is_rejected(bad):
    model = Model(_cfg())
    with pytest.raises(ValueError, match="prefill chunk must be an int >= 0"):
        model.prefill({}, jnp.zeros((1, 4), jnp.int32), jnp.array([4]), None, chunk=bad)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
        SamplingConfig(prefill_chunk=bad)


def test_sampler_prefill_chunk_same_greedy_tokens():
    model = Model(_cfg(**VARIANTS["dense_attention"]))
    variables = model.init(jax.random.key(3))
    prompts = np.asarray(jax.random.randint(jax.random.key(4), (2, 21), 3, 250), np.int32)
    lengths = np.array([21, 9], np.int32)
    outs = [Sampler(model, SamplingConfig(max_new_tokens=6, temperature=0.0, prefill_chunk=c))
            .generate(variables, prompts, lengths, jax.random.key(0)) for c in (0, 8)]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].mask, outs[1].mask)


def test_short_prefill_recurrence_equals_chunked_form():
    """KDAConfig.recurrent_max_len: a cached call of at most that many tokens runs the KDA token
    recurrence (a scan over its T tokens), a longer one (or with 0) the chunked form; the two
    prefill the same logits, hidden states, KDA states and next decode step."""
    T_ = 40
    tokens = jax.random.randint(jax.random.key(2), (B, T_), 3, 250)
    lengths = jnp.array(LENGTHS, jnp.int32)
    tokens = jnp.where(jnp.arange(T_)[None] < lengths[:, None], tokens, 0)
    outs, programs = {}, {}
    for limit in (0, T_ - 1, T_):  # chunked, chunked (one token over), recurrent
        model = Model(_cfg(**{"kda.recurrent_max_len": limit}))
        variables = model.init(jax.random.key(1))

        def run(variables, tokens, lengths, model=model):
            lg, cache, hid = model.prefill(variables, tokens, lengths, model.init_cache(B, S))
            return lg, cache, hid, model.decode_step(variables, jnp.array([7, 9]), cache)[0]

        programs[limit] = str(jax.make_jaxpr(run)(variables, tokens, lengths))
        outs[limit] = jax.jit(run)(variables, tokens, lengths)
    def scans_over_tokens(program):
        return re.search(rf"length={T_}\b", program) is not None

    assert scans_over_tokens(programs[T_])
    assert not scans_over_tokens(programs[0]) and not scans_over_tokens(programs[T_ - 1])
    (lg0, c0, h0, d0), (lg1, c1, h1, d1) = outs[0], outs[T_]
    tol = dict(rtol=2e-5, atol=2e-5)
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(lg1[b, :n], lg0[b, :n], **tol)
        np.testing.assert_allclose(h1[b, :n], h0[b, :n], **tol)
    for a, c in zip(c0["layers"], c1["layers"]):
        if "state" in a:
            np.testing.assert_allclose(c["state"], a["state"], **tol)
    np.testing.assert_allclose(d1, d0, **tol)
    assert float(jnp.max(jnp.abs(c0["layers"][0]["state"]))) > 1e-2  # a state was written


# ----------------------------------------------------------------------------- benchmark tasks
# scripts/longctx.py's generators (pure numpy): the answer is determined by the context and only
# reachable through the queried key (no positional or frequency shortcut).
def _longctx():
    from scripts import longctx
    return longctx, longctx.Vocab(n_keys=16, n_values=16, size=64)


def test_mqar_answers_are_the_values_after_their_keys():
    L, voc = _longctx()
    for seed in range(20):
        ex = L.mqar(np.random.default_rng(seed), voc, 96, n_pairs=4, n_queries=3)
        t = ex.tokens
        q = int(np.flatnonzero(t == L.QUERY)[0])
        ctx = t[1:q]
        is_key = (ctx >= voc.key0) & (ctx < voc.val0)
        assert is_key.sum() == 4 and len(set(ctx[is_key])) == 4  # 4 distinct keys
        assert ex.targets.sum() == 3 and t.shape == (96,) and t[0] == L.BOS
        for pos in np.flatnonzero(ex.targets):
            (at,) = np.flatnonzero(ctx == t[pos - 1])
            assert ctx[at + 1] == t[pos]  # the value after the key in the context
    a = L.mqar(np.random.default_rng(7), voc, 64, 4, 4).tokens
    b = L.mqar(np.random.default_rng(7), voc, 64, 4, 4).tokens
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="cannot hold"):
        L.mqar(np.random.default_rng(0), voc, 12, 4, 4)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_is_unique_and_at_its_depth(depth):
    L, voc = _longctx()
    ex = L.needle(np.random.default_rng(3), voc, 101, depth)
    t = ex.tokens
    key, answer = t[-2], t[-1]
    n = (101 - 4) // 2
    pair_keys, pair_vals = t[1:1 + 2 * n:2], t[2:2 + 2 * n:2]
    (at,) = np.flatnonzero(pair_keys == key)  # exactly once
    assert at == round(depth * (n - 1)) and pair_vals[at] == answer
    assert list(np.flatnonzero(ex.targets)) == [100]
    with pytest.raises(ValueError, match="depth"):
        L.needle(np.random.default_rng(0), voc, 64, 1.5)


def test_tasks_have_no_shortcut():
    """Heuristics that ignore the queried key stay far below reading it (1.0): the last value
    before the query, the most frequent context value, the value after the first key score
    0.18-0.25 here (half MQAR with 4 pairs, where any context value is right 1 time in 4; half
    needle, 1 in 16)."""
    L, voc = _longctx()
    rng = np.random.default_rng(11)
    hits = np.zeros(3)
    n = 300
    for i in range(n):
        ex = (L.mqar(rng, voc, 64, 4, 1) if i % 2 else L.needle(rng, voc, 64, rng.uniform()))
        t = ex.tokens
        q = int(np.flatnonzero(t == L.QUERY)[0])
        ctx = t[1:q]
        vals = ctx[(ctx >= voc.val0) & (ctx < voc.noise0)]
        answer = t[np.flatnonzero(ex.targets)[0]]
        first_key = int(np.flatnonzero((ctx >= voc.key0) & (ctx < voc.val0))[0])
        guesses = (vals[-1], np.bincount(vals).argmax(), ctx[first_key + 1])
        hits += [g == answer for g in guesses]
    assert np.all(hits / n < 0.35), hits / n


def test_seed_interval():
    L, _ = _longctx()
    m, lo, hi = L.seed_interval([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and lo == pytest.approx(0.6 - 4.303 * 0.1 / 3 ** 0.5)
    assert L.seed_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    assert np.isnan(L.seed_interval([0.4])[1])
