"""Sampler and train-step tests on the 2-layer test model (KDA + DSA + MoE + MTP)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from configs import models
from model.config import ModelConfig
from model.transformer import Model
from rl.algorithms import get_algorithm
from rl.sampler import Sampler, SamplingConfig, pack
from rl.train_step import init_train_state, make_logp_fn, make_optimizer, make_train_step

OPTIM = ConfigDict(dict(lr=1e-3, warmup_steps=1, total_steps=10, final_lr_frac=0.1,
                        weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0))


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_dict(models.get_config("test"))
    model = Model(cfg)
    return model, model.init(jax.random.key(0))


@pytest.fixture(scope="module")
def logp_fn(setup):
    """One jitted trainer log-prob function for every test here."""
    return make_logp_fn(setup[0])


# One sampler program (rl/sampler.py compiles one per sampling config without its temperature)
# serves the greedy, sampled and EOS-reference generations below: 8 new tokens, no EOS id.
N_NEW = 8


def _prompts():
    prompts = jnp.array([[1, 40, 41, 42, 43], [1, 50, 51, 0, 0], [1, 60, 0, 0, 0]], jnp.int32)
    return prompts, jnp.array([5, 3, 2])


def test_greedy_sampler_matches_recomputation(setup):
    model, variables = setup
    prompts, lengths = _prompts()
    out = Sampler(model, SamplingConfig(max_new_tokens=8, temperature=0.0, eos_id=-1)).generate(
        variables, prompts, lengths, jax.random.key(1))
    assert out.tokens.shape == (3, 8) and bool(jnp.all(out.mask))
    # recompute without a cache: one teacher-forced forward over prompt + completion; greedy
    # means every generated token is the argmax at the position before it
    tokens, mask = pack(prompts, lengths, out.tokens, out.mask)
    logits = jax.jit(lambda v, t: model.apply(v, t, with_mtp=False).logits)(
        variables, jnp.asarray(tokens))
    pred = np.asarray(jnp.argmax(logits[:, :-1], axis=-1))
    np.testing.assert_array_equal(pred[mask[:, 1:]], np.asarray(tokens)[:, 1:][mask[:, 1:]])


def test_sampled_logprobs_match_trainer_and_are_reproducible(setup, logp_fn):
    model, variables = setup
    prompts, lengths = _prompts()
    sampler = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=1.0, eos_id=-1))
    a = sampler.generate(variables, prompts, lengths, jax.random.key(7))
    b = sampler.generate(variables, prompts, lengths, jax.random.key(7))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    c = sampler.generate(variables, prompts, lengths, jax.random.key(8))
    assert not np.array_equal(a.tokens, c.tokens)
    tokens, mask, rollout = pack(prompts, lengths, a.tokens, a.mask, extras=(a.logprobs,))
    trainer = logp_fn(variables, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(trainer)[mask], rollout[mask], atol=2e-4)


def test_eos_stop_sequences_and_top_k(setup):
    model, variables = setup
    prompts, lengths = _prompts()
    greedy = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=-1))
    ref = np.asarray(greedy.generate(variables, prompts, lengths, jax.random.key(0)).tokens)
    # make the 3rd greedy token of row 0 the EOS id: row 0 stops there, others go on
    eos = int(ref[0, 2])
    out = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=eos)
                  ).generate(variables, prompts, lengths, jax.random.key(0))
    first = [int(np.argmax(ref[b] == eos)) if (ref[b] == eos).any() else N_NEW for b in range(3)]
    for b in range(3):
        n = min(first[b] + 1, N_NEW)
        assert int(out.lengths[b]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens[b, :n]), ref[b, :n])
        assert bool(out.finished[b]) == (first[b] < N_NEW)
    stop = tuple(int(t) for t in ref[1, 1:3])
    out = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=-1,
                                        stop_sequences=(stop,))).generate(
        variables, prompts, lengths, jax.random.key(0))
    assert int(out.lengths[1]) <= 3 and bool(out.finished[1])
    # top_k=1 sampling is greedy
    out = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=1.0, top_k=1, eos_id=-1)
                  ).generate(variables, prompts, lengths, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    np.testing.assert_allclose(np.asarray(out.logprobs), 0.0, atol=1e-6)


def test_sampler_rejects_bad_input(setup):
    model, variables = setup
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    s = Sampler(model, SamplingConfig(max_new_tokens=300))
    with pytest.raises(ValueError, match="max_seq_len"):
        s.generate(variables, jnp.ones((1, 4), jnp.int32), jnp.array([4]), jax.random.key(0))


def _batch(logp_fn, variables, n=4, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, 200, (n, 6)).astype(np.int32)
    comps = rng.integers(3, 200, (n, 8)).astype(np.int32)
    cmask = np.arange(8)[None] < rng.integers(3, 9, (n, 1))
    tokens, mask = pack(prompts, np.full(n, 6), comps, cmask, width=16)
    logp = logp_fn(variables, jnp.asarray(tokens), jnp.asarray(mask))
    adv = rng.normal(size=(n, 1)).astype(np.float32)
    return {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask),
            "advantages": jnp.asarray(adv), "old_logp": logp, "ref_logp": logp,
            "rollout_logp": logp}


@pytest.fixture(scope="module")
def grpo_step1(setup):
    model, _ = setup
    opt = make_optimizer(OPTIM)
    algo = get_algorithm("grpo")
    return opt, algo, make_train_step(model, algo, opt, micro_batches=1,
                                      donate=False)


@pytest.mark.slow
def test_micro_batches_equal_full_batch(setup, grpo_step1, logp_fn):
    # (GSPO's sequence-level ratio and every other preset run under jax.grad in test_algorithms)
    model, variables = setup
    opt, algo, step1 = grpo_step1
    batch = _batch(logp_fn, variables)
    s1, m1 = step1(init_train_state(variables, opt), batch)
    s2, m2 = make_train_step(model, algo, opt, micro_batches=2, donate=False)(
        init_train_state(variables, opt), batch)
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=3e-5)  # Adam: ~lr*sign(g) for g~0
    assert int(s1.step) == 1 and int(s1.skipped) == 0
    # the update moved the params and the aux-free router bias
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(s1.params), jax.tree.leaves(variables["params"]))]
    assert max(moved) > 0
    biases = jax.tree.leaves(s1.router_state)
    assert biases and any(float(jnp.max(jnp.abs(b))) > 0 for b in biases)


def test_nonfinite_update_is_skipped(setup, grpo_step1, logp_fn):
    model, variables = setup
    opt, _, step1 = grpo_step1
    batch = _batch(logp_fn, variables)
    batch["advantages"] = batch["advantages"].at[0, 0].set(jnp.nan)
    new, met = step1(init_train_state(variables, opt), batch)
    assert int(new.skipped) == 1 and int(new.step) == 0 and float(met["update_finite"]) == 0
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(variables["params"])):
        np.testing.assert_array_equal(a, b)
