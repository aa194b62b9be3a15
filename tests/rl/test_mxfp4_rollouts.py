"""RL with MXFP4 rollouts (rl.rollout_experts="mxfp4", train/rollouts.py:rollout_policy): the sampler
runs packed experts, the trainer its float (or QAT) weights; the sampler/trainer log-prob gap is
logged by build_train_batch and TIS weights correct it. With a QAT trainer the gap closes (its
forward is the MXFP4 forward): the sampler on packed experts (grouped MXFP4 matmul) draws from
exactly the dequantised model's distribution. Bad configurations raise.

Covered: the hook's model/variables, the logged gap, the TIS weight in the policy loss. Not
covered here: a full run_rl (the smoke pipeline runs it: scripts/demo.py with
--config.rl.rollout_experts=mxfp4)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl as rl_configs
from model import quant
from model.config import ModelConfig
from model.tokenizer import ByteTokenizer
from model.transformer import Model
from rl import losses
from rl.algorithms import algo_from_config
from rl.pipeline import RolloutWorker, build_train_batch
from rl.sampler import SamplingConfig
from rl.train_step import make_logp_fn
from sandbox.tasks.schema import Task
from train.rollouts import rollout_policy
from train.run_config import RunConfig


def _config(**rl):
    c = rl_configs.get_config("smoke")
    c.rl.rollout_experts = "mxfp4"
    c.rl.update(rl)
    return c


def test_rollout_policy_validates():
    c = _config()
    model = Model(ModelConfig.from_dict(c.model))
    c.rl.algo.tis_cap = None
    with pytest.raises(ValueError, match="tis_cap"):
        rollout_policy(c, model)
    c = _config(rollout_experts="fp8")
    with pytest.raises(ValueError, match="rollout_experts"):
        RunConfig.from_config(c)
    c = _config()
    c.quant.high_precision = ",".join(quant.MODULE_GROUPS)
    with pytest.raises(ValueError, match="keeps the experts"):
        rollout_policy(c, model)
    same, fn = rollout_policy(_config(rollout_experts="bf16"), model)
    assert same is model and fn(1) == 1


def test_mxfp4_rollouts_log_the_gap_and_tis_corrects_it():
    c = _config()
    cfg = ModelConfig.from_dict(c.model)
    model = Model(cfg)
    variables = model.init(jax.random.key(0))
    smodel, to_sampler = rollout_policy(c, model)
    assert smodel.cfg.moe.expert_format == "mxfp4"
    sv = to_sampler(variables)
    assert not quant.has_float_experts(sv["params"]) and quant.has_float_experts(
        variables["params"])
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, eos_id=-1)
    tasks = [Task(id=f"t{i}", family="answer_check", prompt=f"say {i}", check="",
                  check_language="python") for i in range(2)]
    worker = RolloutWorker(smodel, ByteTokenizer(), sampling, None, group_size=2,
                           max_prompt_len=16)
    group = worker.generate(sv, tasks, jax.random.key(1))
    group.rewards[:] = [1.0, 0.0, 0.0, 1.0]
    algo = algo_from_config(c.rl.algo)
    assert algo.tis_cap == 2.0  # on by default

    def gap_with(trainer):
        logp_fn = make_logp_fn(trainer, sampling)
        return build_train_batch(group, algo, width=24, forward=lambda t, m: {
            "old_logp": logp_fn(variables, t, m)})

    batch, met = gap_with(model)  # float trainer vs MXFP4 sampler: a real gap
    assert met["logp_gap/sampler_trainer_mean"] > 1e-4, met
    m = batch["loss_mask"]
    gap = np.abs(batch["old_logp"] - batch["rollout_logp"])[m]
    assert met["logp_gap/sampler_trainer_mean"] == pytest.approx(float(gap.mean()), rel=1e-5)
    # TIS: the policy loss weights each token by min(pi_trainer / pi_sampler, cap)
    _, lm = losses.policy_loss(jnp.asarray(batch["old_logp"]), jnp.asarray(batch["old_logp"]),
                               jnp.asarray(batch["advantages"]), jnp.asarray(m),
                               rollout_logp=jnp.asarray(batch["rollout_logp"]), tis_cap=2.0)
    w = np.minimum(np.exp(batch["old_logp"] - batch["rollout_logp"]), 2.0)[m]
    assert float(lm["tis_weight_mean"]) == pytest.approx(float(w.mean()), rel=1e-4)
    assert abs(float(lm["tis_weight_mean"]) - 1.0) > 1e-5

    # a QAT trainer's forward is the MXFP4 sampler's: the gap closes
    qat = Model(cfg.replace(moe=dataclasses.replace(cfg.moe, qat=True)))
    _, met_q = gap_with(qat)
    assert met_q["logp_gap/sampler_trainer_mean"] < 2e-5, met_q
    assert met_q["logp_gap/sampler_trainer_mean"] < met["logp_gap/sampler_trainer_mean"] / 10
