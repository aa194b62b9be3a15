"""`model_type` "deepseek_v32" (transformers' DeepseekV32ForCausalLM, DeepSeek-V3.2 checkpoints):
config.json <-> ModelConfig, and the tensor recipes of its checkpoint layout.

What the reference computes, as this model's options:
  every layer -> kind "D" (MLA + lightning indexer): q_a / q_a_layernorm / q_b, kv_a_proj_with_mqa
      / kv_a_layernorm, kv_b_proj split into the absorbed w_uk / w_uv, o_proj; the latent norms'
      eps 1e-6 (dsa.latent_norm_eps: the reference builds them with their default eps); the
      indexer's wq_b (from the q latent), wk, k_norm (a LayerNorm with bias, eps 1e-6:
      dsa.index_norm_eps) and weights_proj; its scores sum_h w_h HI^-1/2 relu(q_h.k DI^-1/2) are
      this layer's (the positive scales move inside the relu), its causal top-k the same keys.
  RoPE: the main MLA rotates interleaved pairs (x0, x1), (x2, x3), ...; this model rotates
      half-split pairs (x_i, x_{i+R/2}), as the reference's indexer does. A rotation of
      interleaved pairs equals the half-split rotation of the same vector with its channels
      reordered (evens, then odds), and the reference's output is already in that order, so
      the import reorders the rope rows of q_b_proj (per head) and of kv_a_proj_with_mqa
      (`rope_rows`) and the layer computes the reference's numbers exactly; export reorders
      back. rope_parameters "default" -> dsa.positions "rope", "yarn" -> dsa.rope_scaling "yarn"
      with its factor, original length, beta_fast / beta_slow and mscale / mscale_all_dim (only
      where the rotary magnitude mscale(s, mscale) / mscale(s, mscale_all_dim) is 1: the
      reference applies it to the indexer's rotary channels too, this model to MLA's only).
  MLP: "sparse" layers -> MoE with router="sigmoid" + e_score_correction_bias, group-limited
      selection (moe.n_group / topk_group), norm_topk_prob, routed_scaling_factor, shared
      experts; per-expert gate_proj / up_proj / down_proj stacked; "dense" ones (a prefix:
      moe.first_dense_layers) -> the dense MLP.
  FP8: a weight stored as F8_E4M3 with its `<name>_scale_inv` block scales (quantization_config
      quant_method "fp8", weight_block_size [128, 128]) is dequantised on load:
      W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128] (model/hf/convert.py:read_weight).

Not covered: MTP layers (num_nextn_predict_layers > 0, stored as model.layers.<n>.* after the
n trunk layers). transformers' class has no MTP module and skips those weights, so there is no
reference to check an import of them against: the import stops naming the field unless the
caller asks to skip them (import_hf(drop_mtp=True), as transformers does), and never skips them
silently.
"""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig
from model.hf.common import bad, check_expressible, check_fields, dense_prefix
from model.hf.recipes import Recipe, copy, linear, mla_kv_b, stacked_linears
from model.hf.safetensors_io import CheckpointError

MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"
ALIASES = {"num_local_experts": "n_routed_experts", "num_experts": "n_routed_experts"}
IGNORED = {"head_dim", "qk_head_dim", "ep_size"}
REQUIRED = {"hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "moe_layer_freq": 1, "pretraining_tp": 1}
USED = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
        "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
        "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
        "num_experts_per_tok", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "rope_theta", "rope_scaling", "mlp_layer_types",
        "first_k_dense_replace", "layer_types", "index_topk", "index_head_dim", "index_n_heads",
        "quantization_config", "num_nextn_predict_layers"}
NORM_EPS = 1e-6  # DeepseekV32RMSNorm's default (q_a / kv_a) and the indexer's k_norm eps
FP8_BLOCK = (128, 128)


def _rope(c: dict) -> dict:
    """DSAConfig position fields from rope_parameters (or the older rope_theta + rope_scaling)."""
    rp = c.get("rope_parameters")
    if rp is None:
        rs = c.get("rope_scaling") or {}
        rp = {"rope_type": rs.get("rope_type", rs.get("type", "default")),
              "rope_theta": c.get("rope_theta", 10000.0), **rs}
    kind = rp.get("rope_type", rp.get("type", "default"))
    out = {"positions": "rope", "rope_theta": float(rp.get("rope_theta", 10000.0))}
    if kind == "default":
        return out
    if kind != "yarn":
        raise bad("rope_parameters.rope_type", kind, "only 'default' and 'yarn' are supported")
    if rp.get("truncate", True) is not True:
        raise bad("rope_parameters.truncate", rp["truncate"], "only the truncated (floor/ceil) "
                  "correction range is supported")
    orig = rp.get("original_max_position_embeddings")
    if not orig:
        raise bad("rope_parameters.original_max_position_embeddings", orig, "yarn needs it")
    factor = rp.get("factor") or c.get("max_position_embeddings", 163840) / orig
    m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if rp.get("attention_factor") not in (None, 1, 1.0) or not (m and m_all and m == m_all):
        raise bad("rope_parameters.mscale/mscale_all_dim/attention_factor", (m, m_all, rp.get(
            "attention_factor")), "only a rotary magnitude of 1 is supported (mscale == "
            "mscale_all_dim, no attention_factor): the reference scales the indexer's rotary "
            "channels by it too")
    return {**out, "rope_scaling": "yarn", "rope_factor": float(factor),
            "rope_original_max_position": int(orig),
            "rope_beta_fast": float(rp.get("beta_fast") or 32),
            "rope_beta_slow": float(rp.get("beta_slow") or 1), "rope_mscale": float(m),
            "rope_mscale_all_dim": float(m_all)}


def fp8_block(raw: dict) -> tuple[int, int] | None:
    """The FP8 weight block of quantization_config, None without one."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise bad("quantization_config", q, "only quant_method 'fp8' (e4m3) with block scales "
                  "is supported")
    block = tuple(q.get("weight_block_size") or FP8_BLOCK)
    if len(block) != 2:
        raise bad("quantization_config.weight_block_size", block, "must be [rows, cols]")
    return block


def mtp_layers(raw: dict) -> int:
    """num_nextn_predict_layers (the MTP layers stored after the trunk)."""
    n = raw.get("num_nextn_predict_layers", 0) or 0
    if not isinstance(n, int) or n < 0:
        raise bad("num_nextn_predict_layers", n, "must be an int >= 0")
    return n


def to_config(raw: dict, *, dtype: str = "float32", param_dtype: str = "float32"
              ) -> ModelConfig:
    """ModelConfig of a deepseek_v32 config.json (dict), validated."""
    c = check_fields(raw, MODEL_TYPE, aliases=ALIASES, ignored=IGNORED, required=REQUIRED,
                     used=USED)
    fp8_block(raw)
    n = c.get("num_hidden_layers", 61)
    types = c.get("layer_types")
    if types is not None and any(t != "indexed_attention" for t in types):
        raise bad("layer_types", types, "every layer must be 'indexed_attention'")
    H = c.get("num_attention_heads", 128)
    if c.get("num_key_value_heads", H) != H:
        raise bad("num_key_value_heads", c["num_key_value_heads"],
                  f"must equal num_attention_heads={H} (MLA)")
    if not c.get("q_lora_rank", 1536):
        raise bad("q_lora_rank", c.get("q_lora_rank"), "the indexer reads the q latent: needed")
    R = c.get("qk_rope_head_dim", 64)
    d = dict(
        vocab_size=c.get("vocab_size", 129280), d_model=c.get("hidden_size", 7168),
        num_layers=n, layer_pattern="D",
        kda=dict(num_heads=1, head_dim=16),  # unused section (no "K" layers)
        dsa=dict(num_heads=H, q_lora_rank=c.get("q_lora_rank", 1536),
                 kv_lora_rank=c.get("kv_lora_rank", 512),
                 qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=R,
                 v_head_dim=c.get("v_head_dim", 128),
                 index_n_heads=c.get("index_n_heads", 64),
                 index_head_dim=c.get("index_head_dim", 128), index_rope_dim=R,
                 index_topk=c.get("index_topk", 2048), latent_norm_eps=NORM_EPS,
                 index_norm_eps=NORM_EPS, **_rope(c)),
        moe=dict(num_experts=c.get("n_routed_experts", 256),
                 num_experts_per_tok=c.get("num_experts_per_tok", 8),
                 expert_dim=c.get("moe_intermediate_size", 2048),
                 num_shared_experts=c.get("n_shared_experts", 1),
                 dense_dim=c.get("intermediate_size", 18432),
                 first_dense_layers=dense_prefix(c, n, default_first_k=3), router="sigmoid",
                 norm_topk_prob=c.get("norm_topk_prob", True),
                 routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
                 n_group=c.get("n_group", 8), topk_group=c.get("topk_group", 4)),
        max_seq_len=c.get("max_position_embeddings", 163840),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=False,
        dtype=dtype, param_dtype=param_dtype, name=MODEL_TYPE)
    try:
        return ModelConfig.from_dict(d)
    except ValueError as e:
        raise CheckpointError(f"config.json does not make a valid model: {e}") from None


def from_config(cfg: ModelConfig) -> dict:
    """config.json (transformers' names) of a model this layout can hold; CheckpointError
    naming the first field it cannot express."""
    a, m = cfg.dsa, cfg.moe
    checks = [
        (cfg.layer_pattern == "D", "layer_pattern", cfg.layer_pattern),
        (a.indexer and a.q_lora_rank > 0, "dsa.indexer/q_lora_rank", (a.indexer, a.q_lora_rank)),
        (a.positions == "rope", "dsa.positions", a.positions),
        (a.index_rope_dim == a.qk_rope_head_dim, "dsa.index_rope_dim", a.index_rope_dim),
        ((a.latent_norm_eps or cfg.norm_eps) == NORM_EPS, "dsa.latent_norm_eps",
         a.latent_norm_eps),
        ((a.index_norm_eps or cfg.norm_eps) == NORM_EPS, "dsa.index_norm_eps", a.index_norm_eps),
        (a.rope_scaling == "none" or a.rope_mscale == a.rope_mscale_all_dim > 0,
         "dsa.rope_mscale", a.rope_mscale),
    ]
    check_expressible(cfg, "deepseek_v32", checks)
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=a.rope_factor,
                    original_max_position_embeddings=a.rope_original_max_position,
                    beta_fast=a.rope_beta_fast, beta_slow=a.rope_beta_slow,
                    mscale=a.rope_mscale, mscale_all_dim=a.rope_mscale_all_dim)
    n = cfg.num_layers
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": m.dense_dim, "moe_intermediate_size": m.expert_dim,
        "num_hidden_layers": n, "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_heads, "n_shared_experts": m.num_shared_experts,
        "n_routed_experts": m.num_experts, "routed_scaling_factor": m.routed_scaling_factor,
        "kv_lora_rank": a.kv_lora_rank, "q_lora_rank": a.q_lora_rank,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim,
        "qk_nope_head_dim": a.qk_nope_head_dim, "n_group": m.n_group,
        "topk_group": m.topk_group, "num_experts_per_tok": m.num_experts_per_tok,
        "norm_topk_prob": m.norm_topk_prob, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "rope_parameters": rope,
        "mlp_layer_types": ["dense" if i < m.first_dense_layers else "sparse" for i in range(n)],
        "first_k_dense_replace": m.first_dense_layers,
        "layer_types": ["indexed_attention"] * n, "index_topk": a.index_topk,
        "index_head_dim": a.index_head_dim, "index_n_heads": a.index_n_heads,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }


def half_split_order(r: int) -> np.ndarray:
    """Channel order turning interleaved rotary pairs into half-split ones: evens, then odds."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def rope_rows(hf: str, ours, d_in: int, rows: np.ndarray) -> Recipe:
    """A Linear weight [out, in] <-> kernel [in, out] with the output rows reordered by `rows`
    (ours[:, j] = hf[rows[j], :])."""
    inv = np.argsort(rows)
    return Recipe((hf,), ((len(rows), d_in),), (ours,),
                  lambda a: [a[0][rows].T], lambda a: [a[0].T[inv]])


def recipes(cfg: ModelConfig) -> list[Recipe]:
    """Every tensor of the checkpoint layout (save_pretrained's names), per layer."""
    D, V = cfg.d_model, cfg.vocab_size
    a, m = cfg.dsa, cfg.moe
    H, N, R, L, Vh, Q = (a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank,
                         a.v_head_dim, a.q_lora_rank)
    HI, DI = a.index_n_heads, a.index_head_dim
    hs = half_split_order(R)
    q_rows = np.concatenate([h * (N + R) + np.concatenate([np.arange(N), N + hs])
                             for h in range(H)])
    kv_rows = np.concatenate([np.arange(L), L + hs])
    out = [copy("model.embed_tokens.weight", ("params", "embed", "embedding"), (V, D))]
    for i in range(cfg.num_layers):
        h, p = f"model.layers.{i}", ("params", f"layer_{i}")
        at, ff, s = p + ("attn",), p + ("ffn",), f"model.layers.{i}.self_attn"
        out += [
            copy(f"{h}.input_layernorm.weight", p + ("attn_norm", "scale"), (D,)),
            copy(f"{h}.post_attention_layernorm.weight", p + ("ffn_norm", "scale"), (D,)),
            linear(f"{s}.q_a_proj.weight", at + ("q_a", "kernel"), D, Q),
            copy(f"{s}.q_a_layernorm.weight", at + ("q_a_norm", "scale"), (Q,)),
            rope_rows(f"{s}.q_b_proj.weight", at + ("q_b", "kernel"), Q, q_rows),
            rope_rows(f"{s}.kv_a_proj_with_mqa.weight", at + ("kv_a", "kernel"), D, kv_rows),
            copy(f"{s}.kv_a_layernorm.weight", at + ("kv_a_norm", "scale"), (L,)),
            mla_kv_b(f"{s}.kv_b_proj.weight", at + ("w_uk",), at + ("w_uv",), H, N, Vh, L),
            linear(f"{s}.o_proj.weight", at + ("out", "kernel"), H * Vh, D),
            linear(f"{s}.indexer.wq_b.weight", at + ("idx_q", "kernel"), Q, HI * DI),
            linear(f"{s}.indexer.wk.weight", at + ("idx_k", "kernel"), D, DI),
            copy(f"{s}.indexer.k_norm.weight", at + ("idx_k_norm", "scale"), (DI,)),
            copy(f"{s}.indexer.k_norm.bias", at + ("idx_k_norm", "bias"), (DI,)),
            linear(f"{s}.indexer.weights_proj.weight", at + ("idx_w", "kernel"), D, HI)]
        b = f"{h}.mlp"
        if cfg.is_moe_layer(i):
            E, F = m.num_experts, m.expert_dim
            ex = [f"{b}.experts.{e}" for e in range(E)]
            out += [
                stacked_linears(tuple(f"{x}.gate_proj.weight" for x in ex), ff + ("w_gate",),
                                D, F),
                stacked_linears(tuple(f"{x}.up_proj.weight" for x in ex), ff + ("w_up",), D, F),
                stacked_linears(tuple(f"{x}.down_proj.weight" for x in ex), ff + ("w_down",),
                                F, D),
                copy(f"{b}.gate.e_score_correction_bias", ("router_state",) + ff[1:] + ("bias",),
                     (E,)),
                linear(f"{b}.gate.weight", ff + ("router",), D, E)]
            if m.num_shared_experts:
                S, sh = F * m.num_shared_experts, ff + ("shared",)
                out += [linear(f"{b}.shared_experts.gate_proj.weight", sh + ("gate", "kernel"),
                               D, S),
                        linear(f"{b}.shared_experts.up_proj.weight", sh + ("up", "kernel"), D, S),
                        linear(f"{b}.shared_experts.down_proj.weight", sh + ("down", "kernel"),
                               S, D)]
        else:
            Fd = m.dense_dim
            out += [linear(f"{b}.gate_proj.weight", ff + ("gate", "kernel"), D, Fd),
                    linear(f"{b}.up_proj.weight", ff + ("up", "kernel"), D, Fd),
                    linear(f"{b}.down_proj.weight", ff + ("down", "kernel"), Fd, D)]
    out += [copy("model.norm.weight", ("params", "final_norm", "scale"), (D,)),
            linear("lm_head.weight", ("params", "embed", "head"), D, V)]
    return out
