"""Model tests: configs and validation, MoE routing/dispatch, DSA sparse == dense, decode parity,
training signal, the full-size presets under jax.eval_shape, and the unrolled threefry lowering
(runtime/xla_env.py) giving jax.random's bits."""

import math
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ConfigError, ModelConfig
from model.layers import moe as moe_lib
from model.tokenizer import ByteTokenizer
from model.transformer import Model


def _cfg(name="test", **over) -> ModelConfig:
    return models.build(name, **over)


@pytest.fixture(scope="module")
def test_model():
    cfg = _cfg()
    model = Model(cfg)
    return model, model.init(jax.random.key(0))


@pytest.fixture(scope="module")
def jit_prefill(test_model):
    """One compiled prefill (batch 2, prompt width 6, cache of 32) for the decode tests."""
    return jax.jit(test_model[0].prefill)


# ----------------------------------------------------------------------------- random bits
_RANDOM_DIGEST = """
import hashlib, sys
import jax, numpy as np
if sys.argv[1] == "unrolled":
    import model.transformer  # registers the unrolled CPU lowering
k = jax.random.key(7)
outs = [jax.random.bits(k, (1001,)), jax.random.normal(k, (7, 13)),
        jax.random.uniform(jax.random.fold_in(k, 3), (2, 3, 5)),
        jax.random.gumbel(k, (32, 512)), jax.random.key_data(jax.random.split(k, 5)),
        jax.random.truncated_normal(k, -2.0, 2.0, (33,))]
print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in outs)).hexdigest())
"""


def test_unrolled_threefry_gives_jax_random_bits():
    """jax.random draws through the unrolled lowering (this process: model.transformer is
    imported) equal those of jax's own rolled-loop lowering (a child that does not import it),
    and the Random123 known-answer vectors hold; the lowering in use has no loop."""
    from jax.extend.random import threefry_2x32

    known = [((0x0, 0x0), (0x0, 0x0), (0x6B200159, 0x99BA4EFE)),
             ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
             ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0))]
    for key, count, want in known:
        got = jax.jit(threefry_2x32)(np.array(key, np.uint32), np.array(count, np.uint32))
        assert tuple(int(v) for v in got) == want
    hlo = jax.jit(lambda k: jax.random.bits(k, (64,))).lower(jax.random.key(0)).as_text()
    assert "while" not in hlo and "threefry" in hlo.lower()
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    digests = {}
    for mode in ("rolled", "unrolled"):
        r = subprocess.run([sys.executable, "-c", _RANDOM_DIGEST, mode], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        digests[mode] = r.stdout.split()[-1]
    rolled_hlo = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.jit(lambda k: jax.random.bits(k, (64,)))"
         ".lower(jax.random.key(0)).as_text())"], env=env, capture_output=True, text=True,
        timeout=300).stdout
    assert "while" in rolled_hlo  # the child really used jax's rolled CPU lowering
    assert len(digests["rolled"]) == 64 and digests["rolled"] == digests["unrolled"]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_presets_build(name):
    cfg = _cfg(name)
    assert len(cfg.layer_kinds()) == cfg.num_layers


@pytest.mark.parametrize("field,value,needle", [
    ("layer_pattern", "KXD", "model.layer_pattern"),
    ("moe.num_experts_per_tok", 9, "moe.num_experts_per_tok"),
    ("dsa.qk_rope_head_dim", 7, "dsa.qk_rope_head_dim"),
    ("moe.router", "argmax", "moe.router"),
    ("kda.chunk_size", 48, "kda.chunk_size"),
    ("dsa.index_rope_dim", 64, "dsa.index_rope_dim"),
])
def test_invalid_config_names_field(field, value, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        _cfg(**{field: value})


def test_unknown_field_is_rejected():
    c = models.get_config("test")
    c.moe.num_expert = 3  # typo
    with pytest.raises(ConfigError, match=r"moe\.num_expert"):
        ModelConfig.from_dict(c)


def test_mxfp4_needs_multiple_of_32():
    with pytest.raises(ConfigError, match="multiples of 32"):
        _cfg(**{"moe.expert_format": "mxfp4", "moe.expert_dim": 48})


# ----------------------------------------------------------------------------- tokenizer
def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "héllo\nwörld ✓"
    ids = tok.encode(tok.chat_prompt(text), bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids[1:]) == tok.chat_prompt(text)
    assert tok.decode(tok.encode("ab") + [tok.eos_id] + tok.encode("cd")) == "ab"


# ----------------------------------------------------------------------------- MoE
def _moe_setup(dispatch="dropless", router="softmax", capacity_factor=1.25, E=4, k=2,
               grouped_matmul="auto"):
    cfg = _cfg(**{"moe.dispatch": dispatch, "moe.router": router,
                  "moe.capacity_factor": capacity_factor, "moe.num_experts": E,
                  "moe.num_experts_per_tok": k, "moe.grouped_matmul": grouped_matmul})
    mod = moe_lib.MoE(cfg.moe, cfg.d_model)
    x = jax.random.normal(jax.random.key(1), (2, 7, cfg.d_model))
    valid = jnp.ones((2, 7), bool).at[1, 5:].set(False)
    variables = nn.meta.unbox(mod.init(jax.random.key(2), x, valid=valid))
    return cfg, mod, variables, x, valid


@pytest.mark.parametrize("router, grouped_matmul", [
    ("softmax", "blocked"), ("sigmoid", "blocked"), ("sigmoid", "ragged_dot")])
def test_moe_dropless_equals_token_loop(router, grouped_matmul):
    cfg, mod, variables, x, valid = _moe_setup(router=router, grouped_matmul=grouped_matmul)
    variables["router_state"]["bias"] = jnp.linspace(-0.3, 0.3, cfg.moe.num_experts)
    y, aux = mod.apply(variables, x, valid=valid)
    p = variables["params"]
    m = cfg.moe
    xf = np.asarray(x.reshape(-1, cfg.d_model), np.float64)
    logits = xf @ np.asarray(p["router"], np.float64)
    out = np.zeros_like(xf)
    vf = np.asarray(valid).reshape(-1)
    for n in range(xf.shape[0]):
        if router == "softmax":
            s = np.exp(logits[n] - logits[n].max())
            s /= s.sum()
            sel = np.argsort(-s)[: m.num_experts_per_tok]
        else:
            s = 1 / (1 + np.exp(-logits[n]))
            sel = np.argsort(-(s + np.asarray(variables["router_state"]["bias"])))[: m.num_experts_per_tok]
        w = s[sel] / s[sel].sum() * m.routed_scaling_factor
        for wi, e in zip(w, sel):
            g = xf[n] @ np.asarray(p["w_gate"][e])
            u = xf[n] @ np.asarray(p["w_up"][e])
            h = g / (1 + np.exp(-g)) * u
            out[n] += vf[n] * wi * (h @ np.asarray(p["w_down"][e]))
        sh = p["shared"]
        g = xf[n] @ np.asarray(sh["gate"]["kernel"])
        u = xf[n] @ np.asarray(sh["up"]["kernel"])
        out[n] += (g / (1 + np.exp(-g)) * u) @ np.asarray(sh["down"]["kernel"])
    np.testing.assert_allclose(np.asarray(y).reshape(out.shape), out, rtol=2e-4, atol=2e-5)
    assert float(aux["router"]["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(float(jnp.sum(aux["expert_counts"])), vf.sum() * m.num_experts_per_tok)


def test_moe_capacity_counts_exactly_the_dropped():
    cfg, mod, variables, x, valid = _moe_setup(dispatch="capacity", capacity_factor=0.5)
    y, aux = mod.apply(variables, x, valid=valid)
    m = cfg.moe
    xf = x.reshape(-1, cfg.d_model).astype(jnp.float32)
    _, idx, _ = moe_lib.route(xf @ variables["params"]["router"], jnp.zeros(m.num_experts),
                              router=m.router, top_k=m.num_experts_per_tok,
                              norm_topk_prob=True, scaling=1.0)
    cap = math.ceil(m.capacity_factor * x.shape[0] * x.shape[1] * m.num_experts_per_tok
                    / m.num_experts)
    seen, dropped = np.zeros(m.num_experts, int), 0
    for n, row in enumerate(np.asarray(idx)):
        if not np.asarray(valid).reshape(-1)[n]:
            continue
        for e in row:
            dropped += seen[e] >= cap
            seen[e] += 1
    total = float(jnp.sum(aux["expert_counts"]))
    assert dropped > 0
    assert round(float(aux["router"]["dropped_fraction"]) * total) == dropped
    # with ample capacity, the capacity path equals the dropless path
    _, mod2, _, _, _ = _moe_setup(dispatch="capacity", capacity_factor=8.0)
    _, mod3, _, _, _ = _moe_setup(dispatch="dropless")
    np.testing.assert_allclose(mod2.apply(variables, x, valid=valid)[0],
                               mod3.apply(variables, x, valid=valid)[0], rtol=1e-5, atol=1e-6)


def test_balance_loss_uniform_closed_form():
    E, k, B, T = 4, 2, 2, 8
    probs = jnp.full((B, T, E), 1.0 / E)
    idx = jnp.stack([jnp.arange(T) % E, (jnp.arange(T) + 1) % E], -1)  # every expert k*T/E times
    idx = jnp.broadcast_to(idx, (B, T, k))
    loss = moe_lib.seq_balance_loss(probs, idx, jnp.ones((B, T), bool), E)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-6)
    # all tokens on expert 0 with a peaked distribution: loss = E/k * p0
    idx0 = jnp.zeros((B, T, k), jnp.int32).at[..., 1].set(1)
    p0 = jnp.zeros((B, T, E)).at[..., 0].set(0.7).at[..., 1].set(0.3)
    np.testing.assert_allclose(float(moe_lib.seq_balance_loss(p0, idx0, jnp.ones((B, T), bool), E)),
                               E / k * (0.7 + 0.3), rtol=1e-6)


def test_aux_free_bias_update_moves_against_load():
    b = moe_lib.aux_free_bias_update(jnp.zeros(4), jnp.array([10.0, 2.0, 4.0, 4.0]), 0.1)
    np.testing.assert_allclose(np.asarray(b), [-0.1, 0.1, 0.1, 0.1])


# ----------------------------------------------------------------------------- DSA
def test_dsa_sparse_equals_dense_when_keys_fit_topk():
    base = _cfg(**{"dsa.index_topk": 32})
    dense = base.replace(dsa=base.dsa.__class__(**{**base.dsa.__dict__, "indexer_stage": "dense_warmup"}))
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 3, 200)
    small = base.replace(dsa=base.dsa.__class__(**{**base.dsa.__dict__, "index_topk": 4}))
    v = Model(base).init(jax.random.key(0))

    def logits(cfg):  # one compiled forward per config (op-by-op dispatch is slower here)
        return jax.jit(lambda v, t: Model(cfg).apply(v, t, with_mtp=False).logits)(v, tokens)

    ref = logits(dense)
    np.testing.assert_allclose(logits(base), ref, rtol=1e-5, atol=1e-5)
    # and with top-k smaller than the context the outputs differ (sparsity is real)
    assert float(jnp.max(jnp.abs(logits(small) - ref))) > 1e-3


# ----------------------------------------------------------------------------- decode parity
def test_prefill_then_decode_matches_full_forward(test_model, jit_prefill):
    model, variables = test_model
    B, T, P = 2, 24, 6  # prompts of lengths 6 and 3, then decode to 24 tokens
    tokens = jax.random.randint(jax.random.key(4), (B, T), 3, 250)
    full = jax.jit(lambda v, t: model.apply(v, t, with_mtp=False).logits)(variables, tokens)
    lengths = jnp.array([P, 3])
    prompt = jnp.where(jnp.arange(P)[None] < lengths[:, None], tokens[:, :P], 0)
    cache = model.init_cache(B, 32)
    logits, cache, _ = jit_prefill(variables, prompt, lengths, cache)
    for b in range(B):
        np.testing.assert_allclose(logits[b, : lengths[b]], full[b, : lengths[b]], rtol=1e-4, atol=1e-4)
    step = jax.jit(model.decode_step)
    pos = np.asarray(lengths)
    for _ in range(T - P):
        nxt = tokens[jnp.arange(B), jnp.asarray(pos)]
        lg, cache, _ = step(variables, nxt, cache)
        for b in range(B):
            np.testing.assert_allclose(lg[b], full[b, pos[b]], rtol=1e-4, atol=1e-4)
        pos = pos + 1
    assert list(np.asarray(cache["lengths"])) == list(pos)


def test_decode_inactive_rows_are_frozen(test_model, jit_prefill):
    model, variables = test_model
    cache = model.init_cache(2, 32)  # the shapes of the prefill above: its compiled program
    prompt = jnp.array([[5, 6, 7, 0, 0, 0], [8, 9, 10, 0, 0, 0]], jnp.int32)
    _, cache, _ = jit_prefill(variables, prompt, jnp.array([3, 3]), cache)
    _, c2, _ = jax.jit(model.decode_step)(variables, jnp.array([11, 12]), cache,
                                          jnp.array([True, False]))
    assert list(np.asarray(c2["lengths"])) == [4, 3]
    for a, b in zip(cache["layers"], c2["layers"]):
        if "state" in a:
            np.testing.assert_array_equal(a["state"][1], b["state"][1])
            np.testing.assert_array_equal(a["conv"][1], b["conv"][1])
            assert not np.array_equal(a["state"][0], b["state"][0])


# ----------------------------------------------------------------------------- training
def test_tiny_model_learns_synthetic_task(counting_model):
    """Next-token + MTP loss (and the indexer KL) on counting sequences: tests/conftest.py
    trains the test model with AdamW and records the metrics of every step."""
    first, met = counting_model.history[0], counting_model.history[24]
    assert float(met["ce"]) < 0.5 * float(first["ce"])
    assert float(met["mtp_ce"]) < float(first["mtp_ce"])
    assert np.isfinite(float(met["indexer_kl"]))


# ----------------------------------------------------------------------------- full size
def test_reference_2p8t_eval_shape_and_plan():
    from model.plan import plan
    out = plan(_cfg("reference_2p8t"))
    assert abs(out["total_params"] - 2.8e12) / 2.8e12 < 0.03, out["total_params"]
    assert out["active_params"] < 0.05 * out["total_params"]
    assert 0.25 < out["bytes_mxfp4"] / out["bytes_bf16"] < 0.30
    st = out["decode_state_bytes"][str(1 << 20)]
    assert st["hybrid"] < st["all_dsa"] < st["all_mha"]
