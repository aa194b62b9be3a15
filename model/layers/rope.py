"""Rotary position embeddings, non-interleaved ("rotate half") form.

Positions are explicit [B,T] int arrays so batch rows at different decode positions work.
`apply_rope(x, positions, theta, rope_dim=None)` rotates the first `rope_dim` channels of the last
axis (partial RoPE, as in the DeepSeek-V3.2 indexer) and leaves the rest untouched.
"""

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [*positions.shape, dim/2] in f32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [dim/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,dim/2]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               rope_dim: int | None = None) -> jax.Array:
    """x: [B,T,(H,)D]; positions: [B,T]. Rotates x[..., :rope_dim] (default: all of D)."""
    d = x.shape[-1] if rope_dim is None else rope_dim
    if d == 0:
        return x
    cos, sin = rope_angles(positions, d, theta)  # [B,T,d/2]
    if x.ndim == 4:  # [B,T,H,D]: broadcast over heads
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xr, xp = x[..., :d].astype(jnp.float32), x[..., d:]
    x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rot.astype(x.dtype), xp], axis=-1)
