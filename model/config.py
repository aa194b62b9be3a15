"""Frozen model configuration, built and validated from an ml_collections ConfigDict.

Each layer family receives only its own sub-config (KDAConfig, DSAConfig, MoEConfig, MTPConfig),
never the whole ModelConfig. `ModelConfig.from_dict` is the single place where a ConfigDict (or a
plain dict) becomes a model description; every inconsistency raises `ConfigError` naming the field.

The hybrid layout is data: `layer_pattern` (e.g. "KKKD") is tiled over `num_layers`; each letter is
a layer kind of the registry (model/layers/registry.py), which also gives the kind's config
section: the kind's config class (defined next to its layer, e.g. KDAConfig in
model/layers/kda.py) builds and validates it. The built-in kinds' sections are the fields `kda`
and `dsa`; sections of kinds registered elsewhere live in `layer_sections` and read the same way
(`cfg.section(name)`, or `cfg.<name>`).

Imports run one way: model/config_base.py (ConfigError, require, check_kernel, MoEConfig and the
choice tuples, all re-exported here) is a leaf the layers import too; this module imports it and
the registry, and hands the registry its own field names (`registry.reserve_sections`), which no
registered kind's section may take.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from model.config_base import (
    DISPATCH,
    EXPERT_FORMATS,
    EXPERT_PARALLEL,
    GROUPED_MATMUL,
    KERNEL_IMPLS,
    ROUTERS,
    ConfigError,
    MoEConfig,
    check_kernel,
    require,
)
from model.layers import registry

if TYPE_CHECKING:
    from model.layers.dsa import DSAConfig
    from model.layers.kda import KDAConfig

# Per-block rematerialisation (model/transformer.py:REMAT_POLICIES maps each to a jax.checkpoint
# policy): "none" keeps every activation, "full" keeps only block inputs, "save_dots" also keeps
# the outputs of weight matmuls (jax.checkpoint_policies.dots_with_no_batch_dims_saveable).
REMAT = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")


# the variable name of a scanned span of layer_groups() (`span_name`), for code that must
# recognise one in a variables path (export, PTQ, checkpoint messages)
SPAN_NAME_RE = re.compile(r"layers_(\d+)_(\d+)")


def span_name(start: int, period: int, repeats: int) -> str:
    """Variable name of a span of ModelConfig.layer_groups(): `layer_<i>` for a single layer,
    `layers_<first>_<last>` for a scanned one (its blocks `block_<j>`, stacked [repeats])."""
    if repeats == 1:
        return f"layer_{start}"
    return f"layers_{start}_{start + period * repeats - 1}"


_check = require


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    depth: int = 0
    loss_weight: float = 0.3
    layer_kind: str = "D"  # attention kind of the MTP block


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    layer_pattern: str
    kda: KDAConfig  # section of layer kind "K" (model/layers/kda.py)
    dsa: DSAConfig  # section of layer kind "D" (model/layers/dsa.py)
    moe: MoEConfig
    mtp: MTPConfig = MTPConfig()
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: str = "float32"  # activations
    param_dtype: str = "float32"
    remat: str = "none"  # per-block rematerialisation policy, one of REMAT (see above)
    # scan repeated layer groups (`layer_groups`): identical consecutive periods of the pattern
    # run as one lax.scan over parameters stacked on a leading "layers" axis, so XLA compiles
    # each distinct group once instead of once per layer (model/transformer.py)
    scan_layers: bool = False
    name: str = "custom"
    # sections of layer kinds registered outside this file: ((section name, config), ...),
    # sorted by name; built by from_dict / replace from keyword sections (`conv=...`)
    layer_sections: tuple[tuple[str, Any], ...] = ()

    # ----- derived -----
    def layer_kinds(self) -> tuple[str, ...]:
        """The layer-kind letter of every layer: the pattern tiled over num_layers."""
        p = self.layer_pattern
        return tuple(p[i % len(p)] for i in range(self.num_layers))

    def kinds_used(self) -> set[str]:
        """The layer-kind letters the model builds: the trunk's and the MTP block's."""
        return set(self.layer_kinds()) | ({self.mtp.layer_kind} if self.mtp.depth else set())

    def is_moe_layer(self, i: int) -> bool:
        return self.moe.num_experts > 0 and i >= self.moe.first_dense_layers

    def layer_groups(self) -> tuple[tuple[int, int, int], ...]:
        """The trunk as (start, period, repeats) spans, in layer order, covering every layer
        once. Without `scan_layers` every layer is its own span (i, 1, 1). With it, a span
        (s, p, r) with r >= 2 stacks r consecutive copies of the p = len(layer_pattern) layers
        from s (same kinds, same MoE/dense choice; layer s + t*p + j is copy t of block j);
        layers that start no such repeat (e.g. the first dense layers) stay (i, 1, 1).
        Greedy from layer 0: KKKD x 16 layers with one dense first layer gives (0, 1, 1),
        (1, 4, 3), (13, 1, 1), (14, 1, 1), (15, 1, 1)."""
        n = self.num_layers
        if not self.scan_layers:
            return tuple((i, 1, 1) for i in range(n))
        p = len(self.layer_pattern)
        sig = [(k, self.is_moe_layer(i)) for i, k in enumerate(self.layer_kinds())]
        groups, i = [], 0
        while i < n:
            r = 1
            while i + (r + 1) * p <= n and sig[i:i + p] == sig[i + r * p:i + (r + 1) * p]:
                r += 1
            if r >= 2:
                groups.append((i, p, r))
                i += r * p
            else:
                groups.append((i, 1, 1))
                i += 1
        return tuple(groups)

    def section(self, name: str):
        """The config section `name` of a layer kind (a field, or one of layer_sections)."""
        if name in _FIELDS:
            return getattr(self, name)
        for key, value in self.layer_sections:
            if key == name:
                return value
        raise ConfigError(f"model.{name}: no such section; layer sections here: "
                          f"{sorted(k.section for k in registry.kinds().values())}")

    def __getattr__(self, name: str):
        # cfg.<section> for the sections of registered kinds (called only for unknown names)
        if not name.startswith("_") and name != "layer_sections":
            for key, value in self.layer_sections:
                if key == name:
                    return value
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ----- building -----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a ConfigDict / dict with sub-dicts kda, dsa, moe, mtp (and the sections
        of registered layer kinds); validates."""
        d = _to_plain(d)
        subs = {"moe": MoEConfig, "mtp": MTPConfig,
                **{name: kind.config for name, kind in registry.sections().items()}}
        kwargs, extra = {}, {}
        for k, v in d.items():
            if k == "layer_sections":  # the dataclasses.asdict form: [(name, {...}), ...]
                for name, sub in v:
                    _check(name in subs and name not in _FIELDS, f"model.layer_sections.{name}",
                           f"not a registered layer section; registered: {sorted(subs)}")
                    extra[name] = _build(subs[name], sub, prefix=name)
            elif k in subs:
                built = _build(subs[k], v, prefix=k)
                if k in _FIELDS:
                    kwargs[k] = built
                else:
                    extra[k] = built
            else:
                kwargs[k] = v
        kwargs["layer_sections"] = tuple(sorted(extra.items()))
        cfg = _build(cls, kwargs, prefix="model")
        cfg.validate()
        return cfg

    def replace(self, **kw) -> ModelConfig:
        """A validated copy with fields (or registered layer sections) replaced."""
        extra = dict(self.layer_sections)
        registered = registry.sections()
        for k in [k for k in kw if k not in _FIELDS]:
            _check(k in registered, f"model.{k}",
                   f"unknown field; valid fields: {sorted(_FIELDS)} and layer sections "
                   f"{sorted(registered)}")
            extra[k] = kw.pop(k)
        if extra or "layer_sections" not in kw:
            kw["layer_sections"] = tuple(sorted(extra.items()))
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        kinds = registry.kinds()
        _check(self.vocab_size > 0, "model.vocab_size", "must be positive")
        _check(self.d_model > 0, "model.d_model", "must be positive")
        _check(self.num_layers > 0, "model.num_layers", "must be positive")
        _check(len(self.layer_pattern) > 0, "model.layer_pattern", "must be non-empty")
        for ch in self.layer_pattern:
            _check(ch in kinds, "model.layer_pattern",
                   f"unknown layer letter {ch!r}; valid letters: {sorted(kinds)}")
        _check(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}")
        _check(self.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}")
        _check(self.remat in REMAT, "model.remat",
               f"unknown rematerialisation policy {self.remat!r}; must be one of {REMAT} "
               "(none: keep every activation, full: recompute each block in the backward pass, "
               "save_dots: keep weight-matmul outputs, recompute the rest)")
        _check(self.mtp.layer_kind in kinds, "mtp.layer_kind",
               f"unknown layer letter {self.mtp.layer_kind!r}; valid: {sorted(kinds)}")
        registered = {kind.section for kind in kinds.values()}
        for name, _ in self.layer_sections:
            _check(name in registered and name not in _FIELDS, f"model.{name}",
                   f"not a registered layer section; registered: {sorted(registered)}")
        used = self.kinds_used()
        for letter, kind in kinds.items():
            if letter not in used:
                continue
            names = {k for k, _ in self.layer_sections} | _FIELDS
            _check(kind.section in names, f"model.{kind.section}",
                   f"layer kind {letter!r} ({kind.name}) is in the layout but its config section "
                   f"{kind.section!r} is missing: add it ({kind.config.__name__} fields)")
            sec = self.section(kind.section)
            _check(isinstance(sec, kind.config), f"model.{kind.section}",
                   f"must be a {kind.config.__name__}, got {type(sec).__name__}")
            sec.validate(self, kind.section)
        m = self.moe
        if m.num_experts > 0:
            _check(0 < m.num_experts_per_tok <= m.num_experts, "moe.num_experts_per_tok",
                   f"top_k={m.num_experts_per_tok} must be in [1, num_experts={m.num_experts}]")
            _check(m.expert_dim > 0, "moe.expert_dim", "must be positive")
            _check(m.router in ROUTERS, "moe.router", f"must be one of {ROUTERS}")
            _check(m.n_group >= 1 and m.num_experts % m.n_group == 0, "moe.n_group",
                   f"must be >= 1 and divide num_experts={m.num_experts}, got {m.n_group}")
            _check(1 <= m.topk_group <= m.n_group, "moe.topk_group",
                   f"must be in [1, n_group={m.n_group}], got {m.topk_group}")
            if m.n_group > 1:
                _check(m.router == "sigmoid", "moe.n_group",
                       "group-limited routing (n_group > 1) is defined for router='sigmoid'")
                _check(m.num_experts // m.n_group >= 2, "moe.n_group",
                       "each group needs >= 2 experts (a group scores by its top two)")
                _check(m.num_experts_per_tok <= m.topk_group * (m.num_experts // m.n_group),
                       "moe.topk_group", f"the {m.topk_group} chosen group(s) hold fewer than "
                       f"num_experts_per_tok={m.num_experts_per_tok} experts")
            _check(m.dispatch in DISPATCH, "moe.dispatch", f"must be one of {DISPATCH}")
            _check(m.grouped_matmul in GROUPED_MATMUL, "moe.grouped_matmul",
                   f"must be one of {GROUPED_MATMUL}")
            _check(m.expert_format in EXPERT_FORMATS, "moe.expert_format",
                   f"must be one of {EXPERT_FORMATS}")
            _check(m.capacity_factor > 0, "moe.capacity_factor", "must be positive")
            _check(m.all_experts_max_rows >= 0, "moe.all_experts_max_rows",
                   "must be >= 0 (0: always sort and group)")
            _check(0 <= m.first_dense_layers <= self.num_layers, "moe.first_dense_layers",
                   f"must be in [0, num_layers={self.num_layers}]")
            if m.expert_format == "mxfp4":
                _check(self.d_model % 32 == 0 and m.expert_dim % 32 == 0,
                       "moe.expert_format",
                       "mxfp4 needs d_model and moe.expert_dim to be multiples of 32")
            _check(m.mxfp4_impl in KERNEL_IMPLS, "moe.mxfp4_impl", f"must be one of {KERNEL_IMPLS}")
            if m.expert_format == "mxfp4":
                from pallas_kernels.mxfp4.ops import GROUPED_DISPATCH  # noqa: PLC0415

                for k_dim, src in ((self.d_model, "model.d_model"),
                                   (m.expert_dim, "moe.expert_dim")):
                    check_kernel(GROUPED_DISPATCH, m.mxfp4_impl, "moe.mxfp4_impl",
                                 f"(K = {src} = {k_dim})", K=k_dim, dtype=self.dtype)
            _check(m.expert_parallel in EXPERT_PARALLEL, "moe.expert_parallel",
                   f"must be one of {EXPERT_PARALLEL}")
        if m.num_experts == 0 or m.first_dense_layers > 0:
            _check(m.dense_dim > 0, "moe.dense_dim",
                   "must be positive when some layers are dense (num_experts=0 or first_dense_layers>0)")
        _check(self.mtp.depth >= 0, "mtp.depth", "must be >= 0")


_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - {"layer_sections"}
registry.reserve_sections(f.name for f in dataclasses.fields(ModelConfig))


def _to_plain(d: Any) -> Any:
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    if isinstance(d, Mapping):
        return {k: _to_plain(v) for k, v in d.items()}
    return d


def _build(cls, values: Mapping[str, Any], prefix: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown field; valid fields: {sorted(names)}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}: required field is missing")
    return cls(**values)
