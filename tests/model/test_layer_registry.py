"""The layer-kind registry (model/layers/registry.py): a new kind added through the registry alone.

Covered: a toy kind "C" (a causal depthwise short-convolution mixer with a real decode cache, the
last width-1 inputs of every row, defined only in this file) registered with one `register`
call: its config section is built and validated by ModelConfig, the transformer builds it in the
trunk and as the MTP block, and with it prefill of right-padded rows, decode, and speculative
verify + commit (its select_step_cache) give the full forward's logits; the planner splits its
cache leaves by the axes the kind declares. Registration errors: a layer that does not follow
SequenceMixer, a taken letter, a taken section name; an unknown letter before registration. The
kind is unregistered when the module ends. Not covered: the built-in kinds' own parity (tests/
model/test_model.py, test_chunked_prefill.py).
"""

import dataclasses
from typing import Any, TypedDict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ConfigError, ModelConfig, require
from model.layers import registry
from model.layers.registry import LayerKind
from model.transformer import Model

LETTER = "C"


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """Section `shortconv`: a causal depthwise convolution over the last `width` tokens of a
    `dim`-wide projection of the residual stream."""

    width: int = 3
    dim: int = 16

    def validate(self, model, section: str = "shortconv") -> None:
        require(self.width >= 2, f"{section}.width", "must be >= 2 (a window of past tokens)")
        require(self.dim > 0, f"{section}.dim", "must be positive")


class ShortConvCache(TypedDict):
    window: jax.Array  # [B, width-1, dim] the last width-1 conv inputs of each row


class ShortConvMixer(nn.Module):
    """out_t = W_out silu(sum_j w_j * (W_in x)_{t-j}), j < width: causal, position-free.
    A padding token (valid=False) enters as zeros and is not kept in the window."""

    cfg: ShortConvConfig
    d_model: int
    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, *, valid, positions=None, cache=None, offset=None, step_caches=False):
        del positions, offset
        B, T, _ = x.shape
        W, C = self.cfg.width, self.cfg.dim
        h = jnp.where(valid[..., None], nn.Dense(C, name="w_in")(x), 0.0)  # [B,T,C]
        w = self.param("conv", nn.initializers.normal(W ** -0.5), (W, C))
        window = cache["window"] if cache is not None else jnp.zeros((B, W - 1, C), h.dtype)
        xp = jnp.concatenate([window, h], axis=1)  # [B,W-1+T,C]
        y = sum(xp[:, j:j + T] * w[j] for j in range(W))  # y_t = sum_j w_j h_{t+j-(W-1)}
        out = nn.Dense(self.d_model, name="w_out")(nn.silu(y))  # [B,T,D]
        if cache is None:
            return out, None, {}
        if step_caches:  # the window after each prefix 0..T of the new tokens: [T+1,B,W-1,D]
            return out, {"window": jnp.stack([xp[:, j:j + W - 1] for j in range(T + 1)])}, {}
        n = jnp.sum(valid, axis=1)  # [B] valid new tokens (a prefix of each row)
        new = jax.vmap(lambda row, k: jax.lax.dynamic_slice_in_dim(row, k, W - 1))(xp, n)
        return out, {"window": new}, {}

    @staticmethod
    def init_cache(cfg: ShortConvConfig, batch: int, max_len: int, dtype) -> ShortConvCache:
        del max_len  # O(1) state
        return {"window": jnp.zeros((batch, cfg.width - 1, cfg.dim), dtype)}

    @staticmethod
    def select_step_cache(step_cache: ShortConvCache, n: jax.Array) -> ShortConvCache:
        rows = jnp.arange(n.shape[0])
        return {"window": step_cache["window"][n, rows]}


TOY_D = 32
TOY = LayerKind(name="shortconv", section="shortconv", layer=ShortConvMixer,
                config=ShortConvConfig, cache_axes={"window": ("batch", None, "act_heads")})


def test_unknown_letter_before_registration():
    assert LETTER not in registry.kinds()
    c = _toy_dict()
    with pytest.raises(ConfigError, match=r"model\.shortconv: unknown field"):
        ModelConfig.from_dict(c)  # an unregistered kind's section is not silently kept
    del c["shortconv"]
    with pytest.raises(ConfigError, match="unknown layer letter 'C'"):
        ModelConfig.from_dict(c)


@pytest.fixture(scope="module")
def toy():
    registry.register(LETTER, TOY)
    yield TOY
    registry.unregister(LETTER)
    assert LETTER not in registry.kinds()


def _toy_dict(pattern="KC", **section):
    c = models.get_config("test")
    c.update(dict(layer_pattern=pattern, num_layers=len(pattern), d_model=TOY_D, max_seq_len=64))
    c.moe.update(dict(num_experts=0, dense_dim=48))
    c.mtp.layer_kind = LETTER
    c.shortconv = dict(width=3, dim=16, **section)
    return c


def test_config_section_is_built_and_validated(toy):
    cfg = ModelConfig.from_dict(_toy_dict())
    assert cfg.layer_kinds() == ("K", "C") and cfg.shortconv == ShortConvConfig(width=3, dim=16)
    assert cfg.section("shortconv") is cfg.shortconv
    assert ModelConfig.from_dict(dataclasses.asdict(cfg)) == cfg  # the export form round-trips
    assert cfg.replace(shortconv=ShortConvConfig(width=4)).shortconv.width == 4
    c = _toy_dict()
    c.shortconv.width = 1
    with pytest.raises(ConfigError, match=r"shortconv\.width: must be >= 2"):
        ModelConfig.from_dict(c)
    c = _toy_dict()
    del c["shortconv"]
    with pytest.raises(ConfigError, match=r"model\.shortconv: layer kind 'C' .* is missing"):
        ModelConfig.from_dict(c)
    c = _toy_dict()
    c.shortconv.kernel = 5  # a typo in the section
    with pytest.raises(ConfigError, match=r"shortconv\.kernel: unknown field"):
        ModelConfig.from_dict(c)


def test_registration_errors(toy):
    class NoStepCache(nn.Module):
        cfg: Any
        d_model: int
        eps: float = 1e-6
        dtype: Any = jnp.float32
        param_dtype: Any = jnp.float32

        def __call__(self, x, **kw):
            return x, None, {}

        @staticmethod
        def init_cache(cfg, batch, max_len, dtype):
            return {}

    bad = dataclasses.replace(TOY, layer=NoStepCache)
    with pytest.raises(TypeError, match=r"SequenceMixer, missing \['select_step_cache'\]"):
        registry.register("Z", bad)
    with pytest.raises(ValueError, match="'K' is taken"):
        registry.register("K", TOY)
    with pytest.raises(ValueError, match="section name 'moe' is taken"):
        registry.register("Z", dataclasses.replace(TOY, section="moe"))
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister("K")
    assert "Z" not in registry.kinds()


B, T, MAX = 2, 10, 16
LENGTHS = np.array([6, 4])  # prompt length per row (right-padded)
TOKENS = np.asarray(jax.random.randint(jax.random.key(1), (B, T), 3, 200), np.int32)


@pytest.fixture(scope="module")
def toy_model(toy):
    """(model "KC" with the toy also as the MTP block, variables, full-forward logits [B,T,V])."""
    model = Model(ModelConfig.from_dict(_toy_dict()))
    variables = model.init(jax.random.key(0))
    out = jax.jit(model.apply)(variables, jnp.asarray(TOKENS))
    assert out.mtp_logits.shape == (1, B, T, out.logits.shape[-1])
    return model, variables, np.asarray(out.logits)


def test_prefill_and_decode_equal_the_full_forward(toy_model):
    model, variables, full = toy_model

    prompt = np.where(np.arange(T)[None] < LENGTHS[:, None], TOKENS, 0)
    logits, cache, _ = jax.jit(model.prefill)(variables, jnp.asarray(prompt),
                                              jnp.asarray(LENGTHS), model.init_cache(B, MAX))
    assert cache["layers"][1]["window"].shape == (B, 2, 16)
    for b in range(B):
        np.testing.assert_allclose(logits[b, :LENGTHS[b]], full[b, :LENGTHS[b]], atol=2e-5)
    step = jax.jit(model.decode_step)
    for s in range(T - LENGTHS.max()):  # both rows advance together
        pos = LENGTHS + s
        lg, cache, _ = step(variables, jnp.asarray(TOKENS[np.arange(B), pos]), cache)
        np.testing.assert_allclose(lg, full[np.arange(B), pos], atol=2e-5)
    # the cache is what the layer carries: a fresh window differs
    assert float(jnp.abs(cache["layers"][1]["window"]).max()) > 0


def test_verify_and_commit_use_the_kinds_select_step_cache(toy_model):
    model, variables, full = toy_model
    lengths = np.array([4, 4])
    prompt = np.where(np.arange(T)[None] < lengths[:, None], TOKENS, 0)
    _, cache, _ = jax.jit(model.prefill)(variables, jnp.asarray(prompt), jnp.asarray(lengths),
                                         model.init_cache(B, MAX))
    drafts = jnp.asarray(TOKENS[:, 4:7])  # 3 tokens at positions 4..6 of each row
    lg, steps, _ = jax.jit(model.verify)(variables, drafts, cache)
    np.testing.assert_allclose(lg, full[:, 4:7], atol=2e-5)
    keep = jnp.array([3, 1])  # row 0 keeps all three, row 1 only the first
    cache = model.commit(steps, keep)
    pos = 4 + np.asarray(keep)
    lg, _, _ = jax.jit(model.decode_step)(variables, jnp.asarray(TOKENS[np.arange(B), pos]),
                                          cache)
    np.testing.assert_allclose(lg, full[np.arange(B), pos], atol=2e-5)


def test_planner_reads_the_kinds_cache_axes(toy):
    from model.plan import decode_state_per_device, device_slice_cfg

    cfg = ModelConfig.from_dict(_toy_dict(pattern="C"))
    batch, seq = 4, 16
    window = batch * 2 * 16 * 4  # [B, width-1, dim] f32
    lengths = batch * 4
    # tensor=2: the window's channels follow "act_heads" (its declared axes), nothing else splits
    assert decode_state_per_device(cfg, {"tensor": 2}, batch, seq) == window // 2 + lengths
    assert device_slice_cfg(cfg, {"tensor": 2}).shortconv == cfg.shortconv  # nothing to split


def test_runtime_cache_constraints_read_the_kinds_cache_axes(toy):
    """model/sharding.py constrains each decode-cache leaf with the axes its kind declares (the
    same table the planner reads): the built-in kinds' leaves, a registered kind's leaf, and
    "lengths" / undeclared leaves over the batch only."""
    import jax

    from model import sharding as shd

    def path(leaf):
        return (jax.tree_util.DictKey("layer_0"), jax.tree_util.DictKey(leaf))

    assert shd.cache_axes(path("state")) == ("batch", "act_heads", None, None)
    assert shd.cache_axes(path("conv")) == ("batch", None, None)
    assert shd.cache_axes(path("kv")) == shd.cache_axes(path("k_idx")) == ("batch", "length", None)
    assert shd.cache_axes(path("window")) == ("batch", None, "act_heads")  # the toy kind's leaf
    assert shd.cache_axes(path("lengths")) == shd.cache_axes(path("unknown")) == ("batch",)
