"""Optimizer numerics at scale and what the planner counts for them.

* make_optimizer(master_dtype="float32"): bf16 parameters get an f32 master and f32 Adam
  moments; the bf16 parameters are the master rounded; updates smaller than bf16's resolution
  accumulate in the master (and are lost without it: the attack on bf16 training the master
  exists for); f32 models keep exactly the optimizer state they had.
* mu_dtype alone: f32 first moment, second moment in the parameter dtype (optax).
* model/plan.py counts those dtypes, the micro-batch gradient accumulator, the reference
  policy, the rollout batch next to the train state, the expert-parallel buffers, and warns
  about the dropless all_to_all (configs/rl.py:reference).
In-process and small; the planner against XLA's compiled memory is in test_sharded_rl.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from rl.train_step import MasterCopyState, make_optimizer

BASE = dict(lr=1e-3, warmup_steps=1, total_steps=10, final_lr_frac=1.0, weight_decay=0.0,
            b1=0.9, b2=0.99, eps=1e-8, clip_norm=0.0)


def _opt(**kw):
    return make_optimizer(ConfigDict({**BASE, **kw}))


def test_f32_master_accumulates_what_bf16_rounds_away():
    params = {"w": jnp.ones((8, 8), jnp.bfloat16), "scale": jnp.ones((8,), jnp.float32)}
    grads = {"w": jnp.ones((8, 8), jnp.bfloat16), "scale": jnp.ones((8,), jnp.float32)}
    opt = _opt(master_dtype="float32", mu_dtype="float32", lr=1e-3)
    state = opt.init(params)
    assert isinstance(state, MasterCopyState)
    assert state.master["w"].dtype == jnp.float32
    assert isinstance(state.master["scale"], optax.MaskedNode)  # f32: its own master
    for x in jax.tree.leaves(state.inner):
        assert x.dtype in (jnp.float32, jnp.int32), x.dtype  # moments in f32
    p, s = params, state
    for _ in range(3):  # each Adam step moves by ~lr = 1e-3, below bf16's spacing at 1 (2^-7)
        u, s = opt.update(grads, s, p)
        p = optax.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(s.master["w"]), 1 - 3e-3, rtol=1e-6)
    assert p["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p["w"], np.float32),
                                  np.asarray(s.master["w"].astype(jnp.bfloat16), np.float32))
    np.testing.assert_allclose(np.asarray(p["scale"]), 1 - 3e-3, rtol=1e-6)
    # without the master the same three steps are lost to rounding
    plain = _opt(master_dtype="")
    q, t = params, plain.init(params)
    for _ in range(3):
        u, t = plain.update(grads, t, q)
        q = optax.apply_updates(q, u)
    np.testing.assert_array_equal(np.asarray(q["w"], np.float32), 1.0)
    # nu stays bf16 without a master, mu follows mu_dtype
    adam = _opt(master_dtype="", mu_dtype="float32").init(params)[0][0]
    assert adam.mu["w"].dtype == jnp.float32 and adam.nu["w"].dtype == jnp.bfloat16


def test_f32_models_keep_their_optimizer_state():
    params = {"w": jnp.ones((4, 4)), "b": jnp.zeros((4,))}
    with_master, without = _opt(master_dtype="float32"), _opt()
    assert jax.tree.structure(with_master.init(params)) == jax.tree.structure(
        without.init(params))
    g = {"w": jnp.full((4, 4), 0.5), "b": jnp.ones((4,))}
    u1, _ = with_master.update(g, with_master.init(params), params)
    u0, _ = without.update(g, without.init(params), params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_planner_counts_what_the_run_allocates():
    from configs import rl as rl_configs
    from model.config import ModelConfig
    from model.plan import RunPlan, per_device_plan
    from train.run_plan import run_plan_from_config

    c = rl_configs.get_config("smoke_8dev")
    cfg = ModelConfig.from_dict(c.model)
    mesh = c.sharding.mesh
    base = per_device_plan(cfg, mesh, batch=16, seq=32, run=RunPlan())["train"]
    run = run_plan_from_config(c)
    assert run.reference and run.rollout_rows == 8 and run.master_dtype == "float32"
    full = per_device_plan(cfg, mesh, batch=16, seq=32,  # 2 micro-batches of 8 rows
                           run=RunPlan(**{**run.__dict__, "micro_batches": 2}))
    t = full["train"]
    # the reference policy and the micro-batch accumulator are each one more parameter tree
    assert t["reference_policy"] == t["params_bf16"] == t["grad_accumulator"] > 0
    assert t["total"] - base["total"] == t["reference_policy"] + t["grad_accumulator"] + (
        t["activations"] + t["ep_buffers"] - base["activations"] - base["ep_buffers"])
    assert t["activations"] < base["activations"]  # half the batch per micro-batch
    # f32 params: no master; Adam mu + nu in f32
    assert t["master_f32"] == 0 and t["adam_moments_f32"] == 2 * t["params_bf16"]
    # expert parallelism (all_to_all, dropless): E x n rows per layer (n = 1 row x 32 tokens
    # per device and micro-batch), E/k = 2x the routed assignments
    assert t["ep_buffer_rows"] == 4 * 32 and t["ep_buffers"] > 0
    assert full["rollout"]["rows"] == 8 and full["rollout"]["decode_state"] > 0
    # bf16 params without a master: nu in bf16 (2 bytes), mu in f32 (4)
    bcfg = cfg.replace(param_dtype="bfloat16")
    nm = per_device_plan(bcfg, mesh, batch=8, seq=32,
                         run=RunPlan(master_dtype="", mu_dtype="float32"))["train"]
    ms = per_device_plan(bcfg, mesh, batch=8, seq=32, run=RunPlan())["train"]
    assert nm["master_f32"] == 0 and ms["master_f32"] > 0
    assert nm["adam_nu"] < nm["adam_mu"] == ms["adam_mu"] == ms["adam_nu"]


def test_planner_warns_about_the_dropless_all_to_all():
    from configs import rl as rl_configs
    from model.config import ModelConfig
    from model.plan import ep_buffer_bytes, per_device_plan
    from train.run_plan import run_plan_from_config

    c = rl_configs.get_config("reference")
    c.model.moe.expert_parallel = "all_to_all"
    c.rl.micro_batches = 1  # the whole batch of 256 at once: 8192 tokens per device
    pd = per_device_plan(ModelConfig.from_dict(c.model), "fsdp=16,expert=8,tensor=8", "h200",
                         batch=256, seq=4096, run=run_plan_from_config(c))
    w = [x for x in pd["warnings"] if "dropless" in x]
    assert w and "use moe.dispatch='capacity'" in w[0], pd["warnings"]
    # 1000 experts x 8192 local tokens of d_model 7168 in bf16, send + receive: 117 GB
    assert pd["train"]["ep_buffer_rows"] == 1000 * 8192
    assert pd["train"]["ep_buffers"] >= 2 * 2 * 1000 * 8192 * 7168  # fwd + bwd send/receive
    c.model.moe.dispatch = "capacity"  # C = ceil(1.25 x 8192 x 8 / 1000) rows per expert
    shape = {"data": 1, "fsdp": 16, "expert": 8, "tensor": 8}
    ep = ep_buffer_bytes(ModelConfig.from_dict(c.model), shape, 8192)
    assert ep["rows"] == 1000 * -(-125 * 8192 * 8 // 100000)
