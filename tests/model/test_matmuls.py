"""The model's two hand-routed matmuls against the jax ops they replace.

Covered:
  `linear` (model/layers/linear.py, x @ w over flattened rows): value and gradients
    (w.r.t. x and w, through a following SiLU, as in the layers) equal autodiff of `x @ w`
    for [B,T,D] and [N,D] inputs; bf16 inputs give bf16 gradients. `Dense` has nn.Dense's
    parameter tree (name, shape, logical axes) and output, with and without bias.
  `blocked_grouped_matmul` (model/layers/moe.py, XLA:CPU's grouped matmul for dropless MoE)
    equals `lax.ragged_dot` in value and in both gradients, for prefill- and decode-sized row
    counts, empty groups, one group holding every row, rows past the groups' total (zeros),
    and explicit block sizes that do not divide the groups.
Not covered here: speed (benchmarks/grpo_matched.py measures the train step; the docstrings give
the micro-benchmarks), the MoE layer's routing (tests/model/test_layers.py, test_model.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.layers.linear import dense, linear
from model.layers.moe import blocked_grouped_matmul


def _loss_linear(fn, x, w, r):
    return jnp.sum(jax.nn.silu(fn(x, w)) * r)


@pytest.mark.parametrize("x_shape", [(2, 5, 8), (7, 8)])
def test_linear_matches_autodiff(x_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 12)), jnp.float32)
    r = jnp.asarray(rng.standard_normal(x_shape[:-1] + (12,)), jnp.float32)
    np.testing.assert_allclose(linear(x, w), x @ w, rtol=1e-6, atol=1e-6)
    got = jax.grad(_loss_linear, argnums=(1, 2))(linear, x, w, r)
    want = jax.grad(_loss_linear, argnums=(1, 2))(lambda a, b: a @ b, x, w, r)
    for g, h in zip(got, want):
        assert g.shape == h.shape
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_linear_bf16_gradients_keep_dtypes():
    x = jnp.ones((3, 4), jnp.bfloat16)
    w = jnp.full((4, 2), 0.5, jnp.bfloat16)
    dx, dw = jax.grad(lambda a, b: jnp.sum(linear(a, b).astype(jnp.float32)), (0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx, np.float32), 1.0)  # row sums of w: 2 * 0.5
    np.testing.assert_allclose(np.asarray(dw, np.float32), 3.0)  # column sums of x


@pytest.mark.parametrize("use_bias", [False, True])
def test_dense_has_nn_dense_parameters_and_output(use_bias):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 6)), jnp.float32)
    mine = dense(5, ("embed", "mlp"), "proj", use_bias=use_bias)
    theirs = nn.Dense(5, use_bias=use_bias, name="proj", kernel_init=nn.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), ("embed", "mlp")))
    v_mine = mine.init(jax.random.key(0), x)
    v_theirs = theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(v_mine) == jax.tree.structure(v_theirs)
    assert tuple(nn.get_partition_spec(v_mine)["params"]["kernel"]) == ("embed", "mlp")
    params = nn.meta.unbox(v_mine)
    params = jax.tree.map(lambda a: a + 0.1, params)  # a non-zero bias
    np.testing.assert_allclose(mine.apply(params, x), theirs.apply(params, x), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("sizes, M, block", [
    ((40, 0, 23, 1), 64, None),   # an empty group; prefill-sized block chooser
    ((5, 3, 0, 8), 16, None),     # decode-sized: 2 rows per group on average
    ((0, 0, 30, 0), 30, None),    # every row in one group
    ((7, 9, 4, 2), 30, None),     # rows past the groups' total (8 of them) come back as zeros
    ((17, 13, 11, 9), 50, 8),     # explicit block that divides no group
])
def test_blocked_grouped_matmul_equals_ragged_dot(sizes, M, block):
    rng = np.random.default_rng(2)
    E, D, F = len(sizes), 6, 5
    gs = jnp.asarray(sizes, jnp.int32)
    xs = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)
    got = blocked_grouped_matmul(xs, w, gs, block)
    want = jax.lax.ragged_dot(xs, w, gs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[sum(sizes):], 0.0)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b) * r)

    g_got = jax.grad(loss, (1, 2))(lambda a, b: blocked_grouped_matmul(a, b, gs, block), xs, w)
    g_want = jax.grad(loss, (1, 2))(lambda a, b: jax.lax.ragged_dot(a, b, gs), xs, w)
    for g, h in zip(g_got, g_want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)
