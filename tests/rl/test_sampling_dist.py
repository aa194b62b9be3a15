"""The sampling distribution: `rl.sampler.process_logits` against an independent numpy reference,
and the tokens `Sampler.generate` draws against that distribution.

Covered: temperature (0.5 and 2) applied before top-k and top-p; top-k; top-p keeping exactly
the tokens whose probability mass *strictly before* them (in descending order) is below p, at
exact boundaries (dyadic probabilities, so float32 holds the cumulative masses exactly); the
sampler's first-token frequencies (4096 draws per prompt and temperature, fixed seed, top-k and
top-p picked at least 2e-3 away from every cut-off) within a total-variation bound of the
reference distribution and more than twice that bound away from the untempered one, the
reported log-probs equal to the reference's, and no token drawn outside the truncated support.
`argmax_last` / `categorical_last` (the sampler's draw) equal jnp.argmax / jax.random.categorical
index for index: ties, NaN, all -inf rows, 300 keys. Not covered here: greedy decoding, EOS/stop sequences and trainer log-probs
(tests/rl/test_engine.py), speculative sampling (tests/rl/test_speculative.py).
Ties at a top-k / top-p cut-off are avoided (the reference keeps them, as the sampler does).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.sampler import Sampler, SamplingConfig, argmax_last, categorical_last, process_logits

MARGIN = 1e-4  # generic cases keep every decision this far from its threshold (f32 error ~1e-7)


# ----------------------------------------------------------------------------- the draw
def test_argmax_last_is_jnp_argmax():
    x = jax.random.normal(jax.random.key(0), (64, 37))
    rows = jnp.array([[1.0, 3.0, 3.0, 0.0, 3.0],  # ties: the first maximum
                      [-jnp.inf] * 5,  # all -inf: index 0
                      [0.0, jnp.nan, 5.0, jnp.nan, 1.0],  # NaN: the first NaN
                      [jnp.inf, 0.0, jnp.inf, -jnp.inf, 2.0],
                      [-1.0, -2.0, -0.5, -0.5, -jnp.inf]])
    for a in (x, rows, x[:, :1], jnp.round(x * 2)):  # rounding makes many ties
        got, want = jax.jit(argmax_last)(a), jnp.argmax(a, axis=-1)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)


def test_categorical_last_is_jax_categorical():
    logp = jax.nn.log_softmax(3 * jax.random.normal(jax.random.key(1), (8, 50)))
    logp = logp.at[:, 7].set(-jnp.inf)  # truncated support stays out
    keys = jax.random.split(jax.random.key(2), 300)
    draw = jax.jit(jax.vmap(categorical_last, in_axes=(0, None)))
    want = jax.vmap(lambda k: jax.random.categorical(k, logp, axis=-1))(keys)
    got = draw(keys, logp)
    np.testing.assert_array_equal(got, want)
    assert not np.any(np.asarray(got) == 7)
    assert len(np.unique(np.asarray(got))) > 20  # the draws are spread, not one constant


# ----------------------------------------------------------------------------- the reference
def _log_softmax(z):
    z = z - np.max(z)
    return z - np.log(np.sum(np.exp(z)))


def ref_distribution(logits, temperature, top_k=0, top_p=1.0):
    """float64 numpy: logits [B,V] -> (log-probs [B,V] (-inf outside the support), margin).

    Temperature first, then top-k (keep z >= k-th largest), then top-p over the top-k
    renormalised distribution (keep a token iff the mass of the tokens sorted before it is
    < p). margin: the smallest distance of any keep/drop decision from its threshold (the
    relative logit gap at the k-th token, the distance of each mass-before from p)."""
    z = np.asarray(logits, np.float64) / temperature  # [B,V]
    out = np.full_like(z, -np.inf)
    margin = np.inf
    for b, row in enumerate(z):
        keep = np.ones(row.shape, bool)
        if top_k:
            desc = np.sort(row)[::-1]
            keep = row >= desc[top_k - 1]
            if top_k < row.size:
                margin = min(margin, desc[top_k - 1] - desc[top_k])
        if top_p < 1.0:
            order = np.argsort(-np.where(keep, row, -np.inf), kind="stable")
            order = order[keep[order]]
            p = np.exp(_log_softmax(row[order]))
            before = np.cumsum(p) - p  # [n] mass strictly before each token
            margin = min(margin, float(np.min(np.abs(before - top_p))))
            keep = np.zeros(row.shape, bool)
            keep[order[before < top_p]] = True
        out[b, keep] = _log_softmax(row[keep])
    return out, margin


def _assert_same_distribution(got, want, atol=2e-5):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want),
                                  err_msg="the truncated support differs from the reference")
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], atol=atol, rtol=0)


# ----------------------------------------------------------------------------- process_logits
LOGITS = np.random.default_rng(0).normal(0.0, 1.5, (4, 48)).astype(np.float32)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (0, 0.93), (8, 0.8)])
def test_process_logits_matches_numpy(temperature, top_k, top_p):
    want, margin = ref_distribution(LOGITS, temperature, top_k, top_p)
    assert margin > MARGIN, f"test data within {margin:.1e} of a cut-off: change the seed"
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    _assert_same_distribution(process_logits(jnp.asarray(LOGITS), cfg), want)
    # the traced-temperature override (what the compiled sampler uses) agrees
    cfg1 = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    _assert_same_distribution(process_logits(jnp.asarray(LOGITS), cfg1, jnp.float32(temperature)),
                              want)


def test_temperature_is_applied_before_top_p():
    """logits [2, 1, 0, -1], top_p 0.6. At T=2 the tempered probabilities are
    softmax([1, .5, 0, -.5]) = [.43, .26, .16, .10...]: masses before are 0, .43, .69, so two
    tokens stay. Truncating the untempered distribution first (masses 0, .64, ...) keeps one."""
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    cfg = SamplingConfig(temperature=2.0, top_p=0.6)
    p = np.exp(np.asarray(process_logits(logits, cfg), np.float64))[0]
    e = np.exp([1.0, 0.5])
    np.testing.assert_allclose(p, [e[0] / e.sum(), e[1] / e.sum(), 0.0, 0.0], atol=1e-6)
    # and at T=0.5 the sharper distribution keeps only the top token
    p = np.exp(np.asarray(process_logits(logits, SamplingConfig(temperature=0.5, top_p=0.6))))
    np.testing.assert_allclose(p[0], [1.0, 0.0, 0.0, 0.0], atol=1e-6)


LN2 = np.float32(np.log(2.0))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p,n_kept", [(0.5, 1), (0.75, 2), (0.875, 3)])
def test_top_p_exact_boundary(temperature, top_p, n_kept):
    """Probabilities [1/2, 1/4, 1/8, 1/16, 1/16] (after temperature): the masses before each
    token are exactly 0, .5, .75, .875, .9375 in float32, so top_p equal to one of them must
    drop that token (mass before < p keeps a token; <= would keep one more, and its tie)."""
    z = np.array([[0.0, -LN2, -2 * LN2, -3 * LN2, -3 * LN2]], np.float32)  # tempered logits
    probs = np.asarray(jax.nn.softmax(jnp.asarray(z)))
    assert probs.tolist() == [[0.5, 0.25, 0.125, 0.0625, 0.0625]], (
        f"precondition: float32 softmax of the dyadic logits is not exact on this backend "
        f"({probs.tolist()}); the exact-boundary case needs another construction")
    logits = jnp.asarray(z * np.float32(temperature))  # exact: temperature is a power of 2
    got = np.exp(np.asarray(process_logits(logits, SamplingConfig(temperature=temperature,
                                                                  top_p=top_p)), np.float64))[0]
    want = np.zeros(5)
    want[:n_kept] = [0.5, 0.25, 0.125][:n_kept]
    want /= want.sum()
    np.testing.assert_allclose(got, want, atol=1e-7)


# ----------------------------------------------------------------------------- sampling
N_PER_PROMPT = 4096
TEMPERATURES = (0.5, 2.0)
TV_BOUND = 0.045  # expected TV at 4096 draws over <= 16 tokens is ~0.02 (sd ~0.004)


def _pick_truncation(last_logits):
    """(top_k, top_p) in [6, 16] x [0.6, 0.95] whose cut-offs are at least 2e-3 away from every
    token (in tempered logits at the k-th token, in mass-before for top-p), for every prompt and
    temperature, so float32 vs float64 and the prefill-vs-forward logit differences (~1e-5)
    cannot move the support."""
    best, best_margin = None, 0.0
    for k in range(6, 17):
        for p in np.arange(0.60, 0.951, 0.01):
            m = min(ref_distribution(last_logits, t, k, float(p))[1] for t in TEMPERATURES)
            if m > best_margin:
                best, best_margin = (k, float(round(p, 2))), m
    assert best_margin > 2e-3, f"no top-k/top-p with a safe margin for these logits ({best_margin})"
    return best


def test_sampled_tokens_follow_the_processed_distribution(small_lm):
    """Sampler.generate on the 1-layer model of tests/rl/conftest.py (the first new token)."""
    model, variables = small_lm
    prompts = jnp.array([[1, 40, 41, 42], [1, 50, 0, 0]], jnp.int32)  # lengths 4 and 2
    lengths = np.array([4, 2])
    full = jax.jit(lambda v, t: model.apply(v, t, with_mtp=False).logits)(variables, prompts)
    last = np.asarray(full)[np.arange(2), lengths - 1]  # [2,V] logits of the first new token
    top_k, top_p = _pick_truncation(last)

    rows = jnp.repeat(prompts, N_PER_PROMPT, axis=0)  # [2N,4]: N rows per prompt
    row_len = jnp.repeat(jnp.asarray(lengths), N_PER_PROMPT)
    for i, t in enumerate(TEMPERATURES):
        ref, _ = ref_distribution(last, t, top_k, top_p)  # [2,V]
        untempered, _ = ref_distribution(last, 1.0, top_k, top_p)
        # one compiled program for both temperatures (the sampler traces the temperature)
        sampler = Sampler(model, SamplingConfig(max_new_tokens=1, temperature=t, top_k=top_k,
                                                top_p=top_p, eos_id=-1))
        out = sampler.generate(variables, rows, row_len, jax.random.key(100 + i))
        tok = np.asarray(out.tokens[:, 0]).reshape(2, N_PER_PROMPT)
        lp = np.asarray(out.logprobs[:, 0]).reshape(2, N_PER_PROMPT)
        for b in range(2):
            assert np.all(np.isfinite(ref[b, tok[b]])), "a token outside the truncated support"
            np.testing.assert_allclose(lp[b], ref[b, tok[b]], atol=2e-4)
            freq = np.bincount(tok[b], minlength=ref.shape[1]) / N_PER_PROMPT
            tv = 0.5 * np.abs(freq - np.exp(ref[b])).sum()
            assert tv < TV_BOUND, f"T={t} prompt {b}: TV {tv:.3f} to the processed distribution"
            # power: the same draws are far from the distribution without temperature
            wrong = 0.5 * np.abs(freq - np.exp(untempered[b])).sum()
            assert wrong > 2 * TV_BOUND, f"T={t} prompt {b}: test cannot see temperature ({wrong})"
