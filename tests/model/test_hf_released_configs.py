"""The released models' config.json fields (tests/model/hf_fixtures/released, typed in from the
published Kimi-Linear-48B-A3B-Instruct and DeepSeek-V3.2-Exp configs) translate to valid
ModelConfigs, and the tensors their layouts list add up to the published parameter counts
(48B and 671B; each recipe's shapes, nothing allocated). About 1 s."""

import math
import os

import pytest

from model.hf import CheckpointError, hf_config
from model.hf.convert import read_config, skipped_prefixes

RELEASED = os.path.join(os.path.dirname(__file__), "hf_fixtures", "released")


def _count(name):
    d = os.path.join(RELEASED, name)
    cfg = hf_config(d, dtype="bfloat16")
    _, fam = read_config(d)
    return cfg, sum(math.prod(s) for r in fam.recipes(cfg) for s in r.hf_shapes)


def test_kimi_linear_48b_a3b():
    cfg, n = _count("kimi_linear_48b_a3b")
    assert 48e9 < n < 50e9  # 49.1B with the embedding and head
    # 1-based full_attn_layers [4, 8, ..., 24, 27]: the last layer is MLA too
    assert cfg.layer_kinds() == tuple("KKKD" * 6 + "KKD")
    assert (cfg.kda.num_heads, cfg.kda.head_dim, cfg.dsa.q_lora_rank) == (32, 128, 0)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.first_dense_layers) == (
        256, 8, 1)
    assert cfg.max_seq_len == 1048576 and cfg.dsa.positions == "nope"


def test_deepseek_v32_exp():
    cfg, n = _count("deepseek_v32_exp")
    assert 670e9 < n < 673e9  # 671.9B without the MTP layer
    a = cfg.dsa
    assert (a.index_n_heads, a.index_head_dim, a.index_topk, a.index_rope_dim) == (
        64, 128, 2048, 64)
    assert (a.rope_scaling, a.rope_factor, a.rope_original_max_position) == ("yarn", 40.0, 4096)
    assert (cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.first_dense_layers) == (8, 4, 3)
    # its MTP layer (model.layers.61.*) is refused unless the caller drops it
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=1"):
        skipped_prefixes(os.path.join(RELEASED, "deepseek_v32_exp"), cfg, drop_mtp=False)
    assert skipped_prefixes(os.path.join(RELEASED, "deepseek_v32_exp"), cfg, True) == (
        "model.layers.61.",)
