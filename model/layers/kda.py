"""Kimi Delta Attention (KDA) layer: gated delta-rule linear attention with channel-wise decay.

  q, k, v = SiLU(causal depthwise conv_4(W x))          # short conv over time, per channel
  q, k    = L2-normalised per head
  g       = -exp(A_log[h]) * softplus(W_up W_down x + dt_bias)   # [B,T,H,K], log-decay <= 0
            (or lower_bound * sigmoid(exp(A_log[h]) * (W_up W_down x + dt_bias)) when configured)
  beta    = sigmoid(W_b x)                               # [B,T,H]
  o       = KDA(q, k, v, g, beta)                        # pallas_kernels.kda.ops
  out     = W_o (RMSNorm_head(o) * sigmoid(W_gu W_gd x))

Padding: tokens with valid=False get g=0, beta=0, so they leave the recurrent state untouched
(rows of different lengths share one call). The decode cache (KDACache) holds the last
conv_size-1 conv inputs of every row and the [B,H,K,V] f32 state.

Layer kind "K" (`KIND`, model/layers/registry.py): its config section `kda` is `KDAConfig`
(validated here, including the kernel choice against pallas_kernels/kda/ops.py:DISPATCH).
"""

import dataclasses
from typing import TypedDict

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config_base import check_kernel, require
from model.layers.linear import dense
from model.layers.norms import l2_normalize, rms_norm
from model.layers.registry import LayerKind
from pallas_kernels.kda import ops as kda_ops


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention layer (section `kda`). K = V = head_dim unless v_head_dim is given."""

    num_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0 -> head_dim
    conv_size: int = 4
    gate_rank: int = 0  # low-rank decay gate W_up W_down; 0 -> head_dim
    gate_lower_bound: float | None = None  # None: -exp(A_log)*softplus(.); else lb*sigmoid(.)
    chunk_size: int = 64
    impl: str = "auto"  # kernel dispatch (pallas_kernels/kda/ops.py:DISPATCH)
    # A cached call (prefill, or an agent turn's extension) of at most this many tokens runs
    # the token recurrence (a lax.scan of `kda_step`) instead of the chunked form when `impl`
    # resolves to a pure-JAX one (not with the Pallas kernels): on XLA:CPU it compiles several
    # times faster and runs about as fast at short rows (python -m benchmarks.kda --prefill;
    # numbers in docs/speed.md).
    # 0: always the chunked form. Training calls (no cache) always take `impl`.
    recurrent_max_len: int = 128

    @property
    def k_dim(self) -> int:
        return self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rank(self) -> int:
        return self.gate_rank or self.head_dim

    def validate(self, model, section: str = "kda") -> None:
        """Raise model.config.ConfigError naming the field (`model`: the ModelConfig)."""
        p = section
        require(self.num_heads > 0 and self.head_dim > 0, f"{p}.num_heads/head_dim",
                "must be positive")
        require(self.conv_size >= 1, f"{p}.conv_size", "must be >= 1")
        require(self.chunk_size in (16, 32, 64, 128), f"{p}.chunk_size",
                "must be 16, 32, 64 or 128")
        require(self.recurrent_max_len >= 0, f"{p}.recurrent_max_len",
                "must be >= 0 (0: cached calls always take the chunked form)")
        check_kernel(kda_ops.DISPATCH, self.impl, f"{p}.impl",
                     f"(K = {p}.head_dim = {self.k_dim}, V = {p}.v_head_dim or head_dim = "
                     f"{self.v_dim})", K=self.k_dim, V=self.v_dim, dtype=model.dtype)
        if self.gate_lower_bound is not None:
            require(self.gate_lower_bound < 0, f"{p}.gate_lower_bound",
                    "must be negative (or None)")


class KDACache(TypedDict):
    """Decode cache of one KDA layer."""

    conv: jax.Array  # [B, conv_size-1, H*(2K+V)] the last conv inputs, activation dtype
    state: jax.Array  # [B, H, K, V] f32 recurrent state


@jax.custom_vjp
def _taps(xp, w):
    """y[:, t] = sum_j w[j] xp[:, t + j]: xp [B,T+W-1,C], w [W,C] -> y [B,T,C]."""
    T = xp.shape[1] - w.shape[0] + 1
    return sum(xp[:, j:j + T, :] * w[j] for j in range(w.shape[0]))


def _taps_fwd(xp, w):
    return _taps(xp, w), (xp, w)


def _taps_bwd(res, dy):
    """The same cotangents as autodiff, with each tap's weight gradient summed over the rows
    of a materialised [B*T,C] product: autodiff sums over axes (0, 1) of a strided [B,T,C]
    slice, which XLA:CPU runs as a windowed reduction, several times slower (docs/speed.md).
    Each cotangent has its primal's dtype; the
    weight gradient's row sums accumulate in f32."""
    xp, w = res
    W, T, C = w.shape[0], dy.shape[1], w.shape[1]
    dyp = jnp.pad(dy, [(0, 0), (W - 1, W - 1), (0, 0)])  # [B,T+2W-2,C]
    dxp = sum(dyp[:, W - 1 - j:W - 1 - j + xp.shape[1], :] * w[j] for j in range(W))
    dw = jnp.stack([
        jnp.sum(jax.lax.optimization_barrier((xp[:, j:j + T, :] * dy).reshape(-1, C)), axis=0,
                dtype=jnp.float32)
        for j in range(W)])  # [W,C]
    return dxp.astype(xp.dtype), dw.astype(w.dtype)


_taps.defvjp(_taps_fwd, _taps_bwd)


def causal_depthwise_conv(x: jax.Array, w: jax.Array, window: jax.Array,
                          lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv with a carried window.

    x: [B,T,C] new inputs; w: [W,C]; window: [B,W-1,C] the previous W-1 inputs (zeros at start);
    lengths: [B] number of valid new inputs per row. Returns (y [B,T,C], new window [B,W-1,C]
    = the last W-1 inputs up to each row's length).
    """
    W = w.shape[0]
    xp = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B,W-1+T,C]
    y = _taps(xp, w)  # [B,T,C]
    new_window = jax.vmap(
        lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, W - 1, axis=0))(xp, lengths)
    return y, new_window


class KDALayer(nn.Module):
    cfg: KDAConfig
    d_model: int
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, valid, positions=None, cache=None, offset=None, step_caches=False):
        """x: [B,T,D]; valid: [B,T] bool. Returns (out [B,T,D], new cache or None, aux {}).

        positions and offset are unused (KDA carries position in its state); they keep the
        attention-layer signature uniform. step_caches (with a cache; speculative verification
        of a few tokens): the returned cache holds the candidates after 0..T of the new tokens,
        {"conv": [T+1,B,W-1,C], "state": [T+1,B,H,K,V]}; `select_step_cache` keeps one per row.
        """
        del positions, offset
        c = self.cfg
        B, T, _ = x.shape
        H, K, V, W = c.num_heads, c.k_dim, c.v_dim, c.conv_size
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        C = H * (2 * K + V)

        qkv = dense(C, ("embed", "heads"), "qkv", **kw)(x)  # [B,T,C]
        conv_w = self.param("conv", nn.with_logical_partitioning(
            nn.initializers.normal(W ** -0.5), ("conv", "heads")), (W, C), self.param_dtype)
        lengths = jnp.sum(valid, axis=1).astype(jnp.int32)  # [B]
        window = cache["conv"] if cache is not None else jnp.zeros((B, W - 1, C), qkv.dtype)
        if step_caches:  # the conv window after each prefix 0..T of the new inputs
            xp = jnp.concatenate([window.astype(qkv.dtype), qkv], axis=1)  # [B,W-1+T,C]
            step_windows = jnp.stack([xp[:, j:j + W - 1] for j in range(T + 1)])
        qkv, new_window = causal_depthwise_conv(qkv, conv_w.astype(qkv.dtype), window, lengths)
        qkv = nn.silu(qkv)
        q, k, v = jnp.split(qkv, [H * K, 2 * H * K], axis=-1)
        q = l2_normalize(q.reshape(B, T, H, K))  # [B,T,H,K]
        k = l2_normalize(k.reshape(B, T, H, K))  # [B,T,H,K]
        v = v.reshape(B, T, H, V)  # [B,T,H,V]

        # Low-rank channel-wise decay gate.
        f = dense(c.rank, ("embed", "rank"), "gate_down", **kw)(x)
        f = dense(H * K, ("rank", "heads"), "gate_up", **kw)(f).reshape(B * T, H * K)
        a_log = self.param("A_log", nn.with_logical_partitioning(
            lambda key, s, d: jnp.log(jax.random.uniform(key, s, d, 1.0, 16.0)), ("heads",)),
            (H,), jnp.float32)
        dt_bias = self.param("dt_bias", nn.with_logical_partitioning(
            _dt_bias_init, ("heads",)), (H * K,), jnp.float32)
        # On the [B*T, H*K] view: the gradients of dt_bias and A_log then sum over one leading
        # axis (norms.scale_rows says why that is several times faster on XLA:CPU).
        f = f.astype(jnp.float32) + dt_bias  # [B*T,H*K]
        a = jnp.repeat(jnp.exp(a_log), K)  # [H*K]
        if c.gate_lower_bound is None:
            g = -a * jax.nn.softplus(f)
        else:
            g = c.gate_lower_bound * jax.nn.sigmoid(a * f)
        g = g.reshape(B, T, H, K)  # [B,T,H,K]
        beta = jax.nn.sigmoid(
            dense(H, ("embed", "heads"), "beta", **kw)(x).astype(jnp.float32))  # [B,T,H]
        g = jnp.where(valid[:, :, None, None], g, 0.0)
        beta = jnp.where(valid[:, :, None], beta, 0.0)

        state = cache["state"] if cache is not None else None
        if cache is not None and step_caches:  # T is small: one recurrent step per token
            states, outs = [state], []
            for j in range(T):
                o_j, s_j = kda_ops.kda_step(q[:, j], k[:, j], v[:, j], g[:, j], beta[:, j],
                                            states[-1])
                outs.append(o_j)
                states.append(s_j)
            o, new_state = jnp.stack(outs, axis=1), jnp.stack(states)  # [B,T,H,V], [T+1,B,H,K,V]
            new_window = step_windows
        elif cache is not None and T == 1:
            o, new_state = kda_ops.kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
            o = o[:, None]
        else:
            o, new_state = kda_ops.kda(q, k, v, g, beta, initial_state=state,
                                       output_final_state=cache is not None,
                                       chunk_size=c.chunk_size, impl=self._impl(T, cache))
        # o: [B,T,H,V]

        norm_w = self.param("o_norm", nn.with_logical_partitioning(
            nn.initializers.ones, ("norm",)), (V,), self.param_dtype)
        o = rms_norm(o.astype(jnp.float32), norm_w, self.eps)
        gate = dense(c.rank, ("embed", "rank"), "ogate_down", **kw)(x)
        gate = dense(H * V, ("rank", "heads"), "ogate_up", **kw)(gate).reshape(B, T, H, V)
        o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dtype)
        out = dense(self.d_model, ("heads", "embed"), "out", **kw)(o.reshape(B, T, H * V))
        new_cache = None if cache is None else {"conv": new_window.astype(cache["conv"].dtype),
                                                "state": new_state}
        return out, new_cache, {}

    def _impl(self, T: int, cache) -> str:
        """`cfg.impl`, or "recurrent" for a short cached call (`KDAConfig.recurrent_max_len`)
        when `impl` resolves to a pure-JAX form on this platform."""
        c = self.cfg
        if cache is None or T > c.recurrent_max_len:
            return c.impl
        if kda_ops.DISPATCH.resolve(c.impl, K=c.k_dim, V=c.v_dim, dtype=self.dtype) == "pallas":
            return c.impl
        return "recurrent"

    @staticmethod
    def select_step_cache(step_cache: KDACache, n: jax.Array) -> KDACache:
        """From step_caches candidates keep, per row b, the one after n[b] new tokens."""
        rows = jnp.arange(n.shape[0])
        return {key: val[n, rows] for key, val in step_cache.items()}

    @staticmethod
    def init_cache(cfg: KDAConfig, batch: int, max_len: int, dtype) -> KDACache:
        del max_len  # O(1) state: independent of context length
        C = cfg.num_heads * (2 * cfg.k_dim + cfg.v_dim)
        return {"conv": jnp.zeros((batch, cfg.conv_size - 1, C), dtype),
                "state": jnp.zeros((batch, cfg.num_heads, cfg.k_dim, cfg.v_dim), jnp.float32)}


def _dt_bias_init(key, shape, dtype):
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)  # inverse softplus


def _device_slice(cfg: KDAConfig, heads, kernels: str) -> KDAConfig:
    """One device's share under tensor parallelism (heads split) with the kernels impl=`kernels`
    runs on GPU/TPU ("pallas": what 'auto' picks there for these head dims)."""
    impl = kernels
    if kernels == "pallas":
        impl = "pallas" if kda_ops.DISPATCH.choose(
            "auto", platform="gpu", K=cfg.k_dim, V=cfg.v_dim)[0] == "pallas" else "xla"
    return dataclasses.replace(cfg, num_heads=heads(cfg.num_heads), impl=impl)


KIND = LayerKind(
    name="kda", section="kda", layer=KDALayer, config=KDAConfig,
    # the state's heads follow the tensor axis; the conv window's channels concatenate q, k and
    # v of every head and stay whole (model/sharding.py:cache_axes reads this table)
    cache_axes={"state": ("batch", "act_heads", None, None), "conv": ("batch", None, None)},
    device_slice=_device_slice,
)
