"""Config-translation helpers shared by the checkpoint families (model/hf/<model_type>.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model.hf.safetensors_io import CheckpointError

# config.json fields that never change the forward pass (ids, bookkeeping, training-only)
GENERIC_IGNORED = frozenset({
    "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "output_router_logits",
    "attention_dropout", "router_aux_loss_coef", "model_type", "tokenizer_class",
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "problem_type", "id2label", "label2id",
    "generation_config", "aux_loss_alpha", "seq_aux", "_name_or_path"})


def bad(field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json: {field}={value!r}: {why}")


def check_fields(raw: dict, model_type: str, *, aliases: dict, ignored, required: dict, used,
                 exempt: Callable[[str, Any, dict], bool] = lambda *_: False) -> dict:
    """The fields of `used` under their canonical names (`aliases`: saved name -> canonical).
    A `required` field must hold its one supported value; `ignored` ones (and GENERIC_IGNORED)
    are dropped; anything else stops with CheckpointError naming the field and value."""
    out = {}
    for k, v in raw.items():
        name = aliases.get(k, k)
        if name in required:
            if v != required[name] and not exempt(name, v, raw):
                raise bad(k, v, f"not supported by this import (only {required[name]!r})")
            continue
        if name in ignored or name in GENERIC_IGNORED:
            continue
        if name not in used:
            raise bad(k, v, f"unknown field for model_type {model_type}: the import cannot "
                            "tell whether it changes the model, so it stops")
        out[name] = v
    return out


def period(s: str) -> str:
    """The shortest prefix of s that tiles it (ModelConfig.layer_pattern)."""
    for p in range(1, len(s) + 1):
        if all(s[i] == s[i % p] for i in range(len(s))):
            return s[:p]
    return s


def dense_prefix(c: dict, n: int, default_first_k: int) -> int:
    """The number of leading dense MLP layers (moe.first_dense_layers) from mlp_layer_types or
    first_k_dense_replace; only dense layers first, then sparse ones, are expressible."""
    mlp = c.get("mlp_layer_types")
    if mlp is None:
        k = min(c.get("first_k_dense_replace", default_first_k), n)
        mlp = ["dense" if i < k else "sparse" for i in range(n)]
    dense = sum(1 for t in mlp if t == "dense")
    if len(mlp) != n or mlp != ["dense"] * dense + ["sparse"] * (n - dense):
        raise bad("mlp_layer_types", mlp, "only dense layers first, then sparse ones, are "
                  "supported (moe.first_dense_layers)")
    return dense


def check_expressible(cfg, family: str, checks: list) -> None:
    """Stop export when a ModelConfig field has no place in `family`'s layout: `checks` are the
    family's own (ok, field, value) triples; the MoE, MTP and tied-embedding ones every family
    shares are added here. CheckpointError names the first field that is not expressible."""
    m = cfg.moe
    checks = [*checks,
              (m.num_experts > 0 and m.router == "sigmoid", "moe.router", m.router),
              (m.expert_format == "bf16", "moe.expert_format", m.expert_format),
              (cfg.mtp.depth == 0, "mtp.depth", cfg.mtp.depth),
              (not cfg.tie_embeddings, "tie_embeddings", cfg.tie_embeddings)]
    for ok, field, value in checks:
        if not ok:
            raise CheckpointError(f"model.{field}={value!r}: not expressible as a {family} "
                                  "checkpoint")
