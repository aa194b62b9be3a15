"""Sparse Mixture-of-Experts feed-forward: routing math as pure functions under a thin module.

Routers (pure): `route(...)` for "softmax" top-k (weights from the softmax) and "sigmoid" with an
auxiliary-loss-free bias (DeepSeek-V3: the bias only changes which experts are selected, the
weights come from the unbiased sigmoid scores). Top-k weights optionally renormalised, then scaled
by `routed_scaling_factor`. `seq_balance_loss` is DeepSeek-V3's sequence-wise balance loss;
`aux_free_bias_update` the bias step; `router_stats` the logged statistics.

Dispatch: "dropless" sorts token-expert assignments by expert and runs a grouped matmul
(`grouped_matmul`: `lax.ragged_dot` on GPU/TPU, block-padded batched einsums on CPU, or the
grouped MXFP4 kernel); "capacity" scatters into [E, C, D] buffers with
C = ceil(capacity_factor * N * k / E), drops (and counts) assignments past capacity in token order
and runs batched einsums. With few tokens (a decode step; `takes_all_experts`) `all_experts`
runs every expert on every token and weights the outputs by the router (zero for unselected
experts): the same result without the sort, grouping or buffers. Shared experts are a dense
SwiGLU MLP added to every token.

Expert weights are [E, D, F] (gate, up) and [E, F, D] (down) in bf16/f32, or, with
expert_format="mxfp4", packed MXFP4 stored [E, out, in/32, 16] + scales [E, out, in/32] (the
kernels' x @ W.T layout; model/quant.py converts between the two).

Expert parallelism (`moe.expert_parallel`, active inside `model.sharding.use_mesh(mesh)`): routing
stays under GSPMD (so expert counts, router statistics and the balance loss are global sums over
all shards, which is what the aux-free bias update and the logs use), and only the expert compute
runs under `shard_map`: tokens are split over the mesh's batch axes (rules["batch"]), experts over
the "expert" axis, expert_dim F over the tensor axis (partial down-projections are psum'ed), and
FSDP-split weight dims are all-gathered by XLA at the shard_map boundary.

  "all_to_all"         capacity-padded [E, C, D] buffers exchanged with `lax.all_to_all` (runs
                       on every backend, CPU included). C per (source shard, expert):
                       ceil(capacity_factor * n_local * k / E) with dispatch="capacity" (drops
                       past C, counted), n_local with dispatch="dropless" (exact, no drops).
  "ragged_all_to_all"  sorted assignments exchanged with `lax.ragged_all_to_all` and a grouped
                       matmul on the receiver (GPU/TPU; XLA:CPU has no ragged all-to-all, so this
                       raises on CPU). Receive buffer per shard: ceil(capacity_factor * n_local *
                       k) rows with dispatch="capacity" (overflow dropped and counted),
                       ep * n_local * min(k, E_local) rows (worst case, exact) with "dropless".
Without an active mesh (or when the local token count is not divisible by the batch axes
including the expert axis) the local dispatch named by `dispatch` runs; with one shard it has the
same capacity semantics. Dropped counts are psum'ed over the shards.
"""

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model import sharding as shd
from model.config_base import GROUPED_MATMUL, MoEConfig
from model.layers.linear import MLP
from pallas_kernels.mxfp4 import ops as mx


# --------------------------------------------------------------------------- routing (pure)
def group_limited(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """choice [N,E] selection scores with every expert outside the topk_group best of n_group
    equal groups set to -inf; a group's score is the sum of its two highest choice scores
    (DeepSeek-V3's group-limited routing). n_group=1 returns choice unchanged."""
    if n_group == 1:
        return choice
    N, E = choice.shape
    grouped = choice.reshape(N, n_group, E // n_group)  # [N,G,E/G]
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N,G]
    _, best = jax.lax.top_k(group_scores, topk_group)  # [N,topk_group]
    keep = jnp.any(jnp.arange(n_group)[None, :, None] == best[:, None, :], axis=-1)  # [N,G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)


def route(logits: jax.Array, bias: jax.Array, *, router: str, top_k: int, norm_topk_prob: bool,
          scaling: float, n_group: int = 1, topk_group: int = 1
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [N,E] f32 -> (weights [N,k], experts [N,k] int32, probs [N,E] normalised scores).
    n_group/topk_group: group-limited selection (sigmoid router; `group_limited`)."""
    if router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        _, idx = jax.lax.top_k(scores, top_k)
    elif router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        # bias steers selection only
        _, idx = jax.lax.top_k(group_limited(scores + bias, n_group, topk_group), top_k)
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


def all_experts(x, weights, idx, experts, num_experts):
    """Every expert on every token, each output weighted by the token's router weight for that
    expert (zero where the expert is not in its top-k): the dropless result, without sorting,
    grouping or capacity buffers. E/k times the routed multiply-adds, so only for few tokens
    (decode; `takes_all_experts`): at the matched benchmark's layer it is faster than the
    grouped path at decode sizes and even around 512 tokens (docs/speed.md). Plain kernels
    contract the expert axis inside the down
    projection ("nef,efd->nd"); MXFP4 ones run per expert and sum.
    x [N,D], weights/idx [N,k] -> (y [N,D], 0 dropped)."""
    N, D = x.shape
    comb = jnp.zeros((N, num_experts), weights.dtype).at[
        jnp.arange(N)[:, None], idx].add(weights)  # [N,E]: the router weight of each expert
    gate, up, down = experts
    if all(getattr(m.fn, "func", None) is _dense_apply for m in experts):
        (wg,), (wu,), (wd,) = gate.arrays, up.arrays, down.arrays  # [E,D,F] x2, [E,F,D]
        F = wg.shape[-1]
        # Gate and up as one [D, E*2F] matmul. The transposes are written out, feeding a
        # concatenation, so that inside a decode loop XLA hoists all three out of the loop
        # (the weights are loop invariant; it hoists a transpose only with a user it can
        # hoist); left to the dot's layout assignment they are a copy of every expert weight
        # on every step (docs/speed.md: ce14a03).
        w = jnp.concatenate([wg.transpose(1, 0, 2), wu.transpose(1, 0, 2)],
                            axis=-1).reshape(D, -1)  # [D,E*2F]
        h2 = (x @ w).reshape(N, num_experts, 2 * F)  # [N,E,2F]
        h = _swiglu(h2[..., :F], h2[..., F:])  # [N,E,F]
        h = h * comb[:, :, None].astype(h.dtype)  # [N,E,F]
        return jnp.einsum("nef,efd->nd", h, wd), jnp.zeros((), jnp.float32)
    xs = jnp.broadcast_to(x[None], (num_experts, N, D))  # [E,N,D]
    h = _swiglu(gate(xs), up(xs)) * comb.T[:, :, None].astype(x.dtype)  # [E,N,F]
    return jnp.sum(down(h), axis=0), jnp.zeros((), jnp.float32)  # [N,D]


ALL_EXPERTS_MAX_FACTOR = 8  # all_experts does E/k times the routed multiply-adds


def expert_capacity(c: MoEConfig, n_tokens: int) -> int:
    """The capacity dispatch's rows per expert for n_tokens: ceil(capacity_factor * N * k / E)."""
    return max(1, math.ceil(c.capacity_factor * n_tokens * c.num_experts_per_tok
                            / c.num_experts))


def takes_all_experts(c: MoEConfig, n_tokens: int) -> bool:
    """Whether the local dispatch of n_tokens runs `all_experts`: no assignment can be dropped
    (dropless, or a capacity >= n_tokens: an expert gets at most n_tokens), n_tokens x E <=
    moe.all_experts_max_rows, and E/k <= ALL_EXPERTS_MAX_FACTOR (with many experts per selected
    one, a few tokens would read every expert's weights: the 1000-expert preset never takes it)."""
    E, k = c.num_experts, c.num_experts_per_tok
    no_drops = c.dispatch == "dropless" or expert_capacity(c, n_tokens) >= n_tokens
    return (no_drops and n_tokens * E <= c.all_experts_max_rows
            and E <= ALL_EXPERTS_MAX_FACTOR * k)


def _capacity_slots(idx, valid, num_experts, capacity):
    """Slot of every assignment in [E*C] buffers (E*C = overflow row), in token order.
    Returns (slot [N*k], keep [N*k], token [N*k], dropped count f32)."""
    N, k = idx.shape
    flat_e = idx.reshape(-1)  # [N*k] in token order
    flat_valid = jnp.repeat(valid, k)
    onehot = jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32) * flat_valid[:, None]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # slot within expert
    keep = flat_valid & (pos < capacity)
    dropped = jnp.sum(flat_valid & ~keep).astype(jnp.float32)
    slot = jnp.where(keep, flat_e * capacity + pos, num_experts * capacity)  # overflow row
    token = jnp.arange(N * k) // k
    return slot, keep, token, dropped


def _scatter_to_buffers(x, slot, token, num_experts, capacity):
    buf = jnp.zeros((num_experts * capacity + 1, x.shape[-1]), x.dtype).at[slot].set(x[token])
    return buf[:-1].reshape(num_experts, capacity, -1)  # [E,C,D]


def _combine_from_buffers(y, slot, keep, token, weights, N):
    E, C, D = y.shape
    y = jnp.concatenate([y.reshape(E * C, D), jnp.zeros((1, D), y.dtype)])
    contrib = y[slot] * (weights.reshape(-1) * keep)[:, None].astype(y.dtype)
    return jax.ops.segment_sum(contrib, token, num_segments=N)


def capacity_experts(x, weights, idx, valid, experts, num_experts, capacity):
    """Capacity-padded dispatch. Returns (y [N,D], dropped assignments count)."""
    N = idx.shape[0]
    slot, keep, token, dropped = _capacity_slots(idx, valid, num_experts, capacity)
    buf = _scatter_to_buffers(x, slot, token, num_experts, capacity)
    gate, up, down = experts
    y = down(_swiglu(gate(buf), up(buf)))  # [E,C,D]
    return _combine_from_buffers(y, slot, keep, token, weights, N), dropped


# --------------------------------------------------------------------------- expert parallel
@dataclasses.dataclass(frozen=True)
class ExpertMatrix:
    """One expert weight matrix as (arrays, fn): fn(arrays, xs, group_sizes=None) applies it to
    capacity buffers [E,C,in] (group_sizes None) or expert-sorted rows [M,in] (grouped).
    f_dims[i]: which dimension of arrays[i] runs along expert_dim F (split over the tensor axis
    under expert parallelism)."""

    arrays: tuple
    fn: Callable
    f_dims: tuple

    def __call__(self, xs, gs=None):
        return self.fn(self.arrays, xs, gs)


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _a2a_body(x, w, idx, valid, *arrays, fns, num_experts, capacity_factor, dropless, ep_axis,
              tp_axes, token_axes):
    """Per-shard capacity all_to_all dispatch. x [n,D], w/idx [n,k], valid [n]; arrays: the
    local expert shards ([E_loc, ...], F split over tp_axes)."""
    n, D = x.shape
    k = idx.shape[-1]
    E = num_experts
    ep = jax.lax.axis_size(ep_axis)
    E_loc = E // ep
    C = n if dropless else max(1, math.ceil(capacity_factor * n * k / E))
    slot, keep, token, dropped = _capacity_slots(idx, valid, E, C)
    buf = _scatter_to_buffers(x, slot, token, E, C).reshape(ep, E_loc, C, D)
    recv = jax.lax.all_to_all(buf, ep_axis, 0, 0)  # [ep source shards, E_loc, C, D]
    h_in = recv.transpose(1, 0, 2, 3).reshape(E_loc, ep * C, D)
    mats = _split_arrays(fns, arrays)
    gate, up, down = mats
    y = down(_swiglu(gate(h_in), up(h_in)))  # [E_loc, ep*C, D], partial over tp_axes
    if tp_axes:
        y = jax.lax.psum(y, tp_axes)
    y = y.reshape(E_loc, ep, C, D).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(y, ep_axis, 0, 0).reshape(E, C, D)  # global expert order
    out = _combine_from_buffers(back, slot, keep, token, w, n)
    return out, jax.lax.psum(dropped, token_axes)


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all` semantics built from all_gather (O(ep * rows) memory): the
    reference the ragged dispatch is tested against on CPU, where the real op is missing."""
    del recv_sizes  # equal to the senders' send_sizes by contract
    ep = jax.lax.axis_size(axis_name)
    K = input_offsets.shape[0]
    spd = K // ep  # slices per destination
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [ep, R, ...]
    io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes,
                                                                 output_offsets))  # [ep, K]
    R, M = operand.shape[0], output.shape[0]
    p = jnp.arange(M)
    res = output
    for i in range(ep):
        for j in range(spd):
            s = me * spd + j
            start_out, size, start_in = oo[i, s], ss[i, s], io[i, s]
            mask = (p >= start_out) & (p < start_out + size)
            src = jnp.clip(start_in + p - start_out, 0, R - 1)
            mask = mask.reshape((M,) + (1,) * (output.ndim - 1))
            res = jnp.where(mask, ops[i][src], res)
    return res


def _ragged_body(x, w, idx, valid, *arrays, fns, num_experts, capacity_factor, dropless,
                 ep_axis, tp_axes, token_axes, collective):
    """Per-shard dropless/buffered ragged all-to-all dispatch (see module docstring)."""
    n, D = x.shape
    k = idx.shape[-1]
    E = num_experts
    ep = jax.lax.axis_size(ep_axis)
    E_loc = E // ep
    me = jax.lax.axis_index(ep_axis)
    flat_v = jnp.repeat(valid, k)
    fe = jnp.where(flat_v, idx.reshape(-1), E)  # invalid assignments sort last, never sent
    order = jnp.argsort(fe, stable=True)
    token = order // k
    counts = jnp.bincount(fe, length=E).astype(jnp.int32)  # [E] my valid assignments
    xs = x[token]  # [n*k, D] sorted by expert
    if dropless:
        M = ep * n * min(k, E_loc)
    else:
        M = max(1, math.ceil(capacity_factor * n * k))
    Cm = jax.lax.all_gather(counts, ep_axis)  # [ep src, E]
    Cr = Cm.reshape(ep, ep, E_loc)  # [src, dst, l]
    # receiver layout: for local expert l, for source shard s: that chunk (sorted by expert)
    base_l = _exclusive_cumsum(jnp.sum(Cr, axis=0), axis=1)  # [dst, l]
    off = base_l[None] + _exclusive_cumsum(Cr, axis=0)  # [src, dst, l]
    eff = jnp.clip(M - off, 0, Cr)  # sizes after truncation at the buffer end
    off = jnp.where(eff > 0, off, 0)
    in_off = _exclusive_cumsum(counts, axis=0)
    recv = collective(xs, jnp.zeros((M, D), xs.dtype), in_off, eff[me].reshape(E),
                      off[me].reshape(E), eff[:, me].reshape(E), axis_name=ep_axis)
    gs = jnp.sum(eff[:, me], axis=0)  # [E_loc] rows per local expert, grouped
    gate, up, down = _split_arrays(fns, arrays)
    h = down(_swiglu(gate(recv, gs), up(recv, gs)), gs)  # [M, D]
    if tp_axes:
        h = jax.lax.psum(h, tp_axes)
    src_off = jax.lax.dynamic_slice_in_dim(_exclusive_cumsum(Cm, axis=1), me * E_loc, E_loc,
                                           axis=1)  # [src, l]: where each source keeps it
    ys = collective(h, jnp.zeros((n * k, D), h.dtype), off[:, me].reshape(E),
                    eff[:, me].reshape(E), src_off.reshape(E), eff[me].reshape(E),
                    axis_name=ep_axis)  # back in my sorted order; dropped rows stay 0
    ys = ys * w.reshape(-1)[order][:, None].astype(ys.dtype)
    out = jax.ops.segment_sum(ys, token, num_segments=n)
    dropped = (jnp.sum(counts) - jnp.sum(eff[me])).astype(jnp.float32)
    return out, jax.lax.psum(dropped, token_axes)


def _split_arrays(fns, arrays):
    mats, i = [], 0
    for fn, cnt in fns:
        mats.append(functools.partial(fn, tuple(arrays[i:i + cnt])))
        i += cnt
    return mats


def expert_parallel_experts(x, weights, idx, valid, experts, *, num_experts, mesh, rules=None,
                            mode="all_to_all", dropless=False, capacity_factor=1.25,
                            collective=None):
    """Routed-expert output under shard_map. x [N,D], weights/idx [N,k], valid [N];
    experts: three ExpertMatrix (gate, up, down) holding the global (GSPMD) arrays.
    Returns (y [N,D], dropped assignments count) or None when N cannot be split over the batch
    axes including the expert axis (the caller then runs the local dispatch).
    collective: the ragged all-to-all to use (default lax.ragged_all_to_all)."""
    rules = shd.current_rules() if rules is None else shd.normalize_rules(rules)
    N = x.shape[0]
    sizes = dict(mesh.shape)
    ep_axes = tuple(a for a in rules.get("expert", ()) if sizes.get(a, 1) > 1)
    if len(ep_axes) > 1:
        raise ValueError(f"expert parallelism needs one mesh axis for 'expert', got {ep_axes}")
    ep_axis = ep_axes[0] if ep_axes else (rules.get("expert", ()) or ("expert",))[0]
    if ep_axis not in sizes:
        raise ValueError(f"mesh has no axis {ep_axis!r} for the experts (axes {tuple(sizes)})")
    ep = sizes[ep_axis]
    if num_experts % ep:
        raise ValueError(f"expert parallelism: num_experts={num_experts} is not divisible by "
                         f"the {ep_axis!r} mesh axis ({ep})")
    token_axes = shd.batch_axes(mesh, N, rules)
    if ep > 1 and ep_axis not in token_axes:
        return None
    if ep_axis not in token_axes:
        token_axes = token_axes + (ep_axis,)  # size 1: harmless, keeps the specs uniform
    # F over the tensor-parallel axes that do not split tokens
    tp_axes = tuple(a for a in rules.get("mlp", ()) if sizes.get(a, 1) > 1 and a not in token_axes)
    tp = math.prod(sizes[a] for a in tp_axes)
    for m in experts:
        for arr, fd in zip(m.arrays, m.f_dims):
            if arr.shape[fd] % tp:
                tp_axes, tp = (), 1
    tp_entry = None if not tp_axes else tp_axes[0] if len(tp_axes) == 1 else tp_axes
    arrays, fns, specs = [], [], []
    for m in experts:
        fns.append((m.fn, len(m.arrays)))
        for arr, fd in zip(m.arrays, m.f_dims):
            entries = [None] * arr.ndim
            entries[0] = ep_axis
            entries[fd] = tp_entry
            arrays.append(arr)
            specs.append(P(*entries))
    tok = P(token_axes)
    common = dict(fns=tuple(fns), num_experts=num_experts, capacity_factor=capacity_factor,
                  dropless=dropless, ep_axis=ep_axis, tp_axes=tp_axes, token_axes=token_axes)
    if mode == "all_to_all":
        body = functools.partial(_a2a_body, **common)
    elif mode == "ragged_all_to_all":
        if collective is None:
            platforms = {d.platform for d in mesh.devices.flat}
            if "cpu" in platforms:
                raise NotImplementedError(
                    "moe.expert_parallel='ragged_all_to_all': lax.ragged_all_to_all is not "
                    "implemented on XLA:CPU; use 'all_to_all' (capacity-padded) on CPU")
            collective = jax.lax.ragged_all_to_all
        body = functools.partial(_ragged_body, collective=collective, **common)
    else:
        raise ValueError(f"unknown expert-parallel mode {mode!r}")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, *specs),
                       out_specs=(tok, P()))
    return fn(x, weights, idx, valid, *arrays)


@jax.checkpoint  # reverse mode keeps buf and w, not the per-block copies of w [nb,D,F]
def _per_block_matmul(buf, w, block_e):
    return jnp.einsum("jbd,jdf->jbf", buf, w[block_e])  # [nb,b,D] x [nb,D,F] -> [nb,b,F]


def blocked_grouped_matmul(xs: jax.Array, w: jax.Array, gs: jax.Array,
                           block: int | None = None) -> jax.Array:
    """`lax.ragged_dot(xs, w, gs)` as batched einsums over blocks of one expert each.

    xs [M,D] rows sorted by group, w [E,D,F], gs [E] group sizes (sum <= M; rows past the sum
    give zeros, as in ragged_dot). Each group's rows are placed at the start of its own run of
    `block`-row blocks (at most ceil(M/block) + E blocks in all, a static bound), every block is
    multiplied by its group's matrix ("jbd,jdf->jbf" with w gathered per block), and the rows
    are gathered back: about (M + E * block) * D * F multiply-adds, where XLA:CPU's ragged_dot
    computes every row against every expert (E * M * D * F): several times faster on CPU
    (numbers in docs/speed.md).
    block None: the power of two nearest above M / E, within [8, 128] (decode-sized M stays
    small)."""
    M, D = xs.shape
    E, _, F = w.shape
    b = block or min(128, max(8, 1 << max(0, math.ceil(math.log2(max(1, M / E))))))
    nb = -(-M // b) + E
    padded = (gs + b - 1) // b * b  # [E] rows each group occupies, whole blocks
    ends, pends = jnp.cumsum(gs), jnp.cumsum(padded)
    row = jnp.arange(M)
    e_row = jnp.minimum(jnp.searchsorted(ends, row, side="right"), E - 1)  # [M] group of a row
    dst = jnp.where(row < ends[-1], row - (ends - gs)[e_row] + (pends - padded)[e_row],
                    nb * b)  # [M] padded slot; past the groups -> the dropped row nb*b
    buf = jnp.zeros((nb * b + 1, D), xs.dtype).at[dst].set(xs)[:-1].reshape(nb, b, D)
    block_e = jnp.minimum(jnp.searchsorted(pends, jnp.arange(nb) * b, side="right"), E - 1)
    out = _per_block_matmul(buf, w, block_e)  # [nb,b,F]
    out = jnp.concatenate([out.reshape(nb * b, F), jnp.zeros((1, F), out.dtype)])
    return out[dst]  # [M,F]


def grouped_matmul(xs: jax.Array, w: jax.Array, gs: jax.Array, impl: str = "auto"
                   ) -> jax.Array:
    """xs [M,D] sorted by group, w [E,D,F], gs [E] -> [M,F]. impl (moe.grouped_matmul):
    "ragged_dot" (`lax.ragged_dot`), "blocked" (`blocked_grouped_matmul`, the same numbers),
    "auto": blocked on CPU (XLA:CPU lowers ragged_dot to a product against every expert),
    ragged_dot elsewhere."""
    if impl == "blocked" or (impl == "auto" and jax.default_backend() == "cpu"):
        return blocked_grouped_matmul(xs, w, gs)
    if impl not in GROUPED_MATMUL:
        raise ValueError(f"grouped_matmul impl must be one of {GROUPED_MATMUL}, got {impl!r}")
    return jax.lax.ragged_dot(xs, w, gs)


def _dense_apply(impl, arrays, xs, gs=None):
    (kernel,) = arrays
    if gs is None:
        return jnp.einsum("ecd,edf->ecf", xs, kernel)
    return grouped_matmul(xs, kernel, gs, impl)


def _mxfp4_apply(impl, arrays, xs, gs=None):
    blocks, scales = arrays
    if gs is None:  # capacity buffers [E,C,D]
        return jax.vmap(lambda xe, be, se: mx.mxfp4_matmul(
            xe, mx.MXFP4(be, se), impl=impl))(xs, blocks, scales)
    return mx.grouped_mxfp4_matmul(xs, mx.MXFP4(blocks, scales), gs, impl=impl)


class MoE(nn.Module):
    cfg: MoEConfig
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _expert_weight(self, name, E, d_in, d_out):
        """One expert matrix as an ExpertMatrix (callable on grouped/batched activations).
        w_gate / w_up map d_model -> expert_dim, w_down expert_dim -> d_model (decided by the
        name: d_model may equal expert_dim)."""
        c = self.cfg
        down = name == "w_down"
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
            # F is the output dim of gate/up, the (blocked) input dim of down
            f_dim = 2 if down else 1
            return ExpertMatrix((blocks, scales), functools.partial(_mxfp4_apply, c.mxfp4_impl),
                                (f_dim, f_dim))

        kernel = self.param(name, nn.with_logical_partitioning(
            init, ("expert", "mlp", "embed") if down else ("expert", "embed", "mlp")),
            (E, d_in, d_out),
            self.param_dtype)
        if c.qat:
            kernel = jnp.swapaxes(mx.fake_quant(jnp.swapaxes(kernel, -1, -2), axis=-1), -1, -2)
        kernel = kernel.astype(self.dtype)
        return ExpertMatrix((kernel,), functools.partial(_dense_apply, c.grouped_matmul),
                            (1 if down else 2,))

    @nn.compact
    def __call__(self, x, *, valid):
        """x [B,T,D], valid [B,T] -> (y [B,T,D], aux dict)."""
        c = self.cfg
        B, T, D = x.shape
        E, k, F = c.num_experts, c.num_experts_per_tok, c.expert_dim
        x = shd.constrain(x, shd.BLOCK_AXES)
        router_w = self.param("router", nn.with_logical_partitioning(
            nn.initializers.normal(D ** -0.5), ("embed", "expert")), (D, E), jnp.float32)
        bias = self.variable("router_state", "bias", lambda: jnp.zeros((E,), jnp.float32)).value
        xf = x.reshape(B * T, D)
        vf = valid.reshape(B * T)
        logits = jnp.einsum("nd,de->ne", xf.astype(jnp.float32), router_w)  # [N,E]
        w, idx, probs = route(logits, jax.lax.stop_gradient(bias), router=c.router, top_k=k,
                              norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
                              n_group=c.n_group, topk_group=c.topk_group)
        w = w * vf[:, None]
        experts = (self._expert_weight("w_gate", E, D, F), self._expert_weight("w_up", E, D, F),
                   self._expert_weight("w_down", E, F, D))
        ep_out = None
        mesh = shd.current_mesh()
        if c.expert_parallel != "none" and mesh is not None:
            ep_out = expert_parallel_experts(
                xf, w, idx, vf, experts, num_experts=E, mesh=mesh, rules=shd.current_rules(),
                mode=c.expert_parallel, dropless=c.dispatch == "dropless",
                capacity_factor=c.capacity_factor)
            if ep_out is None:
                logging.warning("MoE: %d tokens cannot be split over the batch axes including "
                                "the expert axis; using the local %s dispatch", B * T, c.dispatch)
        if ep_out is not None:
            y, dropped = ep_out
        elif takes_all_experts(c, B * T):
            y, dropped = all_experts(xf, w, idx, experts, E)
        elif c.dispatch == "dropless":
            y, dropped = dropless_experts(xf, w, idx, experts, E)
        else:
            y, dropped = capacity_experts(xf, w, idx, vf, experts, E, expert_capacity(c, B * T))
        y = shd.constrain(y.reshape(B, T, D).astype(x.dtype), shd.BLOCK_AXES)
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
