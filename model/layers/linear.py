"""Dense projection with logical sharding axes on its kernel, and the SwiGLU MLP."""

import flax.linen as nn
import jax
import jax.numpy as jnp


def dense(features: int, axes: tuple[str, str], name: str, *, dtype=jnp.float32,
          param_dtype=jnp.float32, use_bias: bool = False, scale: float = 1.0) -> nn.Dense:
    init = nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=nn.with_logical_partitioning(init, axes), name=name)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used for dense and shared experts."""

    hidden: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        g = dense(self.hidden, ("embed", "mlp"), "gate", **kw)(x)
        u = dense(self.hidden, ("embed", "mlp"), "up", **kw)(x)
        return dense(d, ("mlp", "embed"), "down", **kw)(nn.silu(g) * u)
