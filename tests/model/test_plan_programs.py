"""The planner's terms that the TPU compile of small_8dev corrected (docs/scaling.md section
4.2), pinned on the test preset (a few seconds, no libtpu; tests/rl/tpu_plan_check.py compares
with the compiler where libtpu is installed):
  * under expert parallelism every MoE layer keeps its dispatched rows and their gate/up
    projections into the backward, twice with remat (the forward's and the recompute's);
  * weights wider than the compute dtype are cast before the ZeRO-3 gather (the gathered copy
    is whole, in the compute dtype); the token embedding is looked up from its shards;
  * the step's transient peak is the larger of the backward's start and its end;
  * the rollout and reference-forward programs: parameters without the MTP module, the
    sampler's hoisted gathers of every block, its decode state and its prefill logits.
"""

import dataclasses

import jax.numpy as jnp
import pytest

from configs import models
from model import plan
from model import sharding as shd

MESH = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 1}


def _cfg(**over):
    cfg = models.build("test", **over)
    return cfg.replace(moe=dataclasses.replace(cfg.moe, expert_parallel="all_to_all"))


@pytest.mark.parametrize("remat", ["full", "none"])
def test_ep_rows_kept_by_every_moe_layer(remat):
    cfg = _cfg(remat=remat)
    pd = plan.per_device_plan(cfg, MESH, "tpu-v5p", batch=4, seq=48)
    t = pd["train"]
    ep = plan.ep_buffer_bytes(cfg, MESH, 48)  # 1 row per device (4 over fsdp x expert) x 48
    F = cfg.moe.expert_dim
    assert ep["kept"] == ep["rows"] * (cfg.d_model + 2 * F) * jnp.dtype(cfg.dtype).itemsize
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) + cfg.mtp.depth
    copies = 1 if remat == "none" else 2
    assert ep["layers"] == layers
    assert t["ep_buffers"] == 2 * ep["transient"] + copies * ep["kept"] * layers
    assert t["step_peak"] == max(t["backward_start"], t["backward_end"])
    assert t["total"] == t["state"] + t["step_peak"]


def test_gathers_are_cast_to_the_compute_dtype():
    wide = _cfg(param_dtype="float32", dtype="bfloat16")
    rules = shd.rules_from_config(None)
    plain = plan.fsdp_gathered_bytes(wide, MESH, rules)
    cast = plan.fsdp_gathered_bytes(wide, MESH, rules, cast=True)
    assert cast["all_blocks"] < plain["all_blocks"] and cast["one_block"] < plain["one_block"]
    same = _cfg(param_dtype="float32", dtype="float32")
    assert plan.fsdp_gathered_bytes(same, MESH, rules, cast=True) == plan.fsdp_gathered_bytes(
        same, MESH, rules)


def test_program_totals():
    cfg = _cfg()
    run = plan.RunPlan(reference=True, rollout_rows=4, rollout_len=48, rollout_prompt_len=16)
    pd = plan.per_device_plan(cfg, MESH, "tpu-v5p", batch=4, seq=48, run=run)
    progs, r, t = pd["programs"], pd["rollout"], pd["train"]
    assert progs["train_step"] == t["total"]
    # 1 row per device: the prefill's f32 logits of 16 prompt positions over the vocabulary
    assert r["logits"] == 1 * 16 * cfg.vocab_size * 4
    no_mtp = r["program"] - r["gathered_weights"] - r["decode_state"] - r["logits"]
    assert 0 < no_mtp < t["params_bf16"]  # the MTP module is not an argument of the sampler
    assert r["total"] == r["program"] + t["master_f32"] + t["adam_moments_f32"] + t[
        "reference_policy"]
    assert no_mtp < progs["ref_forward"] < no_mtp + r["gathered_weights"] + t["logits"]
