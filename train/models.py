"""The model of a run's config: the config's model section (resolved from a released checkpoint
when config.hf_dir is set: train.run_config.resolve_checkpoint) checked against its tokenizer (model_config), and
the variants each phase trains: the dense warm-up's, the QAT phase's, RL's policy."""

from __future__ import annotations

import dataclasses

from model.config import ModelConfig
from model.tokenizer import load_tokenizer
from model.transformer import Model


def config_model(config) -> Model:
    return Model(model_config(config))


def model_config(config) -> ModelConfig:
    """config.model as a ModelConfig, checked against config.tokenizer: every token id must
    have an embedding row (e.g. "byte_tools" needs model.vocab_size >= 263)."""
    cfg = ModelConfig.from_dict(config.model)
    n = load_tokenizer(config.tokenizer).vocab_size
    if n > cfg.vocab_size:
        raise ValueError(f"tokenizer {config.tokenizer!r} has {n} ids but model.vocab_size is "
                         f"{cfg.vocab_size}: set --config.model.vocab_size={n}")
    return cfg


def rl_model(config) -> Model:
    """The policy as RL trains it: the config's model, with the indexer KL weight set to 0 when
    rl.train_indexer is False (the indexer then gets no gradient and stays as SFT left it)."""
    cfg = model_config(config)
    if not config.rl.train_indexer:
        cfg = cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer_loss_weight=0.0))
    return Model(cfg)


def has_dsa(cfg: ModelConfig) -> bool:
    """Whether the model has a DSA layer (trunk or MTP block)."""
    return "D" in cfg.kinds_used()


def has_indexer(cfg: ModelConfig) -> bool:
    """Whether the model has a DSA layer (trunk or MTP block) whose indexer is trained."""
    return has_dsa(cfg) and cfg.dsa.indexer_loss_weight > 0


def warmup_model(cfg: ModelConfig) -> Model:
    """The model of the indexer's dense warm-up: dense attention, indexer KL over every causal
    key (DeepSeek-V3.2's first stage); same parameters as `cfg`'s model."""
    return Model(cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer_stage="dense_warmup")))


def qat_model(cfg: ModelConfig) -> Model:
    """The model of the SFT QAT phase: `cfg` with model.moe.qat=True (routed experts
    fake-quantised to MXFP4 in the forward). Raises ValueError for a model without routed
    experts, with packed MXFP4 experts (nothing float to train), or with widths that are not
    multiples of the MXFP4 block (32)."""
    from model import quant

    if not cfg.moe.num_experts:
        raise ValueError(f"sft.qat_steps > 0 but model {cfg.name} has no routed experts (only they "
                         "have an MXFP4 path): set sft.qat_steps=0")
    if cfg.moe.expert_format != "bf16":
        raise ValueError(f"sft.qat_steps > 0 needs float experts to train, but "
                         f"model.moe.expert_format={cfg.moe.expert_format!r}")
    quant.mxfp4_config(cfg)  # d_model and moe.expert_dim multiples of 32
    return Model(cfg.replace(moe=dataclasses.replace(cfg.moe, qat=True)))


def trainable_experts(cfg: ModelConfig, what: str) -> None:
    """Raises ValueError when `what` (a phase that trains) would take gradients of packed MXFP4
    experts (uint8: nothing float to differentiate); the fix is float experts, with QAT to keep
    the MXFP4 export's forward."""
    if cfg.moe.num_experts and cfg.moe.expert_format == "mxfp4":
        raise ValueError(
            f"{what} trains the model, but model.moe.expert_format='mxfp4' holds the routed "
            "experts packed (uint8), which have no gradient: set "
            "--config.model.moe.expert_format=bf16 --config.model.moe.qat=True (float experts "
            "trained through MXFP4 fake quantisation) and, to sample with packed experts, "
            "--config.rl.rollout_experts=mxfp4")
