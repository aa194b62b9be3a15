"""Plan a model without allocating it: parameters, bytes, shards and decode-state memory.

    python scripts/plan.py --config configs/models.py:reference_2p8t          # ~20 s on CPU
    python scripts/plan.py --config configs/models.py:reference_2p8t --json
    python scripts/plan.py --config configs/rl.py:grpo_tiny                    # uses config.model

Parameter counts come from `jax.eval_shape` of the real model init (no allocation); decode-state
bytes from the real cache shapes (`Model.init_cache` under eval_shape) for the hybrid layout, and
for an all-DSA and an all-dense-MHA layout of the same width and depth (MHA: dsa.num_heads heads,
K width qk_head_dim, V width v_head_dim, bf16).

Covered: totals (with and without the MTP module), active parameters per token (k routed +
shared experts), bytes in bf16 and with MXFP4 experts (4.25 bits/value: 4-bit elements + one
E8M0 scale per 32), shard count. Not covered: per-device memory on a mesh (see --mesh once the
sharding planner lands), activations.
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from model.config import ModelConfig  # noqa: E402
from model.transformer import Model  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/models.py:reference_2p8t",
                                          "model config (or a config with a .model field)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")
_SHARD_GB = flags.DEFINE_float("shard_gb", 16.5, "bytes per checkpoint shard, in GB (1e9)")

EXPERT_KEYS = ("w_gate", "w_up", "w_down")
MXFP4_BITS = 4.25


def _model_cfg(cfg) -> ModelConfig:
    return ModelConfig.from_dict(cfg.model if "model" in cfg else cfg)


def count_params(cfg: ModelConfig) -> dict:
    """Walk the abstract params: totals, routed-expert elements, MTP elements."""
    shapes = Model(cfg).abstract_init()["params"]
    total = expert = mtp = expert_mtp = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        leaf = getattr(leaf, "value", leaf)
        names = [str(p.key) for p in path if hasattr(p, "key")]  # dict keys (skip box attrs)
        n = int(np.prod(leaf.shape))
        is_expert = any(str(nm).startswith(EXPERT_KEYS) for nm in names)
        if is_expert and leaf.dtype == jnp.uint8:
            # packed MXFP4: blocks hold 2 values per byte; scales are per 32 values (not params)
            n = n * 2 if str(names[-1]).endswith("_blocks") else 0
        is_mtp = str(names[0]).startswith("mtp_")
        total += n
        expert += n if is_expert else 0
        mtp += n if is_mtp else 0
        expert_mtp += n if (is_expert and is_mtp) else 0
    return {"total": total, "expert": expert, "mtp": mtp, "expert_mtp": expert_mtp}


def decode_state_bytes(cfg: ModelConfig, seq_len: int) -> dict:
    def cache_bytes(c: ModelConfig) -> int:
        shapes = jax.eval_shape(lambda: Model(c).init_cache(1, seq_len))
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    hybrid = cache_bytes(cfg)
    all_dsa = cache_bytes(cfg.replace(layer_pattern="D"))
    d = cfg.dsa
    mha = cfg.num_layers * seq_len * d.num_heads * (d.qk_head_dim + d.v_head_dim) * 2
    return {"hybrid": hybrid, "all_dsa": all_dsa, "all_mha": mha}


def plan(cfg: ModelConfig, shard_gb: float = 16.5) -> dict:
    p = count_params(cfg)
    m = cfg.moe
    routed_frac = (m.num_experts_per_tok / m.num_experts) if m.num_experts else 1.0
    active = p["total"] - p["expert"] + int(round(p["expert"] * routed_frac))
    rest = p["total"] - p["expert"]
    bytes_bf16 = 2 * p["total"]
    bytes_mxfp4 = int(p["expert"] * MXFP4_BITS / 8) + 2 * rest
    out = {
        "name": cfg.name,
        "total_params": p["total"],
        "total_params_without_mtp": p["total"] - p["mtp"],
        "mtp_params": p["mtp"],
        "expert_params": p["expert"],
        "active_params": active,
        "bytes_bf16": bytes_bf16,
        "bytes_mxfp4": bytes_mxfp4,
        "shard_bytes": int(shard_gb * 1e9),
        "num_shards": math.ceil(bytes_mxfp4 / (shard_gb * 1e9)),
        "layer_kinds": "".join(cfg.layer_kinds()),
        "decode_state_bytes": {str(s): decode_state_bytes(cfg, s) for s in (1 << 17, 1 << 20)},
    }
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


def main(_):
    cfg = _model_cfg(_CONFIG.value)
    out = plan(cfg, _SHARD_GB.value)
    if _JSON.value:
        print(json.dumps(out))
        return
    print(f"model {out['name']}: {cfg.num_layers} layers '{out['layer_kinds']}', d_model "
          f"{cfg.d_model}, {cfg.moe.num_experts} experts (top-{cfg.moe.num_experts_per_tok})")
    print(f"  total params        {out['total_params']:>20,d}  ({out['total_params'] / 1e12:.3f} T)")
    print(f"    without MTP       {out['total_params_without_mtp']:>20,d}")
    print(f"    routed experts    {out['expert_params']:>20,d}")
    print(f"  active params/token {out['active_params']:>20,d}  ({out['active_params'] / 1e9:.1f} B)")
    print(f"  bytes bf16          {_fmt_bytes(out['bytes_bf16']):>20}")
    print(f"  bytes MXFP4 experts {_fmt_bytes(out['bytes_mxfp4']):>20}  "
          f"-> {out['num_shards']} shards of {_fmt_bytes(out['shard_bytes'])}")
    print("  decode state per sequence:")
    for s, d in out["decode_state_bytes"].items():
        print(f"    {int(s):>8,d} tokens: hybrid {_fmt_bytes(d['hybrid']):>12} | all-DSA "
              f"{_fmt_bytes(d['all_dsa']):>12} | all-MHA {_fmt_bytes(d['all_mha']):>12}")


if __name__ == "__main__":
    app.run(main)
