"""MTP self-speculative decoding (rl/sampler.py, speculative="mtp") on the 2-layer test model.

Covered: the model's verify + commit equal token-by-token decode steps (logits, KDA states, conv
windows, lengths) for every per-row commit count; the acceptance rule emits tokens distributed
as the target (empirical frequencies over 200k draws); greedy speculative output equals the
plain greedy sampler token for token, with drafts both accepted and rejected, EOS and stop
sequences; sampled speculative log-probs equal the trainer's. The model is the test model trained
on counting sequences (tests/conftest.py `counting_model`), so its MTP head drafts tokens worth
accepting; a copy with a noisy MTP projection exercises rejections.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ModelConfig
from model.objectives import counting_tokens
from model.transformer import Model
from rl.sampler import Sampler, SamplingConfig, pack
from rl.speculative import verify_draft
from rl.train_step import make_logp_fn


@pytest.fixture(scope="module")
def trained(counting_model):
    assert float(counting_model.history[-1]["mtp_ce"]) < 1.0  # the draft head learned something
    return counting_model.model, counting_model.variables


@pytest.fixture(scope="module")
def bad_drafts(trained):
    """The trained model with its MTP input projection replaced by noise: drafts mostly wrong."""
    model, variables = trained
    params = dict(variables["params"])
    comb = dict(params["mtp_0_combine"])
    proj = dict(comb["proj"])
    proj["kernel"] = jax.random.normal(jax.random.key(11), proj["kernel"].shape)
    comb["proj"] = proj
    params["mtp_0_combine"] = comb
    return {**variables, "params": params}


def _prompts():
    """Two counting prompts (drafts mostly right) and one random one (drafts mostly wrong)."""
    count = np.asarray(counting_tokens(jax.random.key(9), 2, 6))
    rand = np.asarray(jax.random.randint(jax.random.key(3), (1, 6), 3, 250))
    prompts = np.concatenate([count, rand]).astype(np.int32)
    lengths = np.array([6, 4, 5], np.int32)
    prompts[np.arange(6)[None] >= lengths[:, None]] = 0
    return jnp.asarray(prompts), jnp.asarray(lengths)


def test_verify_and_commit_equal_sequential_decode(trained):
    model, variables = trained
    prompts, lengths = _prompts()
    cache = model.init_cache(3, 16)
    _, cache, _ = jax.jit(model.prefill)(variables, prompts, lengths, cache)
    two = jnp.array([[7, 8], [9, 10], [11, 12]], jnp.int32)
    logits, step_cache, _ = jax.jit(model.verify)(variables, two, cache)
    step = jax.jit(model.decode_step)
    l0, c1, _ = step(variables, two[:, 0], cache)
    l1, c2, _ = step(variables, two[:, 1], c1)
    np.testing.assert_allclose(logits[:, 0], l0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[:, 1], l1, rtol=1e-4, atol=1e-4)
    n = jnp.array([0, 1, 2])  # row b keeps b tokens
    got = jax.jit(model.commit)(step_cache, n)
    np.testing.assert_array_equal(got["lengths"], cache["lengths"] + n)
    for kind, g, a, b, c in zip(model.cfg.layer_kinds(), got["layers"], cache["layers"],
                                c1["layers"], c2["layers"]):
        if kind != "K":
            continue  # DSA rows are positional (past-length rows are rewritten before use)
        for key in ("state", "conv"):
            for row, want in enumerate((a, b, c)):
                np.testing.assert_allclose(g[key][row], want[key][row], rtol=1e-5, atol=1e-6)


def test_verify_draft_emits_the_target_distribution():
    V, N = 6, 200_000
    p = jnp.log(jnp.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1]))
    q = jnp.log(jnp.array([0.3, 0.05, 0.2, 0.25, 0.1, 0.1]))
    kd, kv = jax.random.split(jax.random.key(0))
    draft = jax.random.categorical(kd, jnp.broadcast_to(q, (N, V)), axis=-1).astype(jnp.int32)
    tok, acc = jax.jit(verify_draft)(jnp.broadcast_to(p, (N, V)), jnp.broadcast_to(q, (N, V)),
                                     draft, kv, jnp.bool_(False))
    freq = np.bincount(np.asarray(tok), minlength=V) / N
    np.testing.assert_allclose(freq, np.exp(np.asarray(p)), atol=0.006)  # ~6 sigma
    # acceptance probability sum_x min(p, q) = 0.05+0.05+0.1+0.25+0.1+0.1 = 0.65
    assert abs(float(jnp.mean(acc)) - 0.65) < 0.006
    # greedy: accepted iff the draft is the argmax
    tok, acc = verify_draft(p[None].repeat(2, 0), q[None].repeat(2, 0), jnp.array([1, 3]),
                            kv, jnp.bool_(True))
    assert tok.tolist() == [1, 1] and acc.tolist() == [True, False]


@pytest.mark.parametrize("stop", ["none", "eos_and_stop_sequence"])
def test_greedy_speculative_equals_plain_greedy(trained, bad_drafts, stop):
    model, good = trained
    prompts, lengths = _prompts()
    G = 12
    rate = {}
    for name, variables in (("good", good), ("bad", bad_drafts)):
        base = SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=-1)
        ref = Sampler(model, base).generate(variables, prompts, lengths, jax.random.key(0))
        if stop != "none":  # row 0 ends by EOS at its 5th token, row 1 by a stop sequence
            eos, seq = int(ref.tokens[0, 4]), tuple(int(t) for t in ref.tokens[1, 5:7])
            base = SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=eos,
                                  stop_sequences=(seq,))
            ref = Sampler(model, base).generate(variables, prompts, lengths, jax.random.key(0))
            assert int(ref.lengths[0]) <= 5 and int(ref.lengths[1]) <= 7
            assert bool(ref.finished[0]) and bool(ref.finished[1])
        spec = SamplingConfig(**{**base.__dict__, "speculative": "mtp"})
        out = Sampler(model, spec).generate(variables, prompts, lengths, jax.random.key(1))
        for f in ("tokens", "mask", "lengths", "finished", "logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(out, f)),
                                          np.asarray(getattr(ref, f)), f"{name} {f}")
        verified, accepted = (int(x) for x in out.draft_stats)
        rate[name] = accepted / verified
    # both branches ran: the trained head's drafts are mostly accepted, the noisy head's not
    assert rate["good"] > 0.5 > rate["bad"], rate


def test_sampled_speculative_logprobs_match_trainer(trained):
    model, variables = trained
    prompts, lengths = _prompts()
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, eos_id=-1, speculative="mtp")
    sampler = Sampler(model, cfg)
    a = sampler.generate(variables, prompts, lengths, jax.random.key(7))
    b = sampler.generate(variables, prompts, lengths, jax.random.key(7))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert np.asarray(a.mask).all()  # no EOS: every row generates max_new_tokens
    tokens, mask, rollout = pack(prompts, lengths, a.tokens, a.mask, extras=(a.logprobs,))
    trainer = make_logp_fn(model)(variables, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(trainer)[mask], rollout[mask], atol=2e-4)
    assert int(a.draft_stats[1]) > 0


def test_speculative_needs_an_mtp_module():
    cfg = models.get_config("test")
    cfg.mtp.depth = 0
    model = Model(ModelConfig.from_dict(cfg))
    with pytest.raises(ValueError, match="mtp.depth"):
        Sampler(model, SamplingConfig(speculative="mtp"))
    with pytest.raises(ValueError, match="speculative must be one of"):
        SamplingConfig(speculative="eagle")
