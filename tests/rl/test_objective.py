"""One training objective for SFT and RL, on-policy log-probs, the indexer recipe, parameter
groups and derived config values (rl/train_step.py, model/objectives.py, rl/sampler.py,
configs/rl.py).

Covered: RL's loss with its policy term zeroed equals SFT's loss without its next-token term, term
by term, and RL's gradient reaches the DSA indexer; the sampler's log-probs equal the trainer's at
temperature 0.7 and 1 with top-k 20 (and differ from raw-logit log-probs, so the check has teeth);
sampled_logprobs against process_logits on random logits with top-k and top-p; the weight-decay
mask on reference_2p8t's abstract tree; the indexer warm-up changes the indexer and nothing else
and raises its recall; derived config values follow overrides.
Not covered here: the loop's staleness / TIS metrics (tests/rl/test_demo.py reads them from the
smoke run's metrics) and the demo's recall table (scripts/demo.py, README).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from configs import rl as rl_configs
from model import objectives
from model.config import ModelConfig
from model.transformer import Model
from rl import losses
from rl.algorithms import algo_from_config, get_algorithm
from rl.sampler import Sampler, SamplingConfig, pack, process_logits, sampled_logprobs
from rl.train_step import (
    decay_mask,
    indexer_mask,
    init_train_state,
    make_logp_fn,
    make_optimizer,
    make_rl_loss,
    make_sft_loss,
    make_sft_step,
)
from train.models import rl_model, warmup_model

N, L, P = 4, 40, 12  # rows, packed width, prompt length


def _cfg(**dsa):
    c = models.get_config("test")
    c.dsa.update(dict(indexer_loss_weight=0.5, index_topk=8, **dsa))
    return ModelConfig.from_dict(c)


@pytest.fixture(scope="module")
def setup():
    model = Model(_cfg())
    variables = model.init(jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (N, L), 3, 200), np.int32)
    mask = np.zeros((N, L), bool)
    for i, end in enumerate((L, L - 3, L - 7, 30)):  # completions of different lengths
        mask[i, P:end] = True
    return model, variables, jnp.asarray(tokens), jnp.asarray(mask)


def test_sft_and_rl_share_one_objective(setup):
    model, variables, tokens, mask = setup
    cfg = model.cfg
    assert cfg.mtp.depth and cfg.mtp.loss_weight and cfg.moe.aux_loss_coef
    batch = {"tokens": tokens, "loss_mask": mask}
    sft_loss, (sft_met, _) = jax.jit(make_sft_loss(model))(
        variables["params"], variables["router_state"], batch)

    algo = get_algorithm("grpo", kl_placement="none", kl_coef=0.0)  # policy term only
    rl_fn = make_rl_loss(model, algo)
    mb = {**batch, "old_logp": jnp.zeros((N, L)), "advantages": jnp.zeros((N, 1))}
    counts = losses.agg_counts(mask)
    tcounts = objectives.target_counts(mask, cfg.mtp.depth)
    (rl_total, (rl_met, _, _)), grads = jax.jit(jax.value_and_grad(rl_fn, has_aux=True))(
        (variables["params"], None), variables["router_state"], mb, counts, tcounts)

    assert float(rl_met["policy_loss"]) == 0.0  # zero advantages: no policy term
    np.testing.assert_allclose(float(rl_total), float(sft_loss - sft_met["ce"]), rtol=1e-6)
    for k in ("mtp_ce", "balance_loss", "indexer_kl", "aux_loss"):
        np.testing.assert_allclose(float(rl_met[k]), float(sft_met[k]), rtol=1e-6, err_msg=k)
    assert float(sft_met["indexer_kl"]) > 0 and float(sft_met["mtp_ce"]) > 0

    # RL keeps training the indexer: its parameters get gradient from the indexer KL ...
    g = jax.tree_util.tree_flatten_with_path(grads[0])[0]
    idx = [float(jnp.abs(x).max()) for p, x in g if "idx_" in jax.tree_util.keystr(p)]
    assert idx and min(idx) > 0, idx
    # ... unless rl.train_indexer is off: the RL model then carries weight 0 (no indexer term)
    config = rl_configs.get_config("smoke")
    config.rl.train_indexer = False
    assert rl_model(config).cfg.dsa.indexer_loss_weight == 0.0
    config.rl.train_indexer = True
    assert rl_model(config).cfg.dsa.indexer_loss_weight == config.model.dsa.indexer_loss_weight


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampler_logprobs_equal_trainer_logprobs(setup, temperature):
    model, variables, _, _ = setup
    sampling = SamplingConfig(max_new_tokens=16, temperature=temperature, top_k=20, eos_id=-1)
    prompts = jax.random.randint(jax.random.key(2), (N, P), 3, 200)
    lengths = jnp.array([P, P - 2, P - 5, 4], jnp.int32)
    out = Sampler(model, sampling).generate(variables, prompts, lengths, jax.random.key(3))
    tokens, mask, rollout = pack(prompts, lengths, out.tokens, out.mask, width=P + 16,
                                 extras=(out.logprobs,))
    trainer = make_logp_fn(model, sampling)(variables, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(trainer)[mask], rollout[mask], atol=2e-4)
    # raw logits (what the trainer used before) describe another policy at T=0.7
    raw = make_logp_fn(model)(variables, jnp.asarray(tokens), jnp.asarray(mask))
    gap = np.abs(np.asarray(raw)[mask] - rollout[mask]).max()
    assert gap > (1e-2 if temperature != 1.0 else 1e-3), gap  # top-k 20 renormalises too


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 7, 1.0), (2.0, 0, 0.8),
                                                     (0.7, 12, 0.6), (1.0, 0, 1.0)])
def test_sampled_logprobs_match_process_logits(temperature, top_k, top_p):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = jax.random.normal(jax.random.key(4), (3, 5, 50)) * 3.0  # [N,L,V]
    logp_all = process_logits(logits, cfg)
    targets = jax.random.categorical(jax.random.key(5), logp_all)  # drawn from the sampler
    want = jnp.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    got, got_all = sampled_logprobs(logits, targets, cfg)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(jnp.exp(got_all).sum(-1), 1.0, atol=1e-5)
    if top_k or top_p < 1:
        # a token the current logits would cut (after an update) keeps a finite log-prob and
        # finite gradients, instead of -inf and NaN ratios
        worst = jnp.argmin(logits, -1)
        f = lambda z: sampled_logprobs(z, worst, cfg)[0].sum()
        val, grad = jax.value_and_grad(f)(logits)
        assert np.isfinite(float(val)) and bool(jnp.all(jnp.isfinite(grad)))
        assert float(jnp.max(jnp.take_along_axis(process_logits(logits, cfg), worst[..., None],
                                                 -1))) == -np.inf
    with pytest.raises(ValueError, match="temperature"):
        sampled_logprobs(logits, targets, SamplingConfig(temperature=0.0))


# The leaves of reference_2p8t that get weight decay (layer indices folded into layer_*): every
# float kernel/matrix; never A_log, dt_bias, norm scales, biases, embeddings or packed MXFP4.
DECAYING = {
    "embed/head", "mtp_0_combine/proj/kernel",
    *(f"{blk}/attn/{n}" for blk in ("layer_*", "mtp_0_block") for n in (
        "idx_k/kernel", "idx_q/kernel", "idx_w/kernel", "kv_a/kernel", "out/kernel",
        "q_a/kernel", "q_b/kernel", "w_uk", "w_uv")),
    *(f"layer_*/attn/{n}" for n in (
        "beta/kernel", "conv", "gate_down/kernel", "gate_up/kernel", "ogate_down/kernel",
        "ogate_up/kernel", "qkv/kernel")),
    *(f"{blk}/ffn/{n}" for blk in ("layer_*", "mtp_0_block") for n in (
        "router", "shared/down/kernel", "shared/gate/kernel", "shared/up/kernel")),
    "layer_*/ffn/down/kernel", "layer_*/ffn/gate/kernel", "layer_*/ffn/up/kernel",  # dense layer
}


def test_weight_decay_mask_on_reference_tree():
    model = Model(ModelConfig.from_dict(models.get_config("reference_2p8t")))
    params = nn.meta.unbox(model.abstract_init()["params"])
    mask = decay_mask(params)
    decays, frozen = set(), set()
    for path, d in jax.tree_util.tree_flatten_with_path(mask)[0]:
        name = re.sub(r"layer_\d+", "layer_*", "/".join(str(k.key) for k in path))
        (decays if d else frozen).add(name)
    assert decays == DECAYING, sorted(decays ^ DECAYING)
    assert {"layer_*/attn/A_log", "layer_*/attn/dt_bias", "embed/embedding", "final_norm/scale",
            "layer_*/attn/o_norm", "layer_*/attn/idx_k_norm/bias",
            "layer_*/ffn/w_up_blocks", "layer_*/ffn/w_up_scales"} <= frozen
    assert not decays & frozen  # every layer of a kind agrees


@pytest.mark.slow
def test_indexer_warmup_trains_only_the_indexer_and_raises_recall(setup):
    model, variables, tokens, mask = setup
    wmodel = warmup_model(model.cfg)
    assert wmodel.cfg.dsa.indexer_stage == "dense_warmup"
    opt = make_optimizer(_optim(3e-2), trainable=indexer_mask)
    state = init_train_state(jax.tree.map(jnp.copy, variables), opt)
    step = make_sft_step(wmodel, opt, objective="indexer_warmup", donate=False)
    batch = {"tokens": tokens, "loss_mask": mask}
    before = float(model.indexer_recall(variables, tokens)["mean"])
    kls = []
    for _ in range(25):
        state, met = step(state, batch)
        kls.append(float(met["indexer_kl"]))
    assert kls[-1] < 0.7 * kls[0], kls
    moved = {jax.tree_util.keystr(p): bool(jnp.any(a != b)) for (p, a), b in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(variables["params"]))}
    assert all(v == ("idx_" in k) for k, v in moved.items()), moved
    after = float(model.indexer_recall(state.variables, tokens)["mean"])
    assert after > before + 0.1, (before, after)
    with pytest.raises(ValueError, match="dense_warmup"):
        make_sft_step(model, opt, objective="indexer_warmup")


def _optim(lr):
    from train.state import optim_config as optim
    return optim(lr, 1, 100, 0.0)


def test_derived_config_values_follow_overrides():
    c = rl_configs.get_config("dapo_tiny")
    c.rl.max_new_tokens = 60
    c.rl.steps = 70
    c.rl.prompts_per_batch = 4
    algo = algo_from_config(c.rl.algo)
    assert (algo.max_len, algo.overlong_cache_len) == (60, 10)
    assert c.optim.total_steps == 70 and c.eval.batch_prompts == 4 * c.rl.group_size
    c.rl.algo.overlong_cache_len = 5  # setting a derived value breaks only its own link
    assert algo_from_config(c.rl.algo).overlong_cache_len == 5 and c.rl.max_new_tokens == 60
    # every algorithm field is overridable (the README's example), including None-valued ones
    d = rl_configs.get_config("demo")
    d.rl.algo.clip_high = 0.28
    d.rl.algo.clip_c = 3.0
    a = algo_from_config(d.rl.algo)
    assert (a.clip_high, a.clip_c, a.tis_cap) == (0.28, 3.0, 2.0)
    # switching the preset by name re-fills the fields the config did not choose
    # and keeps what the config chose away from GRPO's preset (tis_cap, the KL to the SFT policy
    # as one choice), so it equals the project's own variant of that preset
    for name in ("gspo", "dapo"):
        g = rl_configs.get_config("grpo_tiny")
        g.rl.algo.name = name
        a = algo_from_config(g.rl.algo)
        want = algo_from_config(rl_configs.get_config(f"{name}_tiny").rl.algo)
        assert a == want, (a, want)
    g = rl_configs.get_config("grpo_tiny")  # rloo_tiny folds the KL into the reward; a switch
    g.rl.algo.name = "rloo"                   # keeps this config's choice (KL in the loss)
    a = algo_from_config(g.rl.algo)
    assert (a.name, a.estimator, a.kl_placement, a.kl_coef) == ("rloo", "rloo", "loss", 0.05)
    g = rl_configs.get_config("grpo_tiny")
    g.rl.algo.update(dict(name="gspo", kl_placement="none", kl_coef=0.0))
    a = algo_from_config(g.rl.algo)
    assert (a.name, a.ratio_level, a.kl_placement, a.tis_cap) == ("gspo", "sequence", "none", 2.0)
