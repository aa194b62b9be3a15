"""Frozen model configuration, built and validated from an ml_collections ConfigDict.

Each layer family receives only its own sub-config (KDAConfig, DSAConfig, MoEConfig, MTPConfig),
never the whole ModelConfig. `ModelConfig.from_dict` is the single place where a ConfigDict (or a
plain dict) becomes a model description; every inconsistency raises `ConfigError` naming the field.

The hybrid layout is data: `layer_pattern` (e.g. "KKKD") is tiled over `num_layers`; each letter is
a key of `ATTENTION_KINDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Layer letters of the hybrid pattern. The modules behind them live in model/transformer.py.
ATTENTION_KINDS = {"K": "kda", "D": "dsa"}
ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
EXPERT_PARALLEL = ("none", "all_to_all", "ragged_all_to_all")  # model/layers/moe.py
EXPERT_FORMATS = ("bf16", "mxfp4")
INDEXER_STAGES = ("dense_warmup", "sparse")
DSA_POSITIONS = ("rope", "nope")  # model/layers/dsa.py
ROPE_SCALINGS = ("none", "yarn")  # model/layers/rope.py
# Per-block rematerialisation (model/transformer.py:REMAT_POLICIES maps each to a jax.checkpoint
# policy): "none" keeps every activation, "full" keeps only block inputs, "save_dots" also keeps
# the outputs of weight matmuls (jax.checkpoint_policies.dots_with_no_batch_dims_saveable).
REMAT = ("none", "full", "save_dots")
KERNEL_IMPLS = ("auto", "xla", "pallas")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A model configuration field is missing, unknown or inconsistent."""


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention layer. K = V = head_dim unless v_head_dim is given."""

    num_heads: int
    head_dim: int
    v_head_dim: int = 0  # 0 -> head_dim
    conv_size: int = 4
    gate_rank: int = 0  # low-rank decay gate W_up W_down; 0 -> head_dim
    gate_lower_bound: float | None = None  # None: -exp(A_log)*softplus(.); else lb*sigmoid(.)
    chunk_size: int = 64
    impl: str = "auto"

    @property
    def k_dim(self) -> int:
        return self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rank(self) -> int:
        return self.gate_rank or self.head_dim


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """MLA attention with the DeepSeek-V3.2 lightning indexer and top-k token selection."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_rope_dim: int
    index_topk: int
    rope_theta: float = 10000.0
    indexer_stage: str = "sparse"  # "dense_warmup": dense attention, KL over all causal keys
    indexer_loss_weight: float = 0.0  # 0 disables the indexer KL (and its cost)
    impl: str = "auto"
    # Positions (model/layers/dsa.py): "rope" rotates q_pe/k_pe and the indexer's rope channels;
    # "nope" rotates nothing (Kimi Linear's MLA layers; the indexer follows, see dsa.py).
    positions: str = "rope"
    # Long-context RoPE scaling (model/layers/rope.py: YaRN as in DeepSeek-V3): "none" | "yarn".
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # s: context extension factor (1 = plain RoPE)
    rope_original_max_position: int = 4096  # the pre-extension training length L
    rope_beta_fast: float = 32.0  # dims with > beta_fast rotations over L keep their frequency
    rope_beta_slow: float = 1.0  # dims with < beta_slow rotations over L are interpolated by 1/s
    rope_mscale: float = 1.0  # rotary channels scaled by mscale(s, this) / mscale(s, all_dim)
    rope_mscale_all_dim: float = 1.0  # softmax scale multiplied by mscale(s, this)**2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # width of one cached token: latent KV + shared rope key
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse feed-forward: routed experts + shared experts; first `first_dense_layers` are dense."""

    num_experts: int
    num_experts_per_tok: int
    expert_dim: int
    num_shared_experts: int = 1
    dense_dim: int = 0  # feed-forward width of the first dense layers (and MoE-free models)
    first_dense_layers: int = 0
    router: str = "sigmoid"  # "softmax" top-k or "sigmoid" + bias (auxiliary-loss-free)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    dispatch: str = "dropless"  # or "capacity" (drops past capacity, counted)
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.0  # sequence-wise load-balancing loss weight (alpha)
    bias_update_rate: float = 1e-3  # aux-free bias step (gamma)
    expert_format: str = "bf16"  # "mxfp4": experts stored as packed MXFP4
    qat: bool = False  # fake-quantise bf16 experts to MXFP4 in the forward (STE)
    mxfp4_impl: str = "auto"
    # Expert-parallel dispatch under model.sharding.use_mesh: "none" (GSPMD on the local path),
    # "all_to_all" (capacity-padded, every backend), "ragged_all_to_all" (GPU/TPU only).
    expert_parallel: str = "none"


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
    kda: KDAConfig
    dsa: DSAConfig
    moe: MoEConfig
    mtp: MTPConfig = MTPConfig()
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: str = "float32"  # activations
    param_dtype: str = "float32"
    remat: str = "none"  # per-block rematerialisation policy, one of REMAT (see above)
    name: str = "custom"

    # ----- derived -----
    def layer_kinds(self) -> tuple[str, ...]:
        """The attention letter of every layer: the pattern tiled over num_layers."""
        p = self.layer_pattern
        return tuple(p[i % len(p)] for i in range(self.num_layers))

    def is_moe_layer(self, i: int) -> bool:
        return self.moe.num_experts > 0 and i >= self.moe.first_dense_layers

    # ----- building -----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a ConfigDict / dict with sub-dicts kda, dsa, moe, mtp; validates."""
        d = _to_plain(d)
        subs = {"kda": KDAConfig, "dsa": DSAConfig, "moe": MoEConfig, "mtp": MTPConfig}
        kwargs = {}
        for k, v in d.items():
            if k in subs:
                kwargs[k] = _build(subs[k], v, prefix=k)
            else:
                kwargs[k] = v
        cfg = _build(cls, kwargs, prefix="model")
        cfg.validate()
        return cfg

    def replace(self, **kw) -> ModelConfig:
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        _check(self.vocab_size > 0, "model.vocab_size", "must be positive")
        _check(self.d_model > 0, "model.d_model", "must be positive")
        _check(self.num_layers > 0, "model.num_layers", "must be positive")
        _check(len(self.layer_pattern) > 0, "model.layer_pattern", "must be non-empty")
        for ch in self.layer_pattern:
            _check(ch in ATTENTION_KINDS, "model.layer_pattern",
                   f"unknown layer letter {ch!r}; valid letters: {sorted(ATTENTION_KINDS)}")
        _check(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}")
        _check(self.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}")
        _check(self.remat in REMAT, "model.remat",
               f"unknown rematerialisation policy {self.remat!r}; must be one of {REMAT} "
               "(none: keep every activation, full: recompute each block in the backward pass, "
               "save_dots: keep weight-matmul outputs, recompute the rest)")
        kinds = set(self.layer_kinds()) | ({self.mtp.layer_kind} if self.mtp.depth else set())
        k, s, m = self.kda, self.dsa, self.moe
        if "K" in kinds:
            _check(k.num_heads > 0 and k.head_dim > 0, "kda.num_heads/head_dim", "must be positive")
            _check(k.conv_size >= 1, "kda.conv_size", "must be >= 1")
            _check(k.chunk_size in (16, 32, 64, 128), "kda.chunk_size", "must be 16, 32, 64 or 128")
            _check(k.impl in KERNEL_IMPLS, "kda.impl", f"must be one of {KERNEL_IMPLS}")
            if k.gate_lower_bound is not None:
                _check(k.gate_lower_bound < 0, "kda.gate_lower_bound", "must be negative (or None)")
        if "D" in kinds:
            for f in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                      "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                      "index_topk"):
                _check(getattr(s, f) > 0, f"dsa.{f}", "must be positive")
            _check(s.qk_rope_head_dim % 2 == 0, "dsa.qk_rope_head_dim", "must be even (RoPE pairs)")
            _check(0 <= s.index_rope_dim <= s.index_head_dim and s.index_rope_dim % 2 == 0,
                   "dsa.index_rope_dim", "must be even and <= dsa.index_head_dim")
            _check(s.indexer_stage in INDEXER_STAGES, "dsa.indexer_stage",
                   f"must be one of {INDEXER_STAGES}")
            _check(s.impl in KERNEL_IMPLS, "dsa.impl", f"must be one of {KERNEL_IMPLS}")
            self._validate_dsa_positions()
        if m.num_experts > 0:
            _check(0 < m.num_experts_per_tok <= m.num_experts, "moe.num_experts_per_tok",
                   f"top_k={m.num_experts_per_tok} must be in [1, num_experts={m.num_experts}]")
            _check(m.expert_dim > 0, "moe.expert_dim", "must be positive")
            _check(m.router in ROUTERS, "moe.router", f"must be one of {ROUTERS}")
            _check(m.dispatch in DISPATCH, "moe.dispatch", f"must be one of {DISPATCH}")
            _check(m.expert_format in EXPERT_FORMATS, "moe.expert_format",
                   f"must be one of {EXPERT_FORMATS}")
            _check(m.capacity_factor > 0, "moe.capacity_factor", "must be positive")
            _check(0 <= m.first_dense_layers <= self.num_layers, "moe.first_dense_layers",
                   f"must be in [0, num_layers={self.num_layers}]")
            if m.expert_format == "mxfp4":
                _check(self.d_model % 32 == 0 and m.expert_dim % 32 == 0,
                       "moe.expert_format",
                       "mxfp4 needs d_model and moe.expert_dim to be multiples of 32")
            _check(m.mxfp4_impl in KERNEL_IMPLS, "moe.mxfp4_impl", f"must be one of {KERNEL_IMPLS}")
            _check(m.expert_parallel in EXPERT_PARALLEL, "moe.expert_parallel",
                   f"must be one of {EXPERT_PARALLEL}")
        if m.num_experts == 0 or m.first_dense_layers > 0:
            _check(m.dense_dim > 0, "moe.dense_dim",
                   "must be positive when some layers are dense (num_experts=0 or first_dense_layers>0)")
        _check(self.mtp.depth >= 0, "mtp.depth", "must be >= 0")
        _check(self.mtp.layer_kind in ATTENTION_KINDS, "mtp.layer_kind",
               f"unknown layer letter {self.mtp.layer_kind!r}; valid: {sorted(ATTENTION_KINDS)}")

    def _validate_dsa_positions(self) -> None:
        s = self.dsa
        _check(s.positions in DSA_POSITIONS, "dsa.positions",
               f"must be one of {DSA_POSITIONS} (rope: rotary positions; nope: none, as in "
               "Kimi Linear's MLA layers)")
        _check(s.rope_scaling in ROPE_SCALINGS, "dsa.rope_scaling",
               f"must be one of {ROPE_SCALINGS}")
        _check(s.rope_theta > 0, "dsa.rope_theta", "must be positive")
        if s.rope_scaling == "none":
            return
        _check(s.positions == "rope", "dsa.rope_scaling",
               f"{s.rope_scaling!r} scales rotary positions, but dsa.positions='nope' has none: "
               "set dsa.rope_scaling='none' or dsa.positions='rope'")
        _check(s.rope_factor >= 1.0, "dsa.rope_factor",
               f"must be >= 1 (the context extension factor), got {s.rope_factor}")
        _check(s.rope_original_max_position > 0, "dsa.rope_original_max_position",
               "must be positive (the context length the model was trained at before scaling)")
        _check(0 < s.rope_beta_slow < s.rope_beta_fast, "dsa.rope_beta_fast/rope_beta_slow",
               f"need 0 < beta_slow < beta_fast, got beta_slow={s.rope_beta_slow}, "
               f"beta_fast={s.rope_beta_fast}")
        _check(s.rope_mscale >= 0 and s.rope_mscale_all_dim >= 0,
               "dsa.rope_mscale/rope_mscale_all_dim", "must be >= 0")
        reach = s.rope_factor * s.rope_original_max_position
        _check(self.max_seq_len <= reach, "model.max_seq_len",
               f"{self.max_seq_len} is beyond what YaRN is configured for (dsa.rope_factor x "
               f"dsa.rope_original_max_position = {reach:g}): raise dsa.rope_factor")


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
