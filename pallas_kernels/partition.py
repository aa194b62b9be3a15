"""Compiled Pallas calls on a device mesh: each one under `shard_map`, one device's share each.

XLA cannot partition a Mosaic (TPU) kernel itself: a compiled TPU Pallas call in a program
sharded over several devices fails with "Mosaic kernels cannot be automatically partitioned.
Please wrap the call in a shard_map" (found by compiling the RL programs for TPU topologies,
train/aot.py). `per_device(fn, args, in_names, out_names)` runs fn under `jax.shard_map` over the
mesh the model is traced under (runtime.mesh.use_mesh, re-exported by model.sharding), each
array split by its logical axis names through the same rules and skipping rule as the model's
activations (runtime.mesh.logical_to_spec: "batch" over the data axes, "act_heads" over
tensor; an axis that does not divide a dimension is left out, so that dimension is replicated).
Outside a mesh, on a one-device mesh and inside a manual (shard_map) region it calls fn as is.

Used by the ops' compiled Pallas paths whose work splits over batch and heads without
communication (ops.kda; dsa.ops.indexer_scores over batch only, as its scores sum the heads;
dsa.ops.sparse_attention_with_lse). Interpreted kernels are plain JAX and need none of this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime import mesh as mesh_context


def active_mesh():
    """(mesh, rules) the model is traced under when a compiled Pallas call must be wrapped in
    shard_map (more than one device, not already inside a manual region), else None."""
    ctx = mesh_context.active()
    if ctx is None or ctx[0].size == 1 or mesh_context.in_manual_region():
        return None
    return ctx


def per_device(fn: Callable, args: Sequence, in_names: Sequence, out_names) -> object:
    """fn(*args) under shard_map over the active mesh (see the module docstring), else fn(*args).

    in_names: per argument, a tuple of logical axis names (one per dim) or None for an argument
    passed as None; out_names: a pytree of such tuples matching fn's output (None for a None
    output)."""
    import jax  # noqa: PLC0415

    ctx = active_mesh()
    if ctx is None:
        return fn(*args)
    mesh, rules = ctx
    present = [i for i, a in enumerate(args) if a is not None]
    if any(in_names[i] is None for i in present):
        raise ValueError("per_device: every array argument needs its logical axis names")

    def spec(names, shape):
        return mesh_context.logical_to_spec(names, shape, mesh, rules)

    in_specs = tuple(spec(in_names[i], args[i].shape) for i in present)
    outs = jax.eval_shape(fn, *args)

    def out_spec(names, out):
        return None if out is None else spec(names, out.shape)

    out_specs = jax.tree.map(out_spec, out_names, outs,
                             is_leaf=lambda x: x is None or isinstance(x, tuple) and all(
                                 isinstance(n, str) or n is None for n in x))

    def body(*xs):
        full = list(args)
        for i, x in zip(present, xs, strict=True):
            full[i] = x
        return fn(*full)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*(args[i] for i in present))
