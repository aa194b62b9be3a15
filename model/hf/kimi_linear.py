"""`model_type` "kimi_linear" (transformers' KimiLinearForCausalLM, Moonshot's Kimi-Linear
checkpoints): config.json <-> ModelConfig, and the tensor recipes of its checkpoint layout.

What the reference computes, as this model's options:
  "linear_attention" layers -> kind "K" (KDA): q/k/v projections and their three depthwise
      convs concatenated into `qkv` / `conv` (channels q | k | v); forget gate f_a/f_b (rank =
      head_dim: kda.gate_rank 0), A_log [1,1,H,1] -> [H], dt_bias [H*K]; softplus gate
      (kda.gate_lower_bound None); beta = sigmoid(b_proj); output gate g_a/g_b into the
      RMSNorm-then-sigmoid-gate o_norm (eps rms_norm_eps); K = V = linear_head_dim.
  "full_attention" layers -> kind "D" with dsa.indexer=False (plain MLA, every causal key),
      dsa.positions="nope" (no rotation anywhere: the rope channels are content channels),
      q_lora_rank null -> dsa.q_lora_rank=0 (q straight from x), and dsa.latent_norm_eps=1e-6
      (the reference builds q_a_layernorm / kv_a_layernorm with their default eps, not
      rms_norm_eps); kv_b_proj splits into the absorbed w_uk / w_uv.
  "sparse" MLP layers -> MoE with router="sigmoid", the e_score_correction_bias as the
      router_state bias, group-limited selection (moe.n_group / topk_group), norm_topk_prob,
      routed_scaling_factor, num_shared_experts; per-expert w1 (gate) / w3 (up) / w2 (down)
      stacked to [E, ...]; "dense" ones (a prefix: moe.first_dense_layers) -> the dense MLP.
The layer_types list becomes the shortest period string that tiles it (`layer_pattern`).

Config names: both transformers' canonical names and the ones its config.json is saved with
(attribute_map: model_max_length, moe_renormalize, num_expert_group, num_experts,
num_experts_per_token, num_shared_experts), and the original checkpoints' linear_attn_config
{head_dim, num_heads, short_conv_kernel_size, kda_layers, full_attn_layers (1-based)} and
first_k_dense_replace. Fields that would change the computation and are not honoured
(tie_word_embeddings true, attention_bias true, a non-SiLU act, num_key_value_heads !=
num_attention_heads, MTP layers, non-sigmoid router, mla_use_nope false, rope_scaling) stop the
import with CheckpointError naming the field and its value; so does any field not known here.
"""

from __future__ import annotations

from model.config import ModelConfig
from model.hf.common import bad as _bad
from model.hf.common import check_expressible, check_fields, dense_prefix, period
from model.hf.recipes import (
    Recipe,
    concat_convs,
    concat_linears,
    copy,
    linear,
    mla_kv_b,
    reshaped,
    stacked_linears,
)
from model.hf.safetensors_io import CheckpointError

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"

# saved name -> canonical name (transformers' KimiLinearConfig.attribute_map, reversed)
ALIASES = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
           "num_expert_group": "n_group", "num_experts": "num_local_experts",
           "num_experts_per_token": "num_experts_per_tok",
           "num_shared_experts": "n_shared_experts"}
# fields that do not change the forward pass (ids, bookkeeping, training-only, derived)
IGNORED = {"head_dim", "qk_head_dim", "rope_theta"}  # derived, or unused (NoPE)
# field -> the only value honoured (anything else stops the import)
REQUIRED = {"hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "pretraining_tp": 1, "num_nextn_predict_layers": 0, "mla_use_nope": True,
            "moe_router_activation_func": "sigmoid", "rope_scaling": None,
            "use_grouped_topk": True, "moe_layer_freq": 1}
USED = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
        "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
        "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "num_local_experts",
        "mlp_layer_types", "layer_types", "linear_head_dim", "linear_num_heads",
        "linear_conv_kernel_dim", "linear_attn_config", "first_k_dense_replace"}
LATENT_NORM_EPS = 1e-6  # KimiLinearRMSNorm's default, used for q_a / kv_a_layernorm
KINDS = {"linear_attention": "K", "full_attention": "D"}


def canonical(raw: dict) -> dict:
    """config.json with saved aliases renamed, every field checked (module docstring)."""
    return check_fields(raw, MODEL_TYPE, aliases=ALIASES, ignored=IGNORED, required=REQUIRED,
                        used=USED, exempt=_grouped_topk_off_without_groups)


def _grouped_topk_off_without_groups(name: str, value, raw: dict) -> bool:
    # use_grouped_topk false with one group selects the same experts as true
    return name == "use_grouped_topk" and value is False and raw.get("num_expert_group", 1) == 1


def _layer_types(c: dict) -> list[str]:
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    lac = c.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for i in lac["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear_attention"
    if types is None:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in KINDS for t in types):
        raise _bad("layer_types", types, f"need {n} entries from {sorted(KINDS)}")
    return types


def to_config(raw: dict, *, dtype: str = "float32", param_dtype: str = "float32"
              ) -> ModelConfig:
    """ModelConfig of a kimi_linear config.json (dict), validated."""
    c = canonical(raw)
    lac = c.get("linear_attn_config") or {}
    for k in lac:
        if k not in ("head_dim", "num_heads", "short_conv_kernel_size", "kda_layers",
                     "full_attn_layers"):
            raise _bad(f"linear_attn_config.{k}", lac[k], "unknown field")
    n = c["num_hidden_layers"]
    H = c.get("num_attention_heads", 32)
    if c.get("num_key_value_heads", H) not in (None, H):
        raise _bad("num_key_value_heads", c["num_key_value_heads"],
                   f"must equal num_attention_heads={H} (MLA)")
    dense = dense_prefix(c, n, default_first_k=1)
    E = c.get("num_local_experts", 256)
    d = dict(
        vocab_size=c.get("vocab_size", 163840), d_model=c.get("hidden_size", 2304),
        num_layers=n,
        layer_pattern=period("".join(KINDS[t] for t in _layer_types(c))),
        kda=dict(num_heads=lac.get("num_heads", c.get("linear_num_heads", 32)),
                 head_dim=lac.get("head_dim", c.get("linear_head_dim", 128)),
                 conv_size=lac.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4))),
        dsa=dict(num_heads=H, q_lora_rank=c.get("q_lora_rank") or 0,
                 kv_lora_rank=c.get("kv_lora_rank", 512),
                 qk_nope_head_dim=c.get("qk_nope_head_dim", 128),
                 qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
                 v_head_dim=c.get("v_head_dim") or 128, index_n_heads=0, index_head_dim=0,
                 index_rope_dim=0, index_topk=0, indexer=False, positions="nope",
                 latent_norm_eps=LATENT_NORM_EPS),
        moe=dict(num_experts=E, num_experts_per_tok=c.get("num_experts_per_tok", 8),
                 expert_dim=c.get("moe_intermediate_size", 1024),
                 num_shared_experts=c.get("n_shared_experts", 1),
                 dense_dim=c.get("intermediate_size", 9216), first_dense_layers=dense,
                 router="sigmoid", norm_topk_prob=c.get("norm_topk_prob", True),
                 routed_scaling_factor=float(c.get("routed_scaling_factor", 2.446)),
                 n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1) or 1),
        max_seq_len=c.get("max_position_embeddings", 1048576),
        norm_eps=float(c.get("rms_norm_eps", 1e-5)), tie_embeddings=False,
        dtype=dtype, param_dtype=param_dtype, name="kimi_linear")
    try:
        return ModelConfig.from_dict(d)
    except ValueError as e:
        raise CheckpointError(f"config.json does not make a valid model: {e}") from None


def from_config(cfg: ModelConfig) -> dict:
    """config.json (transformers' canonical names) of a model this layout can hold; raises
    CheckpointError naming the first field it cannot express."""
    k, a, m = cfg.kda, cfg.dsa, cfg.moe
    checks = [
        (set(cfg.layer_pattern) <= {"K", "D"}, "layer_pattern", cfg.layer_pattern),
        (k.v_dim == k.k_dim and k.rank == k.k_dim, "kda.v_head_dim/gate_rank",
         (k.v_head_dim, k.gate_rank)),
        (k.gate_lower_bound is None, "kda.gate_lower_bound", k.gate_lower_bound),
        (not a.indexer, "dsa.indexer", a.indexer),
        (a.positions == "nope", "dsa.positions", a.positions),
        ((a.latent_norm_eps or cfg.norm_eps) == LATENT_NORM_EPS, "dsa.latent_norm_eps",
         a.latent_norm_eps),
    ]
    check_expressible(cfg, "kimi_linear", checks)
    n = cfg.num_layers
    inv = {v: t for t, v in KINDS.items()}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": m.dense_dim, "moe_intermediate_size": m.expert_dim,
        "num_hidden_layers": n, "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_heads, "n_shared_experts": m.num_shared_experts,
        "routed_scaling_factor": m.routed_scaling_factor, "kv_lora_rank": a.kv_lora_rank,
        "q_lora_rank": a.q_lora_rank or None, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim, "qk_nope_head_dim": a.qk_nope_head_dim,
        "n_group": m.n_group, "topk_group": m.topk_group,
        "num_experts_per_tok": m.num_experts_per_tok, "norm_topk_prob": m.norm_topk_prob,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": False, "attention_bias": False,
        "num_local_experts": m.num_experts,
        "mlp_layer_types": ["dense" if i < m.first_dense_layers else "sparse" for i in range(n)],
        "layer_types": [inv[t] for t in cfg.layer_kinds()],
        "linear_head_dim": k.head_dim, "linear_num_heads": k.num_heads,
        "linear_conv_kernel_dim": k.conv_size,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        # token ids are the tokenizer's business, not the ModelConfig's (export_hf's `extra`)
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def recipes(cfg: ModelConfig) -> list[Recipe]:
    """Every tensor of the checkpoint layout (transformers' save_pretrained names, which are the
    original checkpoints'), per layer, in file order."""
    D, V = cfg.d_model, cfg.vocab_size
    k, a, m = cfg.kda, cfg.dsa, cfg.moe
    out = [copy("model.embed_tokens.weight", ("params", "embed", "embedding"), (V, D))]
    for i, kind in enumerate(cfg.layer_kinds()):
        h, p = f"model.layers.{i}", ("params", f"layer_{i}")
        at, ff = p + ("attn",), p + ("ffn",)
        out += [copy(f"{h}.input_layernorm.weight", p + ("attn_norm", "scale"), (D,)),
                copy(f"{h}.post_attention_layernorm.weight", p + ("ffn_norm", "scale"), (D,))]
        s = f"{h}.self_attn"
        if kind == "K":
            H, K, W = k.num_heads, k.k_dim, k.conv_size
            HK = H * K
            out += [
                concat_linears((f"{s}.q_proj.weight", f"{s}.k_proj.weight", f"{s}.v_proj.weight"),
                               at + ("qkv", "kernel"), D, (HK, HK, HK)),
                concat_convs((f"{s}.q_conv1d.weight", f"{s}.k_conv1d.weight",
                              f"{s}.v_conv1d.weight"), at + ("conv",), (HK, HK, HK), W),
                linear(f"{s}.f_a_proj.weight", at + ("gate_down", "kernel"), D, K),
                linear(f"{s}.f_b_proj.weight", at + ("gate_up", "kernel"), K, HK),
                reshaped(f"{s}.A_log", at + ("A_log",), (1, 1, H, 1), (H,)),
                copy(f"{s}.dt_bias", at + ("dt_bias",), (HK,)),
                linear(f"{s}.b_proj.weight", at + ("beta", "kernel"), D, H),
                linear(f"{s}.g_a_proj.weight", at + ("ogate_down", "kernel"), D, K),
                linear(f"{s}.g_b_proj.weight", at + ("ogate_up", "kernel"), K, HK),
                copy(f"{s}.o_norm.weight", at + ("o_norm",), (K,)),
                linear(f"{s}.o_proj.weight", at + ("out", "kernel"), HK, D)]
        else:
            Hq, N, R, L, Vh = (a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim,
                               a.kv_lora_rank, a.v_head_dim)
            if a.q_lora_rank:
                out += [linear(f"{s}.q_a_proj.weight", at + ("q_a", "kernel"), D, a.q_lora_rank),
                        copy(f"{s}.q_a_layernorm.weight", at + ("q_a_norm", "scale"),
                             (a.q_lora_rank,)),
                        linear(f"{s}.q_b_proj.weight", at + ("q_b", "kernel"), a.q_lora_rank,
                               Hq * (N + R))]
            else:
                out.append(linear(f"{s}.q_proj.weight", at + ("q", "kernel"), D, Hq * (N + R)))
            out += [linear(f"{s}.kv_a_proj_with_mqa.weight", at + ("kv_a", "kernel"), D, L + R),
                    copy(f"{s}.kv_a_layernorm.weight", at + ("kv_a_norm", "scale"), (L,)),
                    mla_kv_b(f"{s}.kv_b_proj.weight", at + ("w_uk",), at + ("w_uv",), Hq, N, Vh,
                             L),
                    linear(f"{s}.o_proj.weight", at + ("out", "kernel"), Hq * Vh, D)]
        b = f"{h}.block_sparse_moe"
        if cfg.is_moe_layer(i):
            E, F = m.num_experts, m.expert_dim
            ex = [f"{b}.experts.{e}" for e in range(E)]
            out += [
                stacked_linears(tuple(f"{x}.w1.weight" for x in ex), ff + ("w_gate",), D, F),
                stacked_linears(tuple(f"{x}.w2.weight" for x in ex), ff + ("w_down",), F, D),
                stacked_linears(tuple(f"{x}.w3.weight" for x in ex), ff + ("w_up",), D, F),
                copy(f"{b}.gate.e_score_correction_bias", ("router_state",) + ff[1:] + ("bias",),
                     (E,)),
                linear(f"{b}.gate.weight", ff + ("router",), D, E)]
            if m.num_shared_experts:
                S = F * m.num_shared_experts
                sh = ff + ("shared",)
                out += [linear(f"{b}.shared_experts.down_proj.weight", sh + ("down", "kernel"),
                               S, D),
                        linear(f"{b}.shared_experts.gate_proj.weight", sh + ("gate", "kernel"),
                               D, S),
                        linear(f"{b}.shared_experts.up_proj.weight", sh + ("up", "kernel"), D, S)]
        else:
            Fd = m.dense_dim
            out += [linear(f"{b}.down_proj.weight", ff + ("down", "kernel"), Fd, D),
                    linear(f"{b}.gate_proj.weight", ff + ("gate", "kernel"), D, Fd),
                    linear(f"{b}.up_proj.weight", ff + ("up", "kernel"), D, Fd)]
    out += [copy("model.norm.weight", ("params", "final_norm", "scale"), (D,)),
            linear("lm_head.weight", ("params", "embed", "head"), D, V)]
    return out
