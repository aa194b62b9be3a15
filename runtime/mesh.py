"""Logical-axis sharding rules and the active mesh: the vocabulary that the model, its Pallas
kernels (pallas_kernels/partition.py) and the drivers share, below all of them. model/sharding.py
builds meshes, shardings and multi-host set-up on it and re-exports these names.

Mesh axes, outer to inner: data, fsdp, expert, tensor (model/sharding.py's docstring says what
each one splits). `use_mesh` makes a mesh and its rules visible to code traced inside the block;
`current_mesh` / `current_rules` read it; `logical_to_spec` maps an array's logical axis names to
a PartitionSpec on a mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical name -> mesh axes (None, "axis" or ("axis", ...)). Parameter names come from the model
# layers; activation names ("batch", "length", "act_*") are used with `constrain`.
# Parameters: ZeRO-3 over the whole data-parallel group of the dense layers, fsdp x expert (the
# expert axis is a batch axis outside the MoE); an expert matrix's "expert" dim takes the expert
# axis first, so its "embed" dim gets fsdp only. Low-rank dims (q_lora, kv_lora, rank) also take
# fsdp x expert, so every large matrix is split on some dim.
DEFAULT_RULES: dict[str, Any] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "expert"),
    # MTP combine input (2*d_model). Not "tensor": with it, value_and_grad of the test model on
    # (2,2,1,2) / (2,1,2,2) meshes gave wrong values (an XLA SPMD partitioning problem, seen on
    # XLA:CPU with jax 0.10.2; tests/rl/test_sharded_rl.py's (2,1,2,2) mesh and
    # the two-process step in tests/model/test_sharding.py would catch a regression).
    "embed2": None,
    "heads": "tensor",
    "mlp": "tensor",
    "mlp_out": "tensor",  # MXFP4 expert blocks: output features
    "blocks": ("fsdp", "expert"),  # MXFP4 expert blocks: input features / 32
    "nibbles": None,
    "expert": "expert",
    "rank": ("fsdp", "expert"),
    "kv_lora": ("fsdp", "expert"),
    "q_lora": ("fsdp", "expert"),
    "head_dim": None,
    "norm": None,
    "conv": None,
    # the stacking axis of scanned layer groups (model/transformer.py:scanned_group), unsplit
    "layers": None,
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}

# Activation axes at a block boundary ([B,T,D] residual stream).
BLOCK_AXES = ("batch", "length", "act_embed")

Rules = Mapping[str, Any]


def as_axes(v: Any) -> tuple[str, ...]:
    """None | "" | "none" | "a" | "a,b" | ("a", "b") -> tuple of mesh axis names."""
    if v is None:
        return ()
    if isinstance(v, str):
        v = v.strip()
        if v.lower() in ("", "none", "replicated"):
            return ()
        return tuple(a.strip() for a in v.split(",") if a.strip())
    return tuple(str(a) for a in v)


def make_rules(overrides: Mapping[str, Any] | None = None) -> dict[str, tuple[str, ...]]:
    """DEFAULT_RULES with `overrides` applied, normalised to tuples of mesh axis names."""
    rules = {k: as_axes(v) for k, v in DEFAULT_RULES.items()}
    for k, v in (overrides or {}).items():
        rules[str(k)] = as_axes(v)
    return rules


def normalize_rules(rules: Rules | None) -> dict[str, tuple[str, ...]]:
    if rules is None:
        return make_rules()
    return {k: as_axes(v) for k, v in rules.items()}


def mesh_sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return dict(mesh)
    return dict(mesh.shape)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int],
                    mesh: Mesh | Mapping[str, int], rules: Rules | None = None,
                    report: list | None = None) -> P:
    """PartitionSpec for one array with logical axis `names` and `shape` (see module docstring
    for the skipping rules). `report`, if given, receives (dim, name, axis, size, dim_size) for
    every axis skipped because it does not divide the dimension."""
    rules = normalize_rules(rules)
    sizes = mesh_sizes(mesh)
    used: set[str] = set()
    entries = []
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    for dim, (name, n) in enumerate(zip(names, shape)):
        axes = []
        prod = 1
        for a in (rules.get(name, ()) if name is not None else ()):
            s = sizes.get(a, 1)
            if s == 1 or a in used:
                continue
            if n % (prod * s):
                if report is not None:
                    report.append((dim, name, a, s, n))
                continue
            axes.append(a)
            used.add(a)
            prod *= s
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("model_sharding_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None):
    """Make `mesh` (and rules) visible to model code traced inside the block."""
    token = _ACTIVE.set((mesh, normalize_rules(rules)))
    try:
        yield mesh
    finally:
        _ACTIVE.reset(token)


def current_mesh() -> Mesh | None:
    ctx = _ACTIVE.get()
    return None if ctx is None else ctx[0]


def current_rules() -> dict[str, tuple[str, ...]]:
    ctx = _ACTIVE.get()
    return make_rules() if ctx is None else ctx[1]


def in_manual_region() -> bool:
    try:
        am = jax.sharding.get_abstract_mesh()
        return bool(getattr(am, "manual_axes", ()))
    except Exception:  # pragma: no cover - older/newer APIs
        return False


def active() -> tuple[Mesh, dict[str, tuple[str, ...]]] | None:
    """(mesh, rules) set by the innermost `use_mesh`, or None outside one."""
    return _ACTIVE.get()
