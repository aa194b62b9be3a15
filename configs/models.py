"""Model presets as named configs.

    python scripts/plan.py --config configs/models.py:reference_2p8t      # no allocation
    python scripts/plan.py --config configs/models.py:tiny --config.d_model=96

Variants:
  test            2 layers "KD", d_model 64: every layer kind, MoE and MTP; used by the tests.
  tiny            4 layers "KKKD", d_model 128 (~2.4M params): the CPU benchmark model.
  demo            4 layers "KKKD", d_model 96: the RL demo's policy (sized for 2 CPU cores).
  small           16 layers, d_model 1024, 32 experts: a real single-GPU run.
  reference_2p8t  the article's model: ~2.8T total params, KDA:DSA 3:1, MTP depth 1, 1M context,
                  MXFP4 experts (~1.56 TB). Only ever built with jax.eval_shape.
Any field can be overridden on the command line, e.g. --config.moe.num_experts=16.
"""

import ml_collections

BYTE_VOCAB = 259  # 256 bytes + PAD, BOS, EOS (model/tokenizer.py)


def _base(**kw) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = kw.pop("name")
    c.vocab_size = BYTE_VOCAB
    c.max_seq_len = 4096
    c.norm_eps = 1e-6
    c.tie_embeddings = False
    c.dtype = "float32"
    c.param_dtype = "float32"
    c.remat = "none"  # per-block rematerialisation: "none" | "full" | "save_dots" (model/config.py)
    # stack repeated layer groups and lax.scan over them (one compile per distinct group;
    # model/config.py:layer_groups)
    c.scan_layers = False
    c.kda = ml_collections.ConfigDict(dict(
        num_heads=2, head_dim=32, v_head_dim=0, conv_size=4, gate_rank=0,
        gate_lower_bound=ml_collections.FieldReference(None, field_type=float),
        chunk_size=64, impl="auto",
        # cached calls (prefill, agent turns) of at most this many tokens: the token recurrence
        # (it compiles faster than the chunked form; model/layers/kda.py:KDAConfig)
        recurrent_max_len=128))
    c.dsa = ml_collections.ConfigDict(dict(
        num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=2, index_head_dim=16, index_rope_dim=8, index_topk=16,
        rope_theta=10000.0, indexer_stage="sparse", impl="auto",
        # the indexer is trained only by its KL loss: at 0 its top-k selection stays random
        indexer_loss_weight=1.0,
        # > 0: that KL in chunks of this many queries for longer sequences, recomputed in the
        # backward (less memory, more compute; model/layers/dsa.py:indexer_kl_chunked)
        indexer_kl_chunk=0,
        # positions: "rope" | "nope"; rope_scaling "yarn" extends a RoPE model's context by
        # rope_factor from rope_original_max_position (model/layers/rope.py)
        positions="rope", rope_scaling="none", rope_factor=1.0, rope_original_max_position=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0))
    c.moe = ml_collections.ConfigDict(dict(
        num_experts=4, num_experts_per_tok=2, expert_dim=64, num_shared_experts=1, dense_dim=128,
        first_dense_layers=0, router="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0,
        dispatch="dropless", capacity_factor=1.25, aux_loss_coef=0.0, bias_update_rate=1e-3,
        expert_format="bf16", qat=False, mxfp4_impl="auto", expert_parallel="none",
        grouped_matmul="auto", all_experts_max_rows=2048))
    c.mtp = ml_collections.ConfigDict(dict(depth=1, loss_weight=0.3, layer_kind="D"))
    for k, v in kw.items():
        if isinstance(v, dict):
            c[k].update(v)
        else:
            c[k] = v
    return c


def test() -> ml_collections.ConfigDict:
    return _base(name="test", d_model=64, num_layers=2, layer_pattern="KD", max_seq_len=256,
                 moe=dict(aux_loss_coef=0.01), dsa=dict(indexer_loss_weight=0.0))


def tiny() -> ml_collections.ConfigDict:
    return _base(
        name="tiny", d_model=128, num_layers=4, layer_pattern="KKKD", max_seq_len=512,
        kda=dict(num_heads=2, head_dim=64),
        dsa=dict(num_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, index_n_heads=2, index_head_dim=32,
                 index_rope_dim=16, index_topk=64),
        moe=dict(num_experts=8, num_experts_per_tok=2, expert_dim=128, dense_dim=384,
                 first_dense_layers=1, aux_loss_coef=1e-3),
    )


def demo() -> ml_collections.ConfigDict:
    # The RL demo's policy: every feature of the architecture, sized so SFT + GRPO + eval run on
    # 2 CPU cores in the README's demo time (capacity dispatch: batched einsums, as fast as
    # dropless's blocked grouped matmul on CPU at the demo's SFT shapes).
    return _base(
        name="demo", d_model=96, num_layers=4, layer_pattern="KKKD", max_seq_len=256,
        kda=dict(num_heads=2, head_dim=48),
        dsa=dict(num_heads=2, q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=24,
                 qk_rope_head_dim=16, v_head_dim=24, index_n_heads=2, index_head_dim=24,
                 index_rope_dim=16, index_topk=32),
        moe=dict(num_experts=4, num_experts_per_tok=2, expert_dim=96, dense_dim=256,
                 first_dense_layers=1, dispatch="capacity", capacity_factor=2.0,
                 aux_loss_coef=1e-3),
    )


def small() -> ml_collections.ConfigDict:
    return _base(
        name="small", d_model=1024, num_layers=16, layer_pattern="KKKD", max_seq_len=32768,
        vocab_size=32768, dtype="bfloat16", param_dtype="float32",
        # K = V = 128: the chunked form prefills faster than the token recurrence there
        kda=dict(num_heads=8, head_dim=128, recurrent_max_len=0),
        dsa=dict(num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                 qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8, index_head_dim=64,
                 index_rope_dim=32, index_topk=512),
        moe=dict(num_experts=32, num_experts_per_tok=4, expert_dim=512, dense_dim=4096,
                 first_dense_layers=1, aux_loss_coef=1e-4),
    )


def reference_2p8t() -> ml_collections.ConfigDict:
    # Kimi-K2-class widths (d 7168, MLA 64 heads, 2048-wide experts, 8 routed + 1 shared) scaled to
    # ~2.8T total by depth and expert count; KDA:DSA 3:1; DeepSeek-V3.2 indexer sizes.
    return _base(
        name="reference_2p8t", d_model=7168, num_layers=64, layer_pattern="KKKD",
        max_seq_len=1 << 20, vocab_size=163840, dtype="bfloat16", param_dtype="bfloat16",
        # per-block remat: without it one 256 x 4096 batch needs ~4x the H200's memory per
        # device (python scripts/plan.py ... --mesh fsdp=16,expert=8,tensor=8, docs/scaling.md)
        remat="full",
        kda=dict(num_heads=64, head_dim=128),
        dsa=dict(num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
                 index_rope_dim=64, index_topk=2048, rope_theta=50000.0,
                 # NoPE on the MLA layers, as Kimi Linear: the KDA layers carry position, and a
                 # 1M-token window needs no rotary extrapolation (YaRN: dsa.rope_scaling="yarn")
                 positions="nope"),
        moe=dict(num_experts=1000, num_experts_per_tok=8, expert_dim=2048, dense_dim=18432,
                 first_dense_layers=1, routed_scaling_factor=2.827, expert_format="mxfp4"),
    )


PRESETS = {"test": test, "tiny": tiny, "demo": demo, "small": small, "reference_2p8t": reference_2p8t}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    name = arg or "tiny"
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]()


def build(name: str = "test", **overrides):
    """The validated ModelConfig of preset `name` with dotted-path overrides, the Python
    counterpart of --config.x.y=v: build("test", **{"dsa.index_topk": 8, "d_model": 32}).
    An unknown path raises (ml_collections does not create fields on assignment)."""
    from model.config import ModelConfig
    from model.config_base import set_dotted

    c = get_config(name)
    set_dotted(c, overrides, f"model config {name!r}")
    return ModelConfig.from_dict(c)
