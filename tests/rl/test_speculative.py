"""MTP self-speculative decoding (rl/speculative.py, speculative="mtp") on the 2-layer test model.

Covered: the model's verify + commit equal token-by-token decode steps (logits, KDA states, conv
windows, lengths) for every per-row commit count, and decoding after a commit of 0..3 of 4
verified tokens equals plain decoding; the acceptance rule emits tokens distributed as the target
(empirical frequencies over 200k draws); greedy speculative output with k = 1, 2, 3 drafts per
step equals the plain greedy sampler token for token, with drafts both accepted and rejected,
EOS inside an accepted run, stop sequences and max_new_tokens; sampled output with k = 2 has the
target's joint distribution over whole completions (chi-square against the exact probabilities,
and the same test rejects a sampler that accepts every draft); sampled speculative log-probs
equal the trainer's; the k-choice cost model. The model is the test model trained on counting
sequences (tests/conftest.py `counting_model`), so its MTP head drafts tokens worth accepting; a
copy with a noisy MTP projection exercises rejections.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ModelConfig
from model.objectives import counting_tokens
from model.transformer import Model
from rl import speculative
from rl.sampler import Sampler, SamplingConfig, pack, process_logits
from rl.speculative import (
    choose_draft_tokens,
    draft_summary,
    expected_tokens_per_pass,
    fit_step_cost,
    verify_draft,
)
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


def test_greedy_speculative_equals_plain_greedy(trained, bad_drafts):
    """k = 1: row 0 ends by EOS, row 1 by a stop sequence, row 2 at max_new_tokens."""
    model, good = trained
    prompts, lengths = _prompts()
    G = 10  # row 2's greedy text would reach the EOS token at its 11th token
    rate = {}
    for name, variables in (("good", good), ("bad", bad_drafts)):
        base = SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=-1)
        ref = Sampler(model, base).generate(variables, prompts, lengths, jax.random.key(0))
        # row 0 ends by EOS at its 5th token, row 1 by a stop sequence
        eos, seq = int(ref.tokens[0, 4]), tuple(int(t) for t in ref.tokens[1, 5:7])
        base = SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=eos,
                              stop_sequences=(seq,))
        ref = Sampler(model, base).generate(variables, prompts, lengths, jax.random.key(0))
        assert int(ref.lengths[0]) <= 5 and int(ref.lengths[1]) <= 7
        assert bool(ref.finished[0]) and bool(ref.finished[1])
        assert int(ref.lengths[2]) == G and not bool(ref.finished[2])
        spec = SamplingConfig(**{**base.__dict__, "speculative": "mtp"})
        out = Sampler(model, spec).generate(variables, prompts, lengths, jax.random.key(1))
        for f in ("tokens", "mask", "lengths", "finished", "logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(out, f)),
                                          np.asarray(getattr(ref, f)), f"{name} {f}")
        verified, accepted, iterations = (int(x) for x in out.draft_stats)
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


def _count_prompts():
    """Three counting prompts (drafts mostly right) and one random one, of lengths 6, 4, 5, 3."""
    count = np.asarray(counting_tokens(jax.random.key(9), 3, 6))
    rand = np.asarray(jax.random.randint(jax.random.key(3), (1, 6), 3, 250))
    prompts = np.concatenate([count, rand]).astype(np.int32)
    lengths = np.array([6, 4, 5, 3], np.int32)
    prompts[np.arange(6)[None] >= lengths[:, None]] = 0
    return jnp.asarray(prompts), jnp.asarray(lengths)


def test_commit_after_verifying_k_plus_one_then_decode_equals_plain_decode(trained):
    model, variables = trained
    prompts, lengths = _prompts()
    _, cache, _ = jax.jit(model.prefill)(variables, prompts, lengths, model.init_cache(3, 16))
    fed = jnp.array([[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]], jnp.int32)  # k = 3
    keep = jnp.array([1, 3, 4])  # row b keeps x_n and 0, 2, 3 drafts
    nxt = jnp.array([20, 21, 22], jnp.int32)  # the token after the kept ones
    _, steps, _ = jax.jit(model.verify)(variables, fed, cache)
    lg, got, _ = jax.jit(model.decode_step)(variables, nxt, jax.jit(model.commit)(steps, keep))
    step = jax.jit(model.decode_step)
    plain = cache
    for j in range(4):  # plain decoding of each row's kept tokens
        _, plain, _ = step(variables, fed[:, j], plain, j < keep)
    want, plain, _ = step(variables, nxt, plain)
    np.testing.assert_allclose(lg, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got["lengths"], plain["lengths"])
    for g, w in zip(jax.tree.leaves(got["layers"]), jax.tree.leaves(plain["layers"])):
        if g.shape[1] == 16:  # DSA rows are positional: compare only the committed ones
            for b, n in enumerate(np.asarray(got["lengths"])):
                np.testing.assert_allclose(g[b, :n], w[b, :n], rtol=1e-4, atol=1e-5)
        else:  # KDA state and conv window
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k,G", [(2, 12), (3, 11)])
def test_greedy_k_drafts_equal_plain_greedy(trained, bad_drafts, k, G):
    """Row 0 ends by EOS at its 3rd token (inside the first accepted run for k = 2 and 3), row 1
    by a stop sequence, rows 2-3 at max_new_tokens (G = 12 and 11: the last run is cut)."""
    model, good = trained
    prompts, lengths = _count_prompts()
    first = Sampler(model, SamplingConfig(max_new_tokens=12, temperature=0.0, eos_id=-1)
                    ).generate(good, prompts, lengths, jax.random.key(0))
    eos, stop = int(first.tokens[0, 2]), tuple(int(t) for t in first.tokens[1, 5:7])
    base = SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=eos, stop_sequences=(stop,))
    spec = SamplingConfig(**{**base.__dict__, "speculative": "mtp", "draft_tokens": k})
    rates = {}
    for name, variables in (("good", good), ("bad", bad_drafts)):
        ref = Sampler(model, base).generate(variables, prompts, lengths, jax.random.key(0))
        out = Sampler(model, spec).generate(variables, prompts, lengths, jax.random.key(1))
        for f in ("tokens", "mask", "lengths", "finished", "logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(out, f)),
                                          np.asarray(getattr(ref, f)), f"{name} {f}")
        assert out.draft_stats.shape == (k + 2,)
        rates[name] = draft_summary(out.draft_stats, out.lengths)
        if name == "good":
            assert np.asarray(ref.lengths)[:2].tolist() == [3, 7]
            assert np.asarray(ref.finished).tolist()[:2] == [True, True]
            assert (np.asarray(ref.lengths) == G).any() and not np.asarray(ref.finished).all()
    good_rate, bad_rate = rates["good"]["acceptance"], rates["bad"]["acceptance"]
    # the trained head's drafts are mostly accepted at every position, the noisy head's not
    assert min(good_rate) > 0.5 > bad_rate[0], rates
    assert rates["good"]["passes_per_token"] < 0.7 < rates["bad"]["passes_per_token"], rates


def _always_accept(p, q, draft, rng, greedy):
    """A broken acceptance rule (every draft accepted): the attack the distribution test must
    catch."""
    del p, q, rng, greedy
    return draft, jnp.ones(draft.shape, bool)


def test_sampled_k2_has_the_target_distribution(monkeypatch):
    """Whole completions (4 tokens, top-2 of an 8-token vocabulary: 16 possible sequences) from
    4000 rows of one prompt, against the exact target probabilities from a teacher-forced
    forward over all 8**4 completions: chi-square goodness of fit, and no mass outside the
    support. The same test rejects the samples of a sampler that accepts every draft."""
    from scipy import stats as sps

    cfg = models.get_config("test")
    cfg.vocab_size = 8
    model = Model(ModelConfig.from_dict(cfg))
    variables = model.init(jax.random.key(1))
    N, P, G, V = 4000, 4, 4, 8
    prompt = np.asarray(jax.random.randint(jax.random.key(101), (1, P), 0, V), np.int32)
    scfg = SamplingConfig(max_new_tokens=G, temperature=1.0, top_k=2, eos_id=-1,
                          speculative="mtp", draft_tokens=2)
    # exact target: log p of every completion under the sampling distribution
    seqs = np.stack(np.meshgrid(*[np.arange(V)] * G, indexing="ij"), -1).reshape(-1, G)
    full = jnp.asarray(np.concatenate([np.repeat(prompt, len(seqs), 0), seqs], 1), jnp.int32)
    forward = jax.jit(lambda v, t: model.apply(v, t, with_mtp=False).logits)
    logits = forward(variables, full)[:, P - 1:P - 1 + G]  # [V**G,G,V]
    logp = jnp.take_along_axis(process_logits(logits, scfg), jnp.asarray(seqs)[..., None],
                               -1)[..., 0]
    target = np.exp(np.asarray(jnp.sum(logp, -1), np.float64))  # [V**G]
    assert abs(target.sum() - 1) < 1e-4 and (target > 0).sum() == 2 ** G
    code = seqs @ (V ** np.arange(G)[::-1])  # completion -> index into target

    prompts = jnp.asarray(np.repeat(prompt, N, 0))
    lengths = jnp.full((N,), P, jnp.int32)

    def fit(out):
        toks = np.asarray(out.tokens)
        counts = np.bincount(toks @ (V ** np.arange(G)[::-1]), minlength=V ** G)
        outside = int(counts[target == 0].sum())
        exp = N * target[target > 0]
        obs = counts[target > 0]
        small = exp < 5  # lump rare cells
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
        chi2 = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
        return outside, float(sps.chi2.sf(chi2, len(exp) - 1)), toks

    out = Sampler(model, scfg).generate(variables, prompts, lengths, jax.random.key(3))
    outside, pval, toks = fit(out)
    assert outside == 0 and pval > 1e-4, (outside, pval)
    rate = draft_summary(out.draft_stats, out.lengths)["acceptance"]
    assert min(rate) > 0.05, rate  # both drafts were accepted (and rejected) often
    # the reported log-probs are the target's, token by token
    want = np.asarray(logp)[np.searchsorted(code, toks @ (V ** np.arange(G)[::-1]))]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=2e-4)

    import rl.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "_PROGRAMS", {})  # compile the broken rule afresh
    monkeypatch.setattr(speculative, "verify_draft", _always_accept)
    outside, pval, _ = fit(Sampler(model, scfg).generate(variables, prompts, lengths,
                                                         jax.random.key(3)))
    assert outside > 0 or pval < 1e-6, (outside, pval)


def test_expected_tokens_and_choice_of_k():
    assert expected_tokens_per_pass([0.8, 0.5, 0.5], 0) == 1.0
    assert expected_tokens_per_pass([0.8, 0.5, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    # memory-bound (verify free, cheap drafts): more drafts pay while acceptance stays high
    k, speed = choose_draft_tokens([0.9, 0.9, 0.9], draft_cost=0.05)
    assert k == 3 and speed[0] == 1.0 and speed[3] == pytest.approx(3.439 / 1.15)
    # compute-bound (each verified token costs a pass): no speculation
    assert choose_draft_tokens([0.9, 0.9, 0.9], draft_cost=0.1, verify_cost=1.0)[0] == 0
    # a poor second position stops at k = 1
    assert choose_draft_tokens([0.8, 0.1], draft_cost=0.1)[0] == 1
    with pytest.raises(ValueError, match="measure with draft_tokens >= 3"):
        expected_tokens_per_pass([0.8, 0.5], 3)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        expected_tokens_per_pass([1.5], 1)
    # draft_summary: 10 row-steps, 8 with draft 1 accepted, 4 with both; 3 iterations
    s = draft_summary(np.array([10, 8, 4, 3]), np.array([15, 9]))
    assert s["acceptance"] == [0.8, 0.5] and s["accepted_per_pass"] == 1.2
    assert s["tokens_per_pass"] == 2.2 and s["batch_passes_per_token"] == 3 / 14


def test_step_cost_fit_and_overhead():
    # a fixed overhead per speculative step is paid at every k >= 1, never at k = 0
    k, speed = choose_draft_tokens([1.0, 0.38, 0.26], draft_cost=0.7, step_overhead=0.65)
    assert k == 0 and speed[0] == 1.0
    assert speed[1] == pytest.approx(2.0 / 2.35) and speed[3] == pytest.approx(2.4788 / 3.75)
    # the same acceptance with the overhead folded into a line through k = 3 (the old fit)
    # would speculate at k = 1: the fit is what decides
    assert choose_draft_tokens([1.0, 0.38, 0.26], draft_cost=(3.74 - 1) / 3)[0] == 1
    # the demo checkpoint's measured costs (docs/speed.md): overhead 0.65, 0.70 per draft
    over, per = fit_step_cost([1, 2, 3], [2.34, 3.07, 3.74])
    assert over == pytest.approx(0.65) and per == pytest.approx(0.70)
    # exact on a line; clamped at zero (a noisy negative intercept is no overhead)
    assert fit_step_cost([1, 2], [1.5, 2.0]) == pytest.approx((0.0, 0.5))
    assert fit_step_cost([1, 2], [2.57, 4.23]) == pytest.approx((0.0, 1.66))
    # one point cannot split the two: all of it per draft, as the old fit
    assert fit_step_cost([2], [3.0]) == (0.0, 1.0)
    with pytest.raises(ValueError, match="equal-length"):
        fit_step_cost([1, 2], [2.0])
    with pytest.raises(ValueError, match="each >= 1"):
        fit_step_cost([0, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="step_overhead=-0.1"):
        choose_draft_tokens([0.9], draft_cost=0.1, step_overhead=-0.1)
