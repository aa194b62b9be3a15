"""Dense projection with logical sharding axes on its kernel, and the SwiGLU MLP.

`linear(x, w)` is x @ w computed on the flattened rows: [N,D] @ [D,C] with N = prod(x.shape[:-1]).
The value is the same; what changes is reverse mode. For x [B,T,D], autodiff of the batched
contraction gives dW = contraction of x and the cotangent g over both B and T, and XLA:CPU's
layout assignment then transposed g for that dot and fused the elementwise work that produces g
(an activation's derivative, the conv taps' sum) into the transposing copy, which ran 5-20x
slower than the same work untransposed. Over flattened rows dW is one [N,D]^T [N,C] matmul,
measured faster on its own and in the matched GRPO train step (`python -m
benchmarks.grpo_matched`; numbers in docs/speed.md). Same numbers up to f32 summation order
(tests/model/test_matmuls.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [...,D] @ w [D,C] -> [...,C], as one [N,D] @ [D,C] matmul (see the module docstring)."""
    rows = x.reshape(-1, x.shape[-1])  # [N,D]
    return jnp.dot(rows, w).reshape(*x.shape[:-1], w.shape[-1])


class Dense(nn.Module):
    """nn.Dense's parameters ("kernel" [D,C], optional "bias" [C]) and dtype promotion, applied
    through `linear` (its gradient's layout is the reason this exists; see the module docstring)."""

    features: int
    kernel_init: nn.initializers.Initializer
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,),
                           self.param_dtype) if self.use_bias else None)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = linear(x, kernel)
        return y if bias is None else y + bias


def dense(features: int, axes: tuple[str, str], name: str, *, dtype=jnp.float32,
          param_dtype=jnp.float32, use_bias: bool = False, scale: float = 1.0) -> Dense:
    init = nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
    return Dense(features, kernel_init=nn.with_logical_partitioning(init, axes),
                 use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, name=name)


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
