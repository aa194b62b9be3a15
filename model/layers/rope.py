"""Rotary position embeddings, non-interleaved ("rotate half") form, with optional YaRN scaling.

Positions are explicit [B,T] int arrays so batch rows at different decode positions work.
`apply_rope(x, positions, theta, rope_dim=None)` rotates the first `rope_dim` channels of the last
axis (partial RoPE, as in the DeepSeek-V3.2 indexer) and leaves the rest untouched. With
`scaling=YaRN(...)` the rotation frequencies are YaRN's; the attention-scale correction is the
caller's (`YaRN.softmax_scale_factor`, `YaRN.rope_magnitude`; model/layers/dsa.py applies them).

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
arXiv:2309.00071), in the discretised form of DeepSeek-V3's code (HF `modeling_deepseek.py`:
`yarn_find_correction_range`, `yarn_linear_ramp_mask`, `DeepseekV3YarnRotaryEmbedding`,
`yarn_get_mscale`; the same in DeepSeek-V3's `inference/model.py:precompute_freqs_cis`), which is
the convention followed here, for d = rope dim, base theta, factor s, original length L:

    theta_i   = base ** (-2i / d),  i = 0 .. d/2-1                    (plain RoPE frequencies)
    corr(b)   = d * ln(L / (2 pi b)) / (2 ln base)     the index i whose wavelength fits b times in L
    low, high = max(floor(corr(beta_fast)), 0), min(ceil(corr(beta_slow)), d - 1)
    ramp_i    = clip((i - low) / (high - low), 0, 1)      (high += 0.001 when low == high)
    inv_freq_i = theta_i / s * ramp_i + theta_i * (1 - ramp_i)
    mscale(s, m) = 0.1 * m * ln(s) + 1   (1 when s <= 1)

so high-frequency dims (i <= low: more than beta_fast rotations over L) keep their frequency,
low-frequency dims (i >= high: fewer than beta_slow rotations) are interpolated by 1/s, and the
ramp blends linearly in i between. The paper's attention temperature sqrt(1/t) = 0.1 ln(s) + 1
multiplies both q and k; DeepSeek applies it as `softmax_scale *= mscale(s, mscale_all_dim)**2`
(all q.k channels, not only the rotary ones) and scales the rotary cos/sin by
mscale(s, mscale) / mscale(s, mscale_all_dim) (1 with DeepSeek-V3's mscale = mscale_all_dim = 1).
Both are reproduced here. Unlike DeepSeek's inference code, which turns YaRN off when the serving
length is <= L, the frequencies here depend only on the config (HF's static form): a model
trained with YaRN sees the same rotation at every length. At s = 1 (factor 1) everything reduces
to plain RoPE exactly (same code path). Not covered: dynamic (length-dependent) YaRN, NTK-aware
and linear interpolation variants.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class YaRN:
    """YaRN parameters (see the module docstring for the formula and convention)."""

    factor: float  # s
    original_max_position: int  # L
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def softmax_scale_factor(self) -> float:
        """Multiplier of the attention softmax scale: mscale(s, mscale_all_dim)**2."""
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m

    def rope_magnitude(self) -> float:
        """Multiplier of the rotated channels (of q and k each): mscale(s, mscale) /
        mscale(s, mscale_all_dim)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """0.1 * m * ln(factor) + 1, and 1 for factor <= 1."""
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def yarn_ramp(dim: int, theta: float, y: YaRN) -> np.ndarray:
    """[dim/2] f64 weights of the interpolated frequency theta_i / s (1 - weight: theta_i)."""
    def corr(rotations: float) -> float:
        return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(corr(y.beta_fast)), 0)
    high = min(math.ceil(corr(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    return np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def rope_inv_freq(dim: int, theta: float, scaling: YaRN | None = None) -> jax.Array:
    """[dim/2] f32 rotation frequencies: plain RoPE, or YaRN's when scaling is active."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [dim/2]
    if scaling is None or not scaling.active:
        return inv_freq
    w = jnp.asarray(yarn_ramp(dim, theta, scaling), jnp.float32)  # [dim/2]
    return inv_freq / scaling.factor * w + inv_freq * (1.0 - w)


def rope_angles(positions: jax.Array, dim: int, theta: float,
                scaling: YaRN | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [*positions.shape, dim/2] in f32."""
    inv_freq = rope_inv_freq(dim, theta, scaling)  # [dim/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,dim/2]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               rope_dim: int | None = None, *, scaling: YaRN | None = None) -> jax.Array:
    """x: [B,T,(H,)D]; positions: [B,T]. Rotates x[..., :rope_dim] (default: all of D) with plain
    RoPE frequencies, or YaRN's when `scaling` is given and active (no magnitude change here)."""
    d = x.shape[-1] if rope_dim is None else rope_dim
    if d == 0:
        return x
    cos, sin = rope_angles(positions, d, theta, scaling)  # [B,T,d/2]
    if x.ndim == 4:  # [B,T,H,D]: broadcast over heads
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xr, xp = x[..., :d].astype(jnp.float32), x[..., d:]
    x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rot.astype(x.dtype), xp], axis=-1)
