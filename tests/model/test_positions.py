"""Long-context positions of the DSA/MLA layers: YaRN frequencies and attention scale against the
formula worked by hand, NoPE position-invariance, decode-vs-full parity with both, validation.

Covered: model/layers/rope.py (YaRN), model/layers/dsa.py (positions, YaRN mscale), the new
dsa.* config fields. Not covered: long sequences themselves (the tests use T <= 24).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ConfigError, ModelConfig
from model.layers.dsa import DSALayer, softmax_scale
from model.layers.rope import YaRN, apply_rope, rope_inv_freq


def _cfg(name="test", **over) -> ModelConfig:
    return models.build(name, **over)


def _dsa(cfg: ModelConfig, **fields):
    return dataclasses.replace(cfg.dsa, **fields)


# ----------------------------------------------------------------------------- YaRN formula
def test_yarn_at_factor_one_is_plain_rope():
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16))
    pos = jnp.array([[0, 1, 2, 3, 4], [100, 2000, 4095, 9000, 70000]])
    plain = apply_rope(x, pos, 10000.0)
    yarn1 = apply_rope(x, pos, 10000.0, scaling=YaRN(1.0, 64))
    np.testing.assert_array_equal(np.asarray(yarn1), np.asarray(plain))
    assert YaRN(1.0, 64).softmax_scale_factor() == 1.0 and YaRN(1.0, 64).rope_magnitude() == 1.0


def test_yarn_4x_follows_the_formula_worked_by_hand():
    """d=16 (8 frequencies), base 1e4, L=4096, s=4, beta_fast 32, beta_slow 1.

    corr(b) = d ln(L / (2 pi b)) / (2 ln base):
      corr(32) = 16 ln(4096 / 201.06) / 18.42 = 16 * 3.014 / 18.42 = 2.62 -> low  = floor = 2
      corr(1)  = 16 ln(4096 / 6.283)  / 18.42 = 16 * 6.480 / 18.42 = 5.63 -> high = ceil  = 6
    ramp_i = clip((i - 2) / 4, 0, 1) = 0, 0, 0, .25, .5, .75, 1, 1
    inv_freq_i = theta_i (1 - ramp_i) + theta_i / 4 * ramp_i,  theta_i = 1e4 ** (-i / 8)
    mscale = 0.1 ln 4 + 1 = 1.138629...
    """
    assert math.floor(16 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(1e4))) == 2
    assert math.ceil(16 * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(1e4))) == 6
    ramp = [0, 0, 0, 0.25, 0.5, 0.75, 1, 1]
    theta = [1e4 ** (-i / 8) for i in range(8)]
    expected = [t * (1 - r) + t / 4 * r for t, r in zip(theta, ramp)]
    y = YaRN(4.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(16, 1e4, y)), expected, rtol=2e-7)

    # the rotation itself: a unit vector in pair i turns by position * inv_freq_i
    pos = jnp.array([[0, 3, 50]])
    angles = np.asarray(pos)[0, :, None] * np.asarray(expected, np.float32)[None, :]  # [3,8]
    for i in (0, 4, 7):
        e = jnp.zeros((1, 3, 16)).at[..., i].set(1.0)
        r = np.asarray(apply_rope(e, pos, 1e4, scaling=y))[0]
        np.testing.assert_allclose(r[:, i], np.cos(angles[:, i]), atol=1e-5)
        np.testing.assert_allclose(r[:, i + 8], np.sin(angles[:, i]), atol=1e-5)
    # high-frequency dims (i <= low) rotate exactly as plain RoPE, at any position
    plain = apply_rope(jnp.ones((1, 3, 16)), pos, 1e4)
    scaled = apply_rope(jnp.ones((1, 3, 16)), pos, 1e4, scaling=y)
    for i in (0, 1, 2):
        np.testing.assert_array_equal(np.asarray(scaled)[..., [i, i + 8]],
                                      np.asarray(plain)[..., [i, i + 8]])

    m = 0.1 * math.log(4.0) + 1.0
    assert abs(m - 1.1386294361) < 1e-9
    assert y.softmax_scale_factor() == pytest.approx(m * m, rel=1e-12)
    assert y.rope_magnitude() == pytest.approx(1.0, rel=1e-12)
    cfg = _cfg(**{"dsa.rope_scaling": "yarn", "dsa.rope_factor": 4.0,
                  "dsa.rope_original_max_position": 4096})
    assert softmax_scale(cfg.dsa) == pytest.approx(cfg.dsa.qk_head_dim ** -0.5 * m * m, rel=1e-12)


def _layer_setup(dsa_cfg, d_model=64, B=2, T=12, seed=0):
    layer = DSALayer(dsa_cfg, d_model)
    x = jax.random.normal(jax.random.key(seed), (B, T, d_model))
    valid = jnp.ones((B, T), bool)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    v = nn.meta.unbox(layer.init(jax.random.key(1), x, valid=valid, positions=pos))
    return layer, v, x, valid, pos


def test_yarn_attention_scale_is_applied_to_every_qk_channel():
    """At position 0 every rotation is the identity, so a YaRN layer (s=4, mscale 1.5,
    mscale_all_dim 0.5) equals the plain layer whose q is scaled by m_all**2 (softmax scale
    x m_all**2 on all q.k channels) and whose rotary q/k channels are scaled by m/m_all each:
    the DeepSeek-V3 convention, with m = 0.1 mscale ln s + 1 computed here by hand."""
    base = _cfg()
    N, R, H, L = (base.dsa.qk_nope_head_dim, base.dsa.qk_rope_head_dim, base.dsa.num_heads,
                  base.dsa.kv_lora_rank)
    yarn = _dsa(base, rope_scaling="yarn", rope_factor=4.0, rope_original_max_position=64,
                rope_mscale=1.5, rope_mscale_all_dim=0.5)
    layer, v, x, valid, _ = _layer_setup(yarn)
    zeros = jnp.zeros(valid.shape, jnp.int32)
    got = layer.apply(v, x, valid=valid, positions=zeros)[0]

    m_all = 0.1 * 0.5 * math.log(4.0) + 1.0
    mag = (0.1 * 1.5 * math.log(4.0) + 1.0) / m_all
    p = jax.tree.map(lambda a: a, v["params"])
    col = np.tile(np.r_[np.full(N, m_all ** 2), np.full(R, m_all ** 2 * mag)], H)
    p["q_b"]["kernel"] = p["q_b"]["kernel"] * col[None, :]
    p["kv_a"]["kernel"] = p["kv_a"]["kernel"] * np.r_[np.ones(L), np.full(R, mag)][None, :]
    plain_layer = DSALayer(base.dsa, 64)
    want = plain_layer.apply({**v, "params": p}, x, valid=valid, positions=zeros)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    # and the scale matters: the unscaled plain layer differs
    unscaled = plain_layer.apply(v, x, valid=valid, positions=zeros)[0]
    assert float(jnp.max(jnp.abs(unscaled - got))) > 1e-3


# ----------------------------------------------------------------------------- NoPE
def test_nope_layer_ignores_positions_and_is_a_set_function_of_visible_keys():
    base = _cfg()
    nope = _dsa(base, positions="nope")  # index_topk 16 >= T: every causal key is selected
    layer, v, x, valid, pos = _layer_setup(nope)
    out = layer.apply(v, x, valid=valid, positions=pos)[0]
    shuffled = jax.random.permutation(jax.random.key(2), 10_000)[: pos.size].reshape(pos.shape)
    out2 = layer.apply(v, x, valid=valid, positions=shuffled)[0]
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    # the last query attends to the set of earlier keys: their order does not matter
    perm = jnp.concatenate([jax.random.permutation(jax.random.key(3), x.shape[1] - 1),
                            jnp.array([x.shape[1] - 1])])
    out3 = layer.apply(v, x[:, perm], valid=valid, positions=pos)[0]
    np.testing.assert_allclose(np.asarray(out3[:, -1]), np.asarray(out[:, -1]), rtol=1e-5,
                               atol=1e-5)
    # with RoPE the same changes move the output (the checks above can fail)
    rope = DSALayer(base.dsa, 64)
    r1 = rope.apply(v, x, valid=valid, positions=pos)[0]
    assert float(jnp.max(jnp.abs(rope.apply(v, x, valid=valid, positions=shuffled)[0] - r1))) > 1e-3
    assert float(jnp.max(jnp.abs(rope.apply(v, x[:, perm], valid=valid, positions=pos)[0][:, -1]
                                 - r1[:, -1]))) > 1e-3


# ----------------------------------------------------------------------------- decode parity
@pytest.mark.parametrize("fields", [
    dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_position=8),
    dict(positions="nope"),
], ids=["yarn", "nope"])
def test_layer_prefill_then_decode_matches_full_forward(fields):
    """The DSA layer over T tokens at once vs a prompt of P tokens into the cache, then one
    token per step (rows at different offsets), with index_topk 8 < T so the top-k selection
    through the cache is exercised too."""
    dsa_cfg = _dsa(_cfg(), index_topk=8, **fields)
    B, T, P = 2, 14, 5
    layer, v, x, valid, pos = _layer_setup(dsa_cfg, B=B, T=T)
    full = jax.jit(lambda v, x: layer.apply(v, x, valid=valid, positions=pos)[0])(v, x)

    @jax.jit
    def step(v, xs, cache, offset):
        n = xs.shape[1]
        p = offset[:, None] + jnp.arange(n)[None]
        return layer.apply(v, xs, valid=jnp.ones((B, n), bool), positions=p, cache=cache,
                           offset=offset)[:2]

    cache = DSALayer.init_cache(dsa_cfg, B, 16, jnp.float32)
    out, cache = step(v, x[:, :P], cache, jnp.zeros((B,), jnp.int32))
    np.testing.assert_allclose(np.asarray(out), np.asarray(full[:, :P]), rtol=1e-4, atol=1e-4)
    for t in range(P, T):
        out, cache = step(v, x[:, t:t + 1], cache, jnp.full((B,), t, jnp.int32))
        np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(full[:, t]), rtol=1e-4,
                                   atol=1e-4)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("over,needle", [
    ({"dsa.positions": "alibi"}, r"dsa\.positions"),
    ({"dsa.rope_scaling": "ntk"}, r"dsa\.rope_scaling"),
    ({"dsa.positions": "nope", "dsa.rope_scaling": "yarn", "dsa.rope_factor": 4.0},
     r"dsa\.rope_scaling: 'yarn' scales rotary positions"),
    ({"dsa.rope_scaling": "yarn", "dsa.rope_factor": 0.5}, r"dsa\.rope_factor"),
    ({"dsa.rope_scaling": "yarn", "dsa.rope_factor": 4.0, "dsa.rope_beta_slow": 40.0},
     r"beta_slow < beta_fast"),
    ({"dsa.rope_scaling": "yarn", "dsa.rope_factor": 2.0, "dsa.rope_original_max_position": 64},
     r"model\.max_seq_len: 256 is beyond"),
    ({"dsa.rope_scaling": "yarn", "dsa.rope_factor": 4.0, "dsa.rope_original_max_position": 0},
     r"dsa\.rope_original_max_position"),
])
def test_position_fields_are_validated(over, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(**over)


def test_reference_uses_nope_and_yarn_is_accepted():
    ref = _cfg("reference_2p8t")
    assert ref.dsa.positions == "nope" and ref.dsa.rope_scaling == "none"
    ok = _cfg(**{"dsa.rope_scaling": "yarn", "dsa.rope_factor": 4.0,
                 "dsa.rope_original_max_position": 64})
    assert ok.dsa.rope_factor == 4.0
