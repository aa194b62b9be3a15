"""Sparse Mixture-of-Experts feed-forward: routing math as pure functions under a thin module.

Routers (pure): `route(...)` for "softmax" top-k (weights from the softmax) and "sigmoid" with an
auxiliary-loss-free bias (DeepSeek-V3: the bias only changes which experts are selected, the
weights come from the unbiased sigmoid scores). Top-k weights optionally renormalised, then scaled
by `routed_scaling_factor`. `seq_balance_loss` is DeepSeek-V3's sequence-wise balance loss;
`aux_free_bias_update` the bias step; `router_stats` the logged statistics.

Dispatch: "dropless" sorts token-expert assignments by expert and runs a grouped matmul
(`lax.ragged_dot`, or the grouped MXFP4 kernel); "capacity" scatters into [E, C, D] buffers with
C = ceil(capacity_factor * N * k / E), drops (and counts) assignments past capacity in token order
and runs batched einsums. Shared experts are a dense SwiGLU MLP added to every token.

Expert weights are [E, D, F] (gate, up) and [E, F, D] (down) in bf16/f32, or, with
expert_format="mxfp4", packed MXFP4 stored [E, out, in/32, 16] + scales [E, out, in/32] (the
kernels' x @ W.T layout; model/quant.py converts between the two).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config import MoEConfig
from model.layers.linear import MLP
from pallas_kernels.mxfp4 import ops as mx


# --------------------------------------------------------------------------- routing (pure)
def route(logits: jax.Array, bias: jax.Array, *, router: str, top_k: int, norm_topk_prob: bool,
          scaling: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [N,E] f32 -> (weights [N,k], experts [N,k] int32, probs [N,E] normalised scores)."""
    if router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        _, idx = jax.lax.top_k(scores, top_k)
    elif router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        _, idx = jax.lax.top_k(scores + bias, top_k)  # bias steers selection only
    else:
        raise ValueError(f"unknown router {router!r}; valid: softmax, sigmoid")
    w = jnp.take_along_axis(scores, idx, axis=-1)  # [N,k]
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return w * scaling, idx.astype(jnp.int32), probs


def seq_balance_loss(probs: jax.Array, idx: jax.Array, valid: jax.Array, num_experts: int
                     ) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss (without alpha), mean over sequences.

    probs [B,T,E], idx [B,T,k], valid [B,T]. f_i = E/(k T_b) * #{t: i in topk(t)},
    P_i = mean_t probs[t,i]; L_b = sum_i f_i P_i. Uniform routing gives exactly 1.
    """
    k = idx.shape[-1]
    v = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v, axis=1), 1.0)  # [B]
    hits = jnp.sum(jax.nn.one_hot(idx, num_experts) * v[..., None, None], axis=(1, 2))  # [B,E]
    f = hits * num_experts / (k * n[:, None])
    p = jnp.sum(probs * v[..., None], axis=1) / n[:, None]  # [B,E]
    return jnp.mean(jnp.sum(f * p, axis=-1))


def expert_counts(idx: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Assignments per expert over valid tokens: idx [N,k], valid [N] -> [E] f32."""
    return jnp.sum(jax.nn.one_hot(idx, num_experts) * valid[:, None, None], axis=(0, 1))


def aux_free_bias_update(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """bias_i += rate * sign(mean load - load_i): overloaded experts get selected less."""
    return bias + rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)


def router_stats(counts: jax.Array, probs: jax.Array, valid: jax.Array, dropped: jax.Array
                 ) -> dict:
    """counts [E] assignments, probs [N,E], valid [N], dropped scalar count of dropped assignments."""
    total = jnp.maximum(jnp.sum(counts), 1.0)
    load = counts / total
    mean = 1.0 / counts.shape[-1]
    ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-20)), axis=-1)
    nv = jnp.maximum(jnp.sum(valid), 1.0)
    return {
        "load": load,  # [E] fraction of assignments per expert
        "max_vio": jnp.max(load) / mean - 1.0,
        "dead_experts": jnp.sum(counts == 0).astype(jnp.float32),
        "routing_entropy": jnp.sum(ent * valid) / nv,
        "dropped_fraction": dropped / total,
    }


# --------------------------------------------------------------------------- expert compute
def _swiglu(h_gate, h_up):
    return nn.silu(h_gate) * h_up


def dropless_experts(x, weights, idx, experts, num_experts):
    """x [N,D], weights/idx [N,k]; experts: callables (gate, up, down)(x_sorted, group_sizes)."""
    N, k = idx.shape
    flat_e = idx.reshape(-1)  # [N*k]
    order = jnp.argsort(flat_e, stable=True)
    token = order // k  # token of each sorted assignment
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    xs = x[token]  # [N*k,D]
    gate, up, down = experts
    h = _swiglu(gate(xs, group_sizes), up(xs, group_sizes))
    ys = down(h, group_sizes)  # [N*k,D]
    ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
    return jax.ops.segment_sum(ys, token, num_segments=N), jnp.zeros((), jnp.float32)


def capacity_experts(x, weights, idx, valid, experts, num_experts, capacity):
    """Capacity-padded dispatch. Returns (y [N,D], dropped assignments count)."""
    N, k = idx.shape
    flat_e = idx.reshape(-1)  # [N*k] in token order
    flat_valid = jnp.repeat(valid, k)
    onehot = jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32) * flat_valid[:, None]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # slot within expert
    keep = flat_valid & (pos < capacity)
    dropped = jnp.sum(flat_valid & ~keep).astype(jnp.float32)
    slot = jnp.where(keep, flat_e * capacity + pos, num_experts * capacity)  # overflow row
    token = jnp.arange(N * k) // k
    buf = jnp.zeros((num_experts * capacity + 1, x.shape[-1]), x.dtype).at[slot].set(x[token])
    buf = buf[:-1].reshape(num_experts, capacity, -1)  # [E,C,D]
    gate, up, down = experts
    y = down(_swiglu(gate(buf), up(buf)))  # [E,C,D]
    y = jnp.concatenate([y.reshape(num_experts * capacity, -1),
                         jnp.zeros((1, y.shape[-1]), y.dtype)])
    contrib = y[slot] * (weights.reshape(-1) * keep)[:, None].astype(y.dtype)
    return jax.ops.segment_sum(contrib, token, num_segments=N), dropped


class MoE(nn.Module):
    cfg: MoEConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _expert_weight(self, name, E, d_in, d_out):
        """Returns a function of the grouped/batched activations for one expert matrix."""
        c = self.cfg
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=-2, out_axis=-1, batch_axis=(0,))
        if c.expert_format == "mxfp4":
            if self.is_initializing():
                w = init(self.make_rng("params"), (E, d_out, d_in), jnp.float32)
                q = mx.quantize(w, axis=-1)
                blocks0, scales0 = q.blocks, q.scales
            else:
                blocks0 = scales0 = None
            blocks = self.param(f"{name}_blocks", nn.with_logical_partitioning(
                lambda *_: blocks0, ("expert", "mlp_out", "blocks", "nibbles")))
            scales = self.param(f"{name}_scales", nn.with_logical_partitioning(
                lambda *_: scales0, ("expert", "mlp_out", "blocks")))
            w = mx.MXFP4(blocks, scales)
            impl = c.mxfp4_impl

            def grouped(xs, gs=None):
                if gs is None:  # capacity buffers [E,C,D]
                    return jax.vmap(lambda xe, be, se: mx.mxfp4_matmul(
                        xe, mx.MXFP4(be, se), impl=impl))(xs, w.blocks, w.scales)
                return mx.grouped_mxfp4_matmul(xs, w, gs, impl=impl)
            return grouped

        kernel = self.param(name, nn.with_logical_partitioning(
            init, ("expert", "embed" if d_in == self.d_model else "mlp",
                   "mlp" if d_out != self.d_model else "embed")), (E, d_in, d_out),
            self.param_dtype)
        if c.qat:
            kernel = jnp.swapaxes(mx.fake_quant(jnp.swapaxes(kernel, -1, -2), axis=-1), -1, -2)
        kernel = kernel.astype(self.dtype)

        def grouped(xs, gs=None):
            if gs is None:
                return jnp.einsum("ecd,edf->ecf", xs, kernel)
            return jax.lax.ragged_dot(xs, kernel, gs)
        return grouped

    @nn.compact
    def __call__(self, x, *, valid):
        """x [B,T,D], valid [B,T] -> (y [B,T,D], aux dict)."""
        c = self.cfg
        B, T, D = x.shape
        E, k, F = c.num_experts, c.num_experts_per_tok, c.expert_dim
        router_w = self.param("router", nn.with_logical_partitioning(
            nn.initializers.normal(D ** -0.5), ("embed", "expert")), (D, E), jnp.float32)
        bias = self.variable("router_state", "bias", lambda: jnp.zeros((E,), jnp.float32)).value
        xf = x.reshape(B * T, D)
        vf = valid.reshape(B * T)
        logits = jnp.einsum("nd,de->ne", xf.astype(jnp.float32), router_w)  # [N,E]
        w, idx, probs = route(logits, jax.lax.stop_gradient(bias), router=c.router, top_k=k,
                              norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor)
        w = w * vf[:, None]
        experts = (self._expert_weight("w_gate", E, D, F), self._expert_weight("w_up", E, D, F),
                   self._expert_weight("w_down", E, F, D))
        if c.dispatch == "dropless":
            y, dropped = dropless_experts(xf, w, idx, experts, E)
        else:
            cap = max(1, math.ceil(c.capacity_factor * B * T * k / E))
            y, dropped = capacity_experts(xf, w, idx, vf, experts, E, cap)
        y = y.reshape(B, T, D).astype(x.dtype)
        if c.num_shared_experts > 0:
            y = y + MLP(F * c.num_shared_experts, dtype=self.dtype, param_dtype=self.param_dtype,
                        name="shared")(x)
        counts = expert_counts(idx, vf.astype(jnp.float32), E)
        aux = {
            "balance_loss": seq_balance_loss(probs.reshape(B, T, E), idx.reshape(B, T, k),
                                             valid, E),
            "expert_counts": counts,
            "router": router_stats(counts, probs, vf.astype(jnp.float32), dropped),
        }
        return y, aux
