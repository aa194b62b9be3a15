"""Normalisation layers (f32 statistics, output in the input's dtype)."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """x / rms(x) * weight over the last axis; statistics in f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = scale_rows(y, weight.astype(jnp.float32))
    return y.astype(x.dtype)


def scale_rows(y: jax.Array, w: jax.Array) -> jax.Array:
    """y [..., C] * w [C], multiplied on the [rows, C] view of y. Same values; what changes is
    w's gradient: autodiff sums y * dy over one leading axis instead of several, and XLA:CPU
    runs a sum over axes (0, 1) of [B,T,C] as a windowed reduction, several times slower than
    over axis 0 of [B*T,C] (docs/speed.md)."""
    return (y.reshape(-1, y.shape[-1]) * w).reshape(y.shape)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.param_dtype)
        return rms_norm(x, w, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with f32 statistics (the DSA indexer's key norm)."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        w = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (d,), self.param_dtype)
        b = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                       (d,), self.param_dtype)
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, -1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
        y = ((xf - mu) * jax.lax.rsqrt(var + self.eps)).reshape(-1, d)  # [rows,d]
        # scale and bias on the [rows, d] view: their gradients sum over one leading axis
        # (scale_rows says why)
        return (y * w + b).reshape(x.shape).astype(x.dtype)
