"""Random draws batched into a few threefry hashes, with the same bits.

A model's initialiser draws every parameter with its own key: flax folds the module path into
the key (`random_fold_in`), then each initialiser draws its bits (`random_bits`), so the init
program holds one threefry-2x32 hash per fold and per parameter (164 for the matched GRPO
model: 82 folds, 82 draws; batched: 2). XLA compiles each hash as its own straight-line kernel of ~400
integer ops (runtime/xla_env.py), and those kernels are most of the init program's compile
(measured with a trivial hash in their place; numbers in docs/speed.md).

`batch_random_draws(fn)` traces fn to a jaxpr and evaluates it (inside whatever jit traces the
result) with its key derivations and bit draws grouped by dependency level: every hash whose
inputs are ready at the same point runs as one threefry2x32 call over the concatenation of their
counters, each counter with its own draw's key (gathered by the counter's draw index, not
broadcast per draw: that was a fusion per draw). Threefry is elementwise in (key,
counter), so each draw gets exactly the bits jax would give it: the values are equal bit for bit
(tests/model/test_batched_draws.py holds this on presets and on jax.random's own functions). The
batched hash is computed inside a conditional, so that XLA does not fuse a copy of it back into
every draw. It about halves the matched model's init compile (`python -m
benchmarks.grpo_matched`, set-up row, alternating cold runs; docs/speed.md).

What is batched: `random_bits` (32-bit, a single key, at most MAX_DRAW elements),
`random_fold_in` and `random_split` on single threefry2x32 keys, with
`jax_threefry_partitionable` (jax's default, which defines the counters as the flat index).
Everything else (other key implementations, key arrays, empty or 8/16/64-bit draws, draws inside
loops or conditionals, and every function with side effects) runs as jax runs it. Not for
sharded initialisation: a concatenation across parameters would not be partitioned like the
per-parameter draws it replaces, so model.sharding.init_sharded uses the unbatched program on
meshes of several devices.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.extend.random import threefry2x32_p

MAX_DRAW = 1 << 22     # larger draws keep their own hash (nothing to gain, memory to lose)
MAX_BATCH = 1 << 24    # counters per batched hash call (64 MiB of uint32 per operand)
_BATCHED = ("random_bits", "random_fold_in", "random_split")


@dataclasses.dataclass
class _Node:
    eqn: Any                 # the jaxpr equation (primitive, params, effects)
    ins: list                # ("c", value) or ("v", id)
    outs: list[int]          # value ids
    level: int = 0


def batch_random_draws(fn: Callable) -> Callable:
    """fn with its threefry draws batched (module docstring). Same outputs, bit for bit; the
    result is meant to be jitted (it traces fn on every call)."""
    if not jax.config.jax_threefry_partitionable:
        return fn

    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _evaluate(closed, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return wrapped


def _flatten(jaxpr, consts, in_refs, nodes: list, ids) -> list:
    """Append jaxpr's equations to nodes with nested jit calls inlined; returns its outputs."""
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = ("c", c)
    for v, r in zip(jaxpr.invars, in_refs):
        env[v] = r

    def read(a):
        return ("c", a.val) if isinstance(a, Literal) else env[a]

    for e in jaxpr.eqns:
        ins = [read(a) for a in e.invars]
        if e.primitive.name in ("jit", "pjit"):
            sub = e.params["jaxpr"]
            outs = _flatten(sub.jaxpr, sub.consts, ins, nodes, ids)
        else:
            outs = [("v", next(ids)) for _ in e.outvars]
            nodes.append(_Node(e, ins, [o[1] for o in outs]))
        for v, o in zip(e.outvars, outs):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]


def _batchable(node: _Node) -> bool:
    e = node.eqn
    name = e.primitive.name
    if name not in _BATCHED:
        return False
    key = e.invars[0].aval
    impl = getattr(key.dtype, "_impl", None)  # a typed key's PRNG implementation
    if key.shape != () or getattr(impl, "name", None) != "threefry2x32":
        return False
    if name == "random_bits":
        return e.params["bit_width"] == 32 and 0 < int(np.prod(e.params["shape"])) <= MAX_DRAW
    if name == "random_fold_in":
        return e.invars[1].aval.shape == () and e.invars[1].aval.dtype == np.uint32
    return 0 < int(np.prod(e.params["shape"])) <= MAX_DRAW


def _evaluate(closed, args) -> list:
    nodes: list[_Node] = []
    out_refs = _flatten(closed.jaxpr, closed.consts, [("v", -1 - i) for i in range(len(args))],
                        nodes, itertools.count())
    # dead code out (flax's init runs the forward pass; only the variables are returned)
    needed = {r[1] for r in out_refs if r[0] == "v"}
    live = []
    for n in reversed(nodes):
        if n.eqn.effects or needed.intersection(n.outs):
            live.append(n)
            needed.update(r[1] for r in n.ins if r[0] == "v")
    live.reverse()
    if any(n.eqn.effects for n in live):  # levels would reorder effects: run it as traced
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    # level: how many hashes lie on the longest chain of hashes before the node
    level_of = {-1 - i: 0 for i in range(len(args))}
    batched = []
    for n in live:
        n.level = max((level_of[r[1]] for r in n.ins if r[0] == "v"), default=0)
        b = _batchable(n)
        batched.append(b)
        for o in n.outs:
            level_of[o] = n.level + b
    vals = {-1 - i: a for i, a in enumerate(args)}

    def get(r):
        return r[1] if r[0] == "c" else vals[r[1]]

    by_level: dict = {}  # level -> [(node, batched)], in the traced order
    for n, b in zip(live, batched):
        by_level.setdefault(n.level, []).append((n, b))
    for level in sorted(by_level):
        draws = []
        for n, b in by_level[level]:
            if b:
                draws.append(n)
                continue
            prim = n.eqn.primitive
            with n.eqn.ctx.manager:  # as jax.core.eval_jaxpr binds an equation
                out = prim.bind(*map(get, n.ins), **prim.get_bind_params(n.eqn.params))
            for o, v in zip(n.outs, out if prim.multiple_results else [out]):
                vals[o] = v
        _run_draws(draws, get, vals)
    return [get(r) for r in out_refs]


def _run_draws(draws: list[_Node], get, vals: dict) -> None:
    """The draws' hashes as few threefry2x32 calls (at most MAX_BATCH counters each)."""
    parts = []  # (node, key, k1, k2, counters, folded value or None)
    for n in draws:
        key = get(n.ins[0])
        k1, k2 = jax.random.key_data(key)
        name = n.eqn.primitive.name
        if name == "random_fold_in":  # threefry_seed(data) = [0, data] as (hi, lo) counters
            size, data = 1, jnp.reshape(get(n.ins[1]), ())
        else:  # counters 0..size-1 (jax's partitionable counters: the flat index)
            size, data = int(np.prod(n.eqn.params["shape"])), None
        parts.append((n, key, k1, k2, size, data))
    chunk, total = [], 0
    for p in parts:
        if chunk and total + p[4] > MAX_BATCH:
            _hash(chunk, vals)
            chunk, total = [], 0
        chunk.append(p)
        total += p[4]
    if chunk:
        _hash(chunk, vals)


def _hash(parts: list, vals: dict) -> None:
    sizes = [p[4] for p in parts]
    k1, k2, hi, lo = _batched_inputs(parts, sizes)
    b1, b2 = _hash_unfused(k1, k2, hi, lo)
    start = 0
    for (n, key, *_), s in zip(parts, sizes):
        o1, o2 = b1[start:start + s], b2[start:start + s]
        start += s
        name, impl = n.eqn.primitive.name, jax.random.key_impl(key)
        if name == "random_bits":
            out = jnp.reshape(o1 ^ o2, n.eqn.params["shape"])
        elif name == "random_fold_in":
            out = jax.random.wrap_key_data(jnp.concatenate([o1, o2]), impl=impl)
        else:  # random_split: [*shape, 2] key data
            shape = tuple(n.eqn.params["shape"])
            data = jnp.stack([o1.reshape(shape), o2.reshape(shape)], axis=len(shape))
            out = jax.random.wrap_key_data(data, impl=impl)
        vals[n.outs[0]] = out


def _batched_inputs(parts: list, sizes: list[int]):
    """The concatenated hash inputs (k1, k2, hi, lo), each [sum(sizes)] uint32: every counter
    of part i with part i's key. A part is a bit draw (counters 0..size-1: the flat index,
    high words 0) or a key fold (one counter: high 0, low the folded value). Built from each
    counter's part index (a cumulative sum over the parts' starts, then gathers) rather than
    one broadcast and one iota per part and a concatenation: the same values in a handful of
    ops instead of a fusion per part (matched model: the init's fusions 290 -> 118)."""
    n = int(sum(sizes))
    k1s, k2s = jnp.stack([p[2] for p in parts]), jnp.stack([p[3] for p in parts])  # [P]
    starts = np.cumsum([0] + sizes[:-1])
    # the part of each counter: +1 at every start after the first, summed along the counters;
    # from a zero XLA cannot fold (else it folds the sum into an [n] constant, slowly)
    zero = (~_always_true(k1s)).astype(jnp.int32)
    part = jnp.cumsum(jnp.full((n,), zero).at[starts[1:]].add(1))  # [n]
    index = lax.iota(jnp.uint32, n) - jnp.asarray(starts, jnp.uint32)[part]  # within its part
    folds = [p[5] is not None for p in parts]
    lo = index
    if any(folds):
        data = jnp.stack([p[5] if f else jnp.uint32(0) for p, f in zip(parts, folds)])  # [P]
        lo = jnp.where(jnp.asarray(folds)[part], data[part], index)
    return k1s[part], k2s[part], jnp.zeros((n,), jnp.uint32), lo


def _always_true(words: jax.Array) -> jax.Array:
    """A bool scalar that is always True but that XLA cannot constant-fold (it depends on the
    runtime key words: x ^ c != x for any c != 0)."""
    return (words[0] ^ jnp.uint32(0x9E3779B9)) != words[0]


def _hash_unfused(k1, k2, hi, lo):
    """threefry2x32 over the counters, computed inside a conditional whose predicate XLA cannot
    fold (it is always true): XLA duplicates a cheap elementwise producer into each of its
    consumers, so without the boundary it would fuse the hash into each draw's slice and emit
    one straight-line copy of it per draw again (optimization_barrier does not stop that on
    CPU, and XLA unrolls a loop over chunks)."""
    pred = _always_true(k1)
    zeros = lambda *_: (jnp.zeros_like(hi), jnp.zeros_like(hi))
    return lax.cond(pred, lambda *xs: tuple(threefry2x32_p.bind(*xs)), zeros, k1, k2, hi, lo)
