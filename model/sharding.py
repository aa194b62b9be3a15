"""Meshes, logical-axis sharding rules, sharded init/optimizer state, activation constraints and
multi-host setup.

Mesh axes (outer to inner; the inner axes should map to the fastest links):

    data    pure data parallelism: parameters replicated, batch split
    fsdp    data parallelism with parameters (and optimizer state) split along "embed" (ZeRO-3)
    expert  expert parallelism: routed experts split along "expert"; for every other layer it is
            one more batch (and ZeRO-3) axis: tokens are split over data x fsdp x expert, dense
            weights over fsdp x expert
    tensor  tensor (model) parallelism: heads / mlp / vocab split, activations replicated

Parameters carry logical axis names (`nn.with_logical_partitioning` in model/layers); a rules table
maps each logical name to mesh axes. `DEFAULT_RULES` below is the default; a config can override
any entry (`rules_from_config`). Mapping a concrete array shape:

  * a logical name maps to None, one mesh axis, or a tuple of mesh axes;
  * mesh axes absent from the mesh, of size 1, or already used by an earlier dimension of the
    same array are skipped;
  * a mesh axis that does not divide the dimension (after the axes already taken) is skipped
    (JAX rejects uneven shardings); `logical_to_spec(..., report=...)` lists these, and
    scripts/plan.py prints them, since a skipped axis means that dimension is replicated.

Typical use (single host or multi-host alike):

    mesh = make_mesh({"fsdp": 2, "expert": 2, "tensor": 2})       # AxisType.Auto everywhere
    shardings = model_shardings(model, mesh)                        # tree of NamedSharding
    variables = init_sharded(model, key, mesh)                      # never materialised unsharded
    opt_sh = opt_state_shardings(optimizer, variables["params"], shardings["params"])
    with use_mesh(mesh):                                            # constraints + expert parallel
        step = jax.jit(train_step, in_shardings=..., out_shardings=...)

`use_mesh` activates the mesh for model code: `constrain(x, ("batch", "length", "act_embed"))`
becomes a `with_sharding_constraint`, and MoE layers with `moe.expert_parallel != "none"` run their
dispatch under `shard_map`. Outside `use_mesh` both are no-ops / local paths, so single-device code
is unaffected. The context is read when a function is traced: jit caches do not key on it, so
trace (call for the first time) jitted functions inside the context they are meant for.

Multi-host: call `maybe_initialize_distributed()` first thing in a script (before any other JAX
call); it reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (or explicit
arguments), or auto-detects on TPU pods / SLURM with JAX_DISTRIBUTED_AUTO=1. Each host then feeds
its own slice of the global batch (`host_batch_slice`) and assembles the global array with
`host_local_to_global`. See docs/scaling.md.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from runtime.mesh import (  # noqa: F401  (re-exported: model.sharding's public names)
    BLOCK_AXES,
    DEFAULT_RULES,
    MESH_AXES,
    Rules,
    active,
    as_axes,
    current_mesh,
    current_rules,
    in_manual_region,
    logical_to_spec,
    make_rules,
    mesh_sizes,
    normalize_rules,
    use_mesh,
)

# --------------------------------------------------------------------------- rules and config
# Named meshes for `sharding_config(preset)`; --config.sharding.mesh overrides the preset's.
SHARDING_PRESETS: dict[str, str] = {
    # one device (the CPU demo): no collectives; with more devices present, the first is used
    "one_device": "data=1",
    # every device, pure data parallelism (parameters replicated)
    "all_devices": "data=-1",
    # one host with 8 accelerators (or 8 fake CPU devices): ZeRO-3 over fsdp x expert, experts
    # split in two (every preset model's expert count is even)
    "eight_devices": "data=2,fsdp=2,expert=2",
    # a multi-host slice: tensor inside an 8-GPU node, experts over 8, the rest of the devices
    # (every host's) on fsdp; sized for reference_2p8t (1000 experts / 8). On 4-chip TPU hosts
    # keep tensor inside a host: --config.sharding.mesh=fsdp=-1,expert=8,tensor=4
    "multihost_slice": "fsdp=-1,expert=8,tensor=8",
}


def sharding_config(preset: str = "all_devices"):
    """The ml_collections node a run config embeds as `config.sharding`:

        preset  the SHARDING_PRESETS name the mesh came from (informational)
        mesh    "data=-1" style axis sizes (-1: the remaining devices), see `parse_mesh`; a mesh
                of fewer devices than the process sees uses the first ones (single process only)
        rules   DEFAULT_RULES as strings; override entries, e.g. --config.sharding.rules.heads=none
                or --config.sharding.rules.batch="data,fsdp" (strings: "none" or comma lists)
    """
    import ml_collections

    if preset not in SHARDING_PRESETS:
        raise ValueError(f"unknown sharding preset {preset!r}; valid: {sorted(SHARDING_PRESETS)}")
    c = ml_collections.ConfigDict()
    c.preset = preset
    c.mesh = SHARDING_PRESETS[preset]
    c.rules = ml_collections.ConfigDict(
        {k: ",".join(as_axes(v)) or "none" for k, v in DEFAULT_RULES.items()})
    return c


def mesh_from_config(cfg: Any, devices: Sequence[Any] | None = None) -> tuple[Mesh, dict]:
    """(Mesh, rules) of a run config (its `sharding` node, or the node itself).

    The mesh spans every process's devices. A mesh smaller than the device count (e.g. the
    "one_device" preset on an 8-device host) takes the first devices of a single process; in a
    multi-process job it must use every device (else a clear error)."""
    node = cfg.sharding if "sharding" in cfg else cfg
    devices = list(jax.devices() if devices is None else devices)
    spec = parse_mesh(node.mesh)
    if -1 not in spec.values():
        need = math.prod(spec.values()) if spec else 1
        if need < len(devices):
            if jax.process_count() > 1:
                raise ValueError(
                    f"sharding.mesh={node.mesh!r} uses {need} of the {len(devices)} devices of "
                    f"this {jax.process_count()}-process job: a multi-process mesh must span "
                    "every device (use -1 on one axis, e.g. data=-1)")
            devices = devices[:need]
    return make_mesh(spec, devices=devices), rules_from_config(node)


def rules_from_config(cfg: Any = None) -> dict[str, tuple[str, ...]]:
    """Rules from a ConfigDict/dict: either the `sharding` node itself, or a config holding one
    (cfg.sharding.rules), or a plain mapping of overrides. None -> defaults."""
    if cfg is None:
        return make_rules()
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if "sharding" in cfg:
        cfg = cfg["sharding"]
    if "rules" in cfg and isinstance(cfg["rules"], Mapping):
        cfg = cfg["rules"]
    # extra logical names are allowed (new layers may add names)
    return make_rules({k: v for k, v in cfg.items() if k != "mesh"})


# --------------------------------------------------------------------------- meshes
def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """"expert=64,fsdp=16,tensor=8" (or a dict) -> {axis: size}; unknown axes raise."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        out = {}
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"mesh spec {spec!r}: expected axis=size items, got {part!r}")
            k, v = part.split("=", 1)
            out[k] = int(v)
        spec = out
    bad = [k for k in spec if k not in MESH_AXES]
    if bad:
        raise ValueError(f"unknown mesh axis {bad[0]!r}; valid axes: {MESH_AXES}")
    return {k: int(v) for k, v in spec.items()}


def mesh_shape(spec: str | Mapping[str, int] | None, num_devices: int | None = None
               ) -> dict[str, int]:
    """Full {axis: size} over MESH_AXES (missing axes 1; one axis may be -1 = the rest).
    With num_devices given, the product must equal it."""
    d = parse_mesh(spec)
    shape = {a: d.get(a, 1) for a in MESH_AXES}
    free = [a for a, s in shape.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh {spec!r}: at most one axis may be -1")
    fixed = math.prod(s for s in shape.values() if s != -1)
    if free:
        if num_devices is None:
            raise ValueError(f"mesh {spec!r}: -1 needs the device count")
        if num_devices % fixed:
            raise ValueError(f"mesh {spec!r}: {num_devices} devices not divisible by {fixed}")
        shape[free[0]] = num_devices // fixed
    if any(s < 1 for s in shape.values()):
        raise ValueError(f"mesh {spec!r}: sizes must be >= 1")
    if num_devices is not None and math.prod(shape.values()) != num_devices:
        raise ValueError(f"mesh {spec!r} has {math.prod(shape.values())} devices, "
                         f"but {num_devices} are available (pass devices= to use a subset)")
    return shape


def make_mesh(shape: str | Mapping[str, int] | Sequence[int] | None = None, *,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh over MESH_AXES with AxisType.Auto (GSPMD propagation; `jax.make_mesh`'s default
    Explicit axes raise ShardingTypeError on contractions over sharded dims).

    shape: {"expert": 8} / "fsdp=2,expert=4" / (data, fsdp, expert, tensor) sizes; missing axes
    are 1, one may be -1. devices: default all (jax.devices(), every process's)."""
    devices = list(jax.devices() if devices is None else devices)
    if shape is not None and not isinstance(shape, (str, Mapping)):
        shape = dict(zip(MESH_AXES, shape, strict=True))
    full = mesh_shape(shape if shape is not None else "data=-1", len(devices))
    sizes = tuple(full[a] for a in MESH_AXES)
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


# --------------------------------------------------------------------------- logical -> mesh
def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def logical_specs(abstract_variables, mesh: Mesh | Mapping[str, int], rules: Rules | None = None,
                  report: list | None = None):
    """Boxed (nn.Partitioned) tree -> unboxed tree of PartitionSpec. Unboxed leaves (e.g. the
    router bias state) are replicated. `report` collects (path, dim, name, axis, size, dim_size)."""
    def one(path, leaf):
        if not _is_box(leaf):
            return P()
        rep = [] if report is not None else None
        spec = logical_to_spec(leaf.names, leaf.value.shape, mesh, rules, rep)
        if rep:
            report.extend((jax.tree_util.keystr(path),) + r for r in rep)
        return spec
    return jax.tree_util.tree_map_with_path(one, abstract_variables, is_leaf=_is_box)


def logical_to_sharding(abstract_variables, mesh: Mesh, rules: Rules | None = None):
    """Boxed abstract variables (Model.abstract_init()) -> unboxed tree of NamedSharding."""
    specs = logical_specs(abstract_variables, mesh, rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def model_shardings(model, mesh: Mesh, rules: Rules | None = None):
    """NamedSharding tree for `model.init(...)`'s variables ({"params", "router_state"})."""
    return logical_to_sharding(model.abstract_init(), mesh, rules)


def variables_shardings(var_shardings: Mapping, variables: Mapping, mesh: Mesh) -> dict:
    """`var_shardings` (model_shardings) matched to a variables dict: collections the model
    does not declare (e.g. an empty router_state of a dense model) are replicated."""
    rep = replicated(mesh)
    return {k: var_shardings[k] if k in var_shardings else jax.tree.map(lambda _: rep, v)
            for k, v in variables.items()}


def shard_params(variables, mesh: Mesh, rules: Rules | None = None, *, abstract=None):
    """Place variables on the mesh. `variables` boxed (nn.Partitioned leaves: their names are
    used) or unboxed together with `abstract` (the boxed abstract tree, Model.abstract_init())."""
    has_boxes = any(_is_box(x) for x in jax.tree.leaves(variables, is_leaf=_is_box))
    if has_boxes:
        abstract = variables
        variables = nn.meta.unbox(variables)
    elif abstract is None:
        raise ValueError("shard_params: unboxed variables need abstract= (Model.abstract_init())")
    shardings = logical_to_sharding(abstract, mesh, rules)
    return jax.device_put(variables, shardings)


_SHARDED_INITS: dict = {}  # (ModelConfig, mesh_key) -> jitted init with out_shardings


def init_sharded(model, rng: jax.Array, mesh: Mesh, rules: Rules | None = None):
    """model.init(rng) computed directly into its shardings (no unsharded copy anywhere). The
    values do not depend on the mesh (jax_threefry_partitionable, the default).

    Compiles once: on a one-device mesh the model's own init program (Model.init, shared with
    every other Model.init call) is placed on the mesh's device; on a larger mesh one program
    with out_shardings per (config, mesh, rules), cached."""
    shardings = model_shardings(model, mesh, rules)
    if mesh.size == 1:
        return jax.device_put(model.init(rng), shardings)
    key = (model.cfg, mesh_key(mesh, rules))
    fn = _SHARDED_INITS.get(key)
    if fn is None:
        # each parameter's own draws: batched ones would not be partitioned like them
        fn = _SHARDED_INITS[key] = jax.jit(functools.partial(model.init, batch_draws=False),
                                           out_shardings=shardings)
    return fn(rng)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def opt_state_shardings(optimizer, params, param_shardings):
    """Shardings for `optimizer.init(params)`: every parameter-shaped subtree of the state (Adam
    moments, an f32 master copy, ...) gets its parameters' shardings leaf by leaf, everything
    else (step counts, scalars) is replicated; empty slots (optax.MaskedNode: frozen parameters
    of make_optimizer(trainable=...), parameters a master copy does not need) stay empty.
    `params` may be arrays or ShapeDtypeStructs, the shardings' mesh concrete or abstract.

    A subtree is parameter-shaped when it has the parameters' tree structure with MaskedNode
    allowed in place of any leaf and each array the shape of its parameter. This reads the state
    itself rather than optax.tree_map_params's placeholder init, so optimizers whose state
    structure depends on the parameters' dtypes (rl.train_step.with_master_copy) are mapped
    too."""
    import optax

    mesh = jax.tree.leaves(param_shardings)[0].mesh
    abstract_state = jax.eval_shape(optimizer.init, params)
    rep = replicated(mesh)
    p_struct = jax.tree.structure(params)
    p_leaves = jax.tree.leaves(params)
    s_leaves = jax.tree.leaves(param_shardings)

    def masked(x):
        return isinstance(x, optax.MaskedNode)

    def is_array(x):
        return hasattr(x, "shape") and hasattr(x, "dtype")

    def param_shaped(node) -> bool:
        if is_array(node) or masked(node):
            return False
        if jax.tree.structure(node, is_leaf=masked) != p_struct:
            return False
        leaves = jax.tree.leaves(node, is_leaf=masked)
        return any(is_array(x) for x in leaves) and all(
            masked(x) or (is_array(x) and tuple(x.shape) == tuple(p.shape))
            for x, p in zip(leaves, p_leaves))

    def walk(node):
        if masked(node):
            return node
        if is_array(node):
            return rep
        if param_shaped(node):
            leaves = jax.tree.leaves(node, is_leaf=masked)
            return jax.tree.unflatten(jax.tree.structure(node, is_leaf=masked), [
                x if masked(x) else s for x, s in zip(leaves, s_leaves)])
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if not children or (len(children) == 1 and children[0] is node):
            return node  # an empty node or a non-array leaf (None)
        return jax.tree_util.tree_unflatten(treedef, [walk(c) for c in children])

    return walk(abstract_state)


def sharded_abstract(tree, shardings):
    """ShapeDtypeStructs carrying the target shardings: the restore target for orbax (a
    checkpoint written under one mesh restores into these shardings on any other mesh)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


# --------------------------------------------------------------------------- activations
def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Annotate an activation with logical axes (no-op outside `use_mesh` or inside shard_map).
    Axes that do not divide the dimension are skipped, as for parameters."""
    ctx = active()
    if ctx is None or in_manual_region():
        return x
    mesh, rules = ctx
    spec = logical_to_spec(tuple(logical_axes), x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_axes(mesh: Mesh | Mapping[str, int], n: int, rules: Rules | None = None
               ) -> tuple[str, ...]:
    """Mesh axes a leading dimension of size n ("batch") is split over under `rules`."""
    spec = logical_to_spec(("batch",), (n,), mesh, rules)
    e = spec[0] if len(spec) else None
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


# --------------------------------------------------------------------------- multi-host
def maybe_initialize_distributed(coordinator_address: str | None = None,
                                 num_processes: int | None = None,
                                 process_id: int | None = None,
                                 local_device_ids: Sequence[int] | None = None, *,
                                 auto: bool | None = None,
                                 env: Mapping[str, str] | None = None) -> bool:
    """Join a multi-process JAX job if one is configured; returns True when distributed.

    Explicit arguments win over the environment:
      JAX_COORDINATOR_ADDRESS  host:port of process 0's coordinator (e.g. 10.0.0.1:1234)
      JAX_NUM_PROCESSES        total processes (one per host on TPU, usually one per GPU or host)
      JAX_PROCESS_ID           this process, 0..N-1
      JAX_LOCAL_DEVICE_IDS     optional, comma list of local accelerators this process owns
      JAX_DISTRIBUTED_AUTO=1   call jax.distributed.initialize() with no arguments: the cluster
                               is auto-detected (Cloud TPU pod slices, SLURM, Open MPI)
    Nothing set (and auto falsy): single process, nothing happens. Must run before any other
    JAX call that touches devices. Calling it twice is harmless.
    """
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return True
    addr = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    nproc = num_processes if num_processes is not None else env.get("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else env.get("JAX_PROCESS_ID")
    ids = local_device_ids
    if ids is None and env.get("JAX_LOCAL_DEVICE_IDS"):
        ids = [int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",") if i.strip()]
    if auto is None:
        auto = env.get("JAX_DISTRIBUTED_AUTO", "").lower() in ("1", "true", "yes")
    if addr is None and nproc is None and pid is None:
        if auto:
            jax.distributed.initialize()
            return True
        return False
    if addr is None or nproc is None or pid is None:
        raise ValueError("multi-process setup needs all of JAX_COORDINATOR_ADDRESS, "
                         f"JAX_NUM_PROCESSES and JAX_PROCESS_ID (got {addr!r}, {nproc!r}, {pid!r})")
    nproc, pid = int(nproc), int(pid)
    if nproc == 1:
        return False
    jax.distributed.initialize(coordinator_address=addr, num_processes=nproc, process_id=pid,
                               local_device_ids=ids)
    return True


def barrier(name: str, timeout_s: float = 900.0) -> None:
    """Block until every process reaches `name` (the coordination service's barrier, not a
    device collective; no-op single-process). Use it between compiling and the first run of a
    program: CPU (gloo) collectives give up if peers arrive more than ~30 s apart, which happens
    when one process hits the persistent compilation cache and another compiles."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client has no public accessor in jax 0.10

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def host_batch_slice(global_batch: int, index: int | None = None, count: int | None = None,
                     *, mesh: Mesh | None = None, rules: Rules | None = None) -> slice:
    """Rows of the global batch this host loads. With `mesh`: exactly the rows held by this
    process's devices under rules["batch"] (what `host_local_to_global` expects; must be one
    contiguous block, true for meshes whose outer axes run across hosts). Without: contiguous
    equal blocks by process index. The data pipeline shards its source by
    (process_index, process_count) and reads these rows each step."""
    if mesh is not None:
        spec = logical_to_spec(("batch",), (global_batch,), mesh, rules)
        idx = NamedSharding(mesh, spec).addressable_devices_indices_map((global_batch,))
        rows = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
                       for s in idx.values()})
        lo, hi = rows[0][0], rows[-1][1]
        covered = sum(b - a for a, b in rows)
        if covered != hi - lo:
            raise ValueError(f"this host's batch rows {rows} are not contiguous on this mesh")
        return slice(lo, hi)
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if global_batch % count:
        raise ValueError(f"global batch {global_batch} not divisible by {count} processes")
    per = global_batch // count
    return slice(index * per, (index + 1) * per)


def host_local_to_global(local: Any, mesh: Mesh, rules: Rules | None = None,
                         logical_axes: Iterable[str | None] = ("batch",)):
    """Host-local batch arrays (leading dim = this host's rows) -> global jax.Arrays sharded
    along "batch" (jax.make_array_from_process_local_data). Works single-process as well."""
    logical_axes = tuple(logical_axes)

    def one(x):
        x = np.asarray(x)
        gshape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
        names = logical_axes + (None,) * (x.ndim - len(logical_axes))
        spec = logical_to_spec(names[: x.ndim], gshape, mesh, rules)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, gshape)

    return jax.tree.map(one, local)


# --------------------------------------------------------------------------- batches and caches
def batch_sharding(mesh: Mesh, n: int, rules: Rules | None = None) -> NamedSharding:
    """Sharding of an array whose leading dimension (n rows) is the batch: rows over the mesh
    axes rules["batch"] gives (those that divide n), every other dimension whole. Usable as a
    prefix for a dict of [n, ...] arrays (jit in_shardings)."""
    return NamedSharding(mesh, P(batch_axes(mesh, n, rules) or None))


def cache_axes(path) -> tuple:
    """Logical axes of one decode-cache leaf from its path (its last dict key), as the layer kinds
    declare them (model/layers/registry.py: each kind's `cache_axes`, e.g. KDA "state" [B,H,K,V]
    heads over "act_heads", DSA "kv" [B,S,latent] over "length"); "lengths" [B] and leaves no kind
    declares are split over the batch only."""
    from model.layers import registry  # here, not at import: model.layers imports this module

    key = str(getattr(path[-1], "key", "")) if path else ""
    if key == "lengths":
        return ("batch",)
    for kind in registry.kinds().values():
        if key in kind.cache_axes:
            return tuple(kind.cache_axes[key])
    return ("batch",)


def _leaf_cache_axes(path, x) -> tuple:
    """`cache_axes` of a cache leaf, padded with None to the leaf's rank."""
    names = cache_axes(path)
    return names + (None,) * (len(x.shape) - len(names))


def constrain_cache(cache):
    """`constrain` every leaf of a decode cache (Model.init_cache / init_draft_cache) with its
    `cache_axes`: batch over the data axes, KDA state heads over tensor. No-op outside use_mesh."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: constrain(x, _leaf_cache_axes(path, x)), cache)


def cache_shardings(cache, mesh: Mesh, rules: Rules | None = None):
    """NamedShardings of a decode cache's leaves (arrays or ShapeDtypeStructs) on `mesh`: the
    layout `constrain_cache` gives them inside a mesh program (each leaf's `cache_axes`)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(
        mesh, logical_to_spec(_leaf_cache_axes(path, x), x.shape, mesh, rules)), cache)


def mesh_key(mesh: Mesh | None, rules: Rules | None = None):
    """A hashable key of (mesh, resolved rules) for caches of programs built per mesh; None
    without a mesh."""
    if mesh is None:
        return None
    return mesh, tuple(sorted(normalize_rules(rules).items()))


# --------------------------------------------------------------------------- mesh programs
class MeshJit:
    """A function jitted for one mesh: every trace runs inside `use_mesh(mesh, rules)` (so
    activation constraints and expert parallelism see the mesh), with explicit in/out shardings
    and donation.

    in_shardings / out_shardings: pytrees (prefixes allowed) as for jax.jit, or callables
    (*args) -> such a tree for shardings that depend on the arguments' shapes (e.g. the batch
    axes of a batch of n rows); one jit per argument signature (tree structure, shapes, dtypes).
    In a multi-process job every new program is compiled explicitly (`lower().compile()`) and
    the processes meet at a barrier before its first run: CPU (gloo) collectives give up when
    peers arrive far apart, e.g. when one process hits the persistent compilation cache and
    another compiles."""

    def __init__(self, fn, mesh: Mesh, rules: Rules | None = None, *, in_shardings=None,
                 out_shardings=None, donate_argnums=(), name: str = "program"):
        self.fn, self.mesh, self.rules = fn, mesh, normalize_rules(rules)
        self._in, self._out, self._donate = in_shardings, out_shardings, donate_argnums
        self.name = name
        self._jits: dict = {}
        self._compiled: dict = {}

    @staticmethod
    def _signature(args):
        leaves, tree = jax.tree.flatten(args)
        return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x))))
                           for x in leaves)

    def _jit(self, args):
        key = self._signature(args)
        j = self._jits.get(key)
        if j is None:
            ins = self._in(*args) if callable(self._in) else self._in
            outs = self._out(*args) if callable(self._out) else self._out
            kw = {} if ins is None else {"in_shardings": ins}
            if outs is not None:
                kw["out_shardings"] = outs
            j = self._jits[key] = jax.jit(self.fn, donate_argnums=self._donate, **kw)
        return key, j

    def lower(self, *args):
        _, j = self._jit(args)
        with use_mesh(self.mesh, self.rules):
            return j.lower(*args)

    def __call__(self, *args):
        key, j = self._jit(args)
        if jax.process_count() == 1:
            with use_mesh(self.mesh, self.rules):
                return j(*args)
        compiled = self._compiled.get(key)
        if compiled is None:
            with use_mesh(self.mesh, self.rules):
                compiled = j.lower(*args).compile()
            _BARRIERS[0] += 1
            barrier(f"compiled-{self.name}-{_BARRIERS[0]}")
            self._compiled[key] = compiled
        return compiled(*args)


_BARRIERS = [0]  # every process compiles the same programs in the same order


# --------------------------------------------------------------------------- host <-> global
def global_rows(n_local: int, mesh: Mesh, rules: Rules | None = None) -> int:
    """The global row count of a batch of which this process holds n_local rows: n_local x the
    number of processes when the batch axes split rows across processes, n_local when every
    process holds every row (batch axes inside each process). Raises when neither holds."""
    n = jax.process_count()
    if n == 1:
        return n_local
    for total in (n_local * n, n_local):
        rows = host_batch_slice(total, mesh=mesh, rules=rules)
        if rows.stop - rows.start == n_local:
            return total
    raise ValueError(f"a batch of {n_local} rows per process does not map onto mesh "
                     f"{dict(mesh.shape)} (rules batch={normalize_rules(rules)['batch']}): choose a batch "
                     "size the batch axes divide")


def to_global(local: Any, mesh: Mesh, rules: Rules | None = None, n_global: int | None = None):
    """Host-local rows -> global jax.Arrays with `batch_sharding` (leading dim = batch): this
    process's rows (`host_batch_slice(n_global, mesh=...)`) are `local`; n_global defaults to
    `global_rows`. Single process: the whole batch, placed on the mesh."""
    def one(x):
        x = np.asarray(x)
        n = global_rows(x.shape[0], mesh, rules) if n_global is None else n_global
        return jax.make_array_from_process_local_data(batch_sharding(mesh, n, rules), x,
                                                      (n,) + x.shape[1:])
    return jax.tree.map(one, local)


def host_rows(x: Any) -> Any:
    """The rows of global arrays (leading dim = batch) that this process's devices hold, as
    numpy (single process: the whole array). Other dimensions must be whole on this process."""
    def one(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return np.asarray(a)
        shards = a.addressable_shards
        starts = [(s.index[0].start or 0) if s.index else 0 for s in shards]
        stops = [a.shape[0] if (not s.index or s.index[0].stop is None) else s.index[0].stop
                 for s in shards]
        lo, hi = min(starts), max(stops)
        out = np.empty((hi - lo,) + a.shape[1:], a.dtype)
        seen = np.zeros(hi - lo, bool)
        for s, b, e in zip(shards, starts, stops):
            if s.data.shape[1:] != a.shape[1:]:
                raise ValueError(f"host_rows: an array of shape {a.shape} is split beyond its "
                                 f"rows on this process (shard {s.data.shape})")
            out[b - lo:e - lo] = np.asarray(s.data)
            seen[b - lo:e - lo] = True
        if not seen.all():
            raise ValueError(f"host_rows: this process's rows of {a.shape} are not contiguous")
        return out
    return jax.tree.map(one, x)


def allgather_json(obj: Any) -> list:
    """Every process's JSON-serialisable `obj`, in process order (one collective; single
    process: [obj])."""
    import json

    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    n = multihost_utils.process_allgather(np.array([data.size], np.int32))
    buf = np.zeros(int(np.max(n)), np.uint8)
    buf[:data.size] = data
    allb = multihost_utils.process_allgather(buf)
    n = np.asarray(n).reshape(-1)
    return [json.loads(bytes(allb[i][: int(n[i])]).decode()) for i in range(allb.shape[0])]


def every_process(flag: bool) -> bool:
    """Whether `flag` holds on every process (one small all-gather; single process: flag). For
    decisions that must be the same everywhere, e.g. whether every process has its next batch,
    so that one process's end ends every process instead of leaving the others in a
    collective."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32))))


def reduce_host_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Host-side metrics (each process's own rollouts) -> one value per key over all processes:
    keys ending in "_max" take the max, "_min" the min, count keys ("sandbox_failed",
    "rows_trained", ..."_count") the sum, everything else the mean over the processes that
    report the key (every process holds the same number of rows). Single process: unchanged."""
    if jax.process_count() == 1:
        return dict(metrics)
    per = allgather_json({k: float(v) for k, v in metrics.items()})
    out = {}
    for k in sorted({k for m in per for k in m}):
        vals = [m[k] for m in per if k in m]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k.endswith("_min"):
            out[k] = min(vals)
        elif k in _SUM_METRICS or k.endswith("_count"):
            out[k] = float(sum(vals))
        else:
            out[k] = float(np.mean(vals))
    return out


_SUM_METRICS = {"sandbox_failed", "rows_trained", "_sandbox_failed"}


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Host values that are the same on every process (numpy, or arrays of one device) ->
    fully replicated global jax.Arrays on `mesh` (what a multi-process program takes for
    small state such as a value head or an rng key)."""
    rep = replicated(mesh)

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, rep, lambda i: x[i])
    return jax.tree.map(one, tree)


def replica_mismatches(tree: Any) -> list[str]:
    """Leaves whose replicas disagree: every device holding the same slice of a leaf (a
    replicated parameter on every data-parallel device, a shard on every tensor-parallel peer)
    must hold the same bits. Hashes each process's shards (copied to host one at a time, never
    gathered) and compares them over every process (one small gather). [] when all agree."""
    import hashlib

    local: dict[str, list] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(x, jax.Array):
            continue
        name = jax.tree_util.keystr(path)
        for s in x.addressable_shards:
            idx = str(tuple((i.start, i.stop) for i in s.index))
            h = hashlib.sha1(np.ascontiguousarray(np.asarray(s.data)).tobytes()).hexdigest()
            local.setdefault(f"{name}{idx}", []).append(h)
    merged: dict[str, set] = {}
    for part in allgather_json(local):
        for k, hs in part.items():
            merged.setdefault(k, set()).update(hs)
    return sorted({k for k, hs in merged.items() if len(hs) > 1})
