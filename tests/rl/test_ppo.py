"""PPO with a critic end to end: the value head (rl/critic.py), rollout-time old values and GAE
returns (rl/pipeline.build_train_batch), the train step's value loss (rl/train_step.py), run_rl
and the checkpointed critic.

Every jitted function here is built exactly as run_rl builds it from one config (the smoke config
with the "ppo" preset), on batches of run_rl's shapes, so the e2e run and the unit tests share
compiled executables (persistent compilation cache). The policy is the "test" model cut to one
dense DSA layer without MTP (the critic does not depend on the layer kinds, and this compiles in a
third of the time); without MoE balance, MTP or indexer losses, with zero advantages the
policy's whole gradient is the value loss's.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import rl as rl_configs
from model.config import ModelConfig
from model.transformer import Model
from rl.algorithms import algo_from_config
from rl.checkpoint import Checkpointer, CheckpointMismatchError
from rl.critic import CriticConfig, init_value_params, token_values
from rl.pipeline import ScoredGroup, build_train_batch
from rl.train_step import (
    CriticTrainState,
    TrainState,
    init_train_state,
    make_logp_fn,
    make_logp_value_fn,
    make_train_step,
)
from sandbox.tasks.loaders import save_tasks
from sandbox.tasks.schema import Task
from train.rl import run_rl
from train.run_config import RunConfig
from train.state import init_rl_state
from train.weights import load_rl_variables


def _config(workdir="/tmp/unused"):
    c = rl_configs.get_config("smoke")
    c.workdir = str(workdir)
    c.rl.algo = rl_configs.get_config("ppo_tiny").rl.algo  # gae lam .95, k1 KL in the reward
    c.rl.update(dict(steps=2, init_from="scratch", overlap_scoring=False, checkpoint_every=1))
    c.tasks.update(dict(train_per_domain=4, val_per_domain=1, test_per_domain=1))
    c.model.update(dict(num_layers=1, layer_pattern="D"))
    c.model.moe.num_experts = 0  # dense FFN: no balance loss
    c.model.mtp.depth = 0
    c.model.dsa.indexer_loss_weight = 0.0  # no indexer KL: the value loss can be the only term
    c.sft.indexer_warmup_steps = 0
    c.optim.update(dict(lr=1e-3, warmup_steps=1, total_steps=2))
    c.eval.every = 0
    c.sandbox.workers = 1
    return c


@pytest.fixture(scope="module")
def ppo():
    """What run_rl builds: model, algo, critic, fresh states, the step and rollout forwards."""
    config = _config()
    r = config.rl
    model = Model(ModelConfig.from_dict(config.model))
    algo = algo_from_config(r.algo)
    init_vars = model.init(jax.random.key(config.seed))
    typed = RunConfig.from_config(config)
    _, opt, critic, value_opt = init_rl_state(typed, model, algo, init_vars)

    def fresh_state():  # the step donates its input: a new copy per use
        return init_rl_state(typed, model, algo, jax.tree.map(jnp.copy, init_vars))[0]

    step = make_train_step(model, algo, opt, micro_batches=r.micro_batches, critic=critic,
                           value_optimizer=value_opt)
    return dict(config=config, model=model, algo=algo, critic=critic, fresh_state=fresh_state,
                step=step, logp_value_fn=make_logp_value_fn(model, critic),
                logp_fn=make_logp_fn(model), width=r.max_prompt_len + r.max_new_tokens,
                ref_vars=model.init(jax.random.key(1)))  # another policy: the KL is not 0


def _group(config, seed=0):
    """A scored group of run_rl's shape: prompts_per_batch x group_size rows; row 5 failed."""
    r = config.rl
    rng = np.random.default_rng(seed)
    n = r.prompts_per_batch * r.group_size
    plen = rng.integers(4, 20, n)
    prompts = np.zeros((n, r.max_prompt_len), np.int32)
    for i in range(n):
        prompts[i, : plen[i]] = rng.integers(3, 200, plen[i])
    clen = rng.integers(1, r.max_new_tokens + 1, n)
    clen[0] = r.max_new_tokens
    cmask = np.arange(r.max_new_tokens)[None] < clen[:, None]
    comps = np.where(cmask, rng.integers(3, 200, (n, r.max_new_tokens)), 0).astype(np.int32)
    failed = np.zeros(n, bool)
    failed[5] = True
    return ScoredGroup(
        tasks=[Task(id=f"t{i // r.group_size}", family="answer_check") for i in range(n)],
        group_ids=np.repeat(np.arange(r.prompts_per_batch), r.group_size), prompts=prompts,
        prompt_lengths=plen, completions=comps, completion_mask=cmask,
        sampler_logp=np.zeros(cmask.shape, np.float32), texts=[""] * n,
        rewards=np.array([1, 0, 1, 1, 0, 1, 0, 1], np.float32)[:n], failed=failed, details=[],
        gen_s=0.0)


def _random_head(value_params, seed):
    """The head with a random output layer (it starts at zero): values of std ~0.4."""
    k = value_params["out"]["kernel"]
    return {**value_params, "out": {"kernel": 0.05 * jax.random.normal(jax.random.key(seed),
                                                                       k.shape),
                                    "bias": jnp.full((1,), 0.1, jnp.float32)}}


def _forward(ppo, state, value_params=None):
    vp = state.value_params if value_params is None else value_params

    def forward(tokens, mask):
        old_logp, old_values = ppo["logp_value_fn"](state.variables, vp, tokens, mask)
        return {"old_logp": old_logp, "old_values": old_values,
                "ref_logp": ppo["logp_fn"](ppo["ref_vars"], tokens, mask)}
    return forward


def _hand_gae(rewards, values, mask, gamma, lam):
    """GAE over each row's valid positions, one python loop (the textbook recursion)."""
    adv, ret = np.zeros_like(values), np.zeros_like(values)
    for i in range(values.shape[0]):
        pos = np.flatnonzero(mask[i])
        a, next_v = 0.0, 0.0
        for t in pos[::-1]:
            delta = rewards[i, t] + gamma * next_v - values[i, t]
            a = delta + gamma * lam * a
            adv[i, t], ret[i, t], next_v = a, a + values[i, t], values[i, t]
    return adv, ret


def test_old_values_and_returns_match_gae_by_hand(ppo):
    config, algo = ppo["config"], ppo["algo"]
    group = _group(config)
    state = ppo["fresh_state"]()
    # a non-zero head so that the values are not all 0
    vp = _random_head(state.value_params, 3)
    fwd = _forward(ppo, state, vp)
    batch, met = build_train_batch(group, algo, ppo["width"], forward=fwd)
    mask = batch["loss_mask"]
    assert not mask[5].any() and mask.sum() == group.completion_mask[~group.failed].sum()
    # old values: [N,L], 0 off the mask (the train step's first values equal them: next test)
    v = batch["old_values"]
    assert np.all(v[~mask] == 0) and np.std(v[mask]) > 0.1

    # token rewards: outcome on the last completion token, minus kl_coef * k1(old, ref)
    kl = np.where(mask, batch["old_logp"] - batch["ref_logp"], 0.0)
    assert np.abs(kl[mask]).mean() > 1e-3
    last = np.array([np.flatnonzero(m).max() if m.any() else -1 for m in mask])
    tok_r = -algo.kl_coef * kl
    for i in np.flatnonzero(last >= 0):
        tok_r[i, last[i]] += group.rewards[i]
    adv, ret = _hand_gae(tok_r, batch["old_values"], mask, algo.gamma, algo.lam)
    np.testing.assert_allclose(batch["advantages"], adv, atol=2e-5)
    np.testing.assert_allclose(batch["returns"], ret, atol=2e-5)
    assert abs(met["kl_reward"] - kl[mask].mean()) < 1e-5

    # gamma = lam = 1, no KL: the return is the outcome reward at every completion position
    plain = algo.replace(lam=1.0, kl_placement="none", kl_coef=0.0)
    batch1, _ = build_train_batch(group, plain, ppo["width"], forward=fwd)
    want = np.where(mask, group.rewards[:, None], 0.0)
    np.testing.assert_allclose(batch1["returns"], want, atol=1e-5)
    np.testing.assert_allclose(batch1["advantages"], want - batch1["old_values"], atol=1e-5)

    with pytest.raises(ValueError, match="forward"):
        build_train_batch(group, algo, ppo["width"])


def _state_and_batch(ppo, seed):
    """A fresh PPO state with a random value head, and a train batch built with its values."""
    state = ppo["fresh_state"]()
    state = state.replace(value_params=_random_head(state.value_params, seed))
    batch, _ = build_train_batch(_group(ppo["config"]), ppo["algo"], ppo["width"],
                                 forward=_forward(ppo, state))
    return state, batch


def test_value_loss_falls_with_finite_gradients(ppo):
    state, batch = _state_and_batch(ppo, 3)
    mask = batch["loss_mask"]
    jb = {k: jnp.asarray(x) for k, x in batch.items()}
    mets = []
    for _ in range(5):
        state, met = ppo["step"](state, jb)
        met = jax.device_get(met)
        assert met["update_finite"] == 1.0
        assert np.isfinite(met["grad_norm"]) and 0 < met["value_grad_norm"] < np.inf
        mets.append(met)
    assert int(state.step) == 5
    # the trainer's values (same forward as the logits) start at the rollout's old values
    np.testing.assert_allclose(mets[0]["values_mean"], batch["old_values"][mask].mean(),
                               atol=1e-5)
    losses = [float(m["vf_loss"]) for m in mets]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses  # measured: 0.70
    ev = [float(m["vf_explained_var"]) for m in mets]
    assert all(b > a for a, b in zip(ev, ev[1:])), ev
    # value clipping (vf_clip=0.2 around the fixed old values) engages as the values move
    assert mets[0]["vf_clipfrac"] < 0.05 < mets[-1]["vf_clipfrac"], mets


def test_detached_critic_leaves_the_policy_gradient_alone(ppo):
    state, batch = _state_and_batch(ppo, 4)
    batch["advantages"] = np.zeros_like(batch["advantages"])  # the value loss is the only term
    before = jax.device_get((state.params, state.value_params))
    new, met = ppo["step"](state, {k: jnp.asarray(x) for k, x in batch.items()})
    assert float(met["grad_norm"]) == 0.0 and float(met["value_grad_norm"]) > 0.0
    assert float(met["vf_loss"]) > 0.0
    for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(new.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(before[1]), jax.tree.leaves(new.value_params)))

    # the switch itself: the head's gradient w.r.t. the trunk's hidden states
    h = jax.random.normal(jax.random.key(5), (2, 6, ppo["model"].cfg.d_model))  # [B,T,D]

    def grad_h(detached):
        c = CriticConfig(detached=detached)
        return jax.grad(lambda x: jnp.sum(token_values(c, before[1], x) ** 2))(h)

    assert float(jnp.max(jnp.abs(grad_h(True)))) == 0.0
    assert float(jnp.max(jnp.abs(grad_h(False)[:, :-1]))) > 0.0


def test_critic_config_and_missing_critic_errors(ppo):
    assert CriticConfig.from_config(ppo["config"].rl.critic) == ppo["critic"]
    with pytest.raises(ValueError, match="hidden_dim"):
        CriticConfig(hidden_dim=-1)
    with pytest.raises(ValueError, match="unknown CriticConfig fields"):
        CriticConfig.from_config({"detach": True})
    mlp = init_value_params(CriticConfig(hidden_dim=8), ppo["model"].cfg, jax.random.key(0))
    assert mlp["hidden"]["kernel"].shape == (ppo["model"].cfg.d_model, 8)
    model, algo = ppo["model"], ppo["algo"]
    step = make_train_step(model, algo, optax.sgd(1e-3), donate=False)
    state = init_train_state(model.init(jax.random.key(0)), optax.sgd(1e-3))  # no critic
    with pytest.raises(ValueError, match="trains a critic"):  # raised while tracing
        step(state, {"tokens": jnp.zeros((2, 4), jnp.int32),
                     "loss_mask": jnp.ones((2, 4), bool)})


# Reward 1 when the (byte-level) answer contains a digit: a random policy gets it about half
# the time, so the returns (and the critic's targets) are not all 0.
DIGIT_CHECK = "import re, sys\nsys.exit(0 if re.search('[0-9]', open('answer.txt').read()) else 1)\n"


@pytest.mark.slow
def test_run_rl_ppo_trains_and_checkpoints_the_critic(ppo, tmp_path):
    config = _config(tmp_path)
    config.tasks.task_file = str(tmp_path / "tasks.jsonl")
    save_tasks([Task(id=f"digit{i}", family="answer_check", prompt="say a digit",
                     check=DIGIT_CHECK, check_language="python", timeout_s=5) for i in range(8)],
               config.tasks.task_file)
    state = run_rl(config, progress=False)
    assert isinstance(state, CriticTrainState)
    assert int(state.step) == 2 and int(state.skipped) == 0
    assert float(jnp.max(jnp.abs(state.value_params["out"]["kernel"]))) > 0  # it learned
    lines = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    for key in ("rl/vf_loss", "rl/vf_clipfrac", "rl/vf_explained_var", "rl/value_grad_norm",
                "rl/returns_mean", "rl/kl_reward"):
        assert all(np.isfinite(x[key]) for x in lines), key
    assert sum(x["rl/reward_mean"] for x in lines) > 0 and lines[0]["rl/vf_loss"] > 0

    model = ppo["model"]
    template = jax.eval_shape(lambda: init_rl_state(
        RunConfig.from_config(config), model, ppo["algo"], model.init(jax.random.key(0)))[0])
    ckdir = tmp_path / "rl" / "checkpoints"
    with Checkpointer(ckdir, keep=5) as ck:
        restored = ck.restore_latest(template)
        assert restored.step == 2
        for a, b in zip(jax.tree.leaves((state.value_params, state.value_opt_state)),
                        jax.tree.leaves((restored.state.value_params,
                                         restored.state.value_opt_state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # a critic-free target does not match: the critic really is in the checkpoint
        critic_free = TrainState(params=template.params, router_state=template.router_state,
                                 opt_state=template.opt_state, step=template.step,
                                 skipped=template.skipped)
        with pytest.raises(CheckpointMismatchError, match="value_opt_state"):
            ck.restore(2, critic_free)
    variables = load_rl_variables(config, model)
    for a, b in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
