"""rl.advantages against hand computations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import advantages as adv

# ------------------------------------------------------------------ GRPO / Dr.GRPO / RLOO


def test_grpo_one_group_by_hand():
    r = jnp.array([1.0, 0.0, 0.0, 1.0])
    g = jnp.zeros(4, jnp.int32)
    # mean 0.5; deviations +-0.5; sum of squares 1.0
    std1 = math.sqrt(1.0 / 3)  # sample std (ddof 1)
    np.testing.assert_allclose(
        adv.grpo(r, g),
        [0.5 / (std1 + 1e-6), -0.5 / (std1 + 1e-6), -0.5 / (std1 + 1e-6), 0.5 / (std1 + 1e-6)],
        rtol=1e-6,
    )
    # population std = 0.5: advantages +-1
    np.testing.assert_allclose(
        adv.grpo(r, g, std_ddof=0, eps=0.0), [1.0, -1.0, -1.0, 1.0], rtol=1e-6
    )
    # Dr.GRPO: no std division
    np.testing.assert_allclose(
        adv.grpo(r, g, normalize_std=False), [0.5, -0.5, -0.5, 0.5], rtol=1e-6
    )


def test_grpo_groups_out_of_order_and_ragged():
    # ids arbitrary and interleaved; sizes 2 (id 7), 3 (id 3), 1 (id 100)
    ids = jnp.array([7, 3, 7, 100, 3, 3])
    r = jnp.array([1.0, 2.0, 3.0, 5.0, 4.0, 9.0])
    # group 7: {1, 3}: mean 2, sample std sqrt(2); group 3: {2, 4, 9}: mean 5,
    # ssq 9 + 1 + 16 = 26, sample std sqrt(13); group 100: single -> 0
    s7, s3 = math.sqrt(2.0), math.sqrt(13.0)
    expected = [-1 / s7, -3 / s3, 1 / s7, 0.0, -1 / s3, 4 / s3]
    np.testing.assert_allclose(adv.grpo(r, ids, eps=0.0), expected, rtol=1e-6)
    np.testing.assert_allclose(
        adv.grpo(r, ids, normalize_std=False), [-1.0, -3.0, 1.0, 0.0, -1.0, 4.0], rtol=1e-6
    )
    # permuting rows permutes advantages
    perm = np.array([5, 2, 0, 4, 3, 1])
    np.testing.assert_allclose(
        adv.grpo(r[perm], ids[perm], eps=0.0), np.asarray(expected)[perm], rtol=1e-6
    )
    # jit-able (static sizes)
    np.testing.assert_allclose(
        jax.jit(lambda a, b: adv.grpo(a, b, eps=0.0))(r, ids), expected, rtol=1e-6
    )


def test_grpo_valid_rows_excluded():
    ids = jnp.array([0, 0, 0, 0])
    r = jnp.array([1.0, 0.0, jnp.nan, 1.0])  # row 2 is padding with garbage
    a = adv.grpo(r, ids, normalize_std=False, valid=jnp.array([1, 1, 0, 1]))
    m = 2 / 3
    np.testing.assert_allclose(a, [1 - m, -m, 0.0, 1 - m], rtol=1e-6)


def test_rloo_by_hand():
    ids = jnp.array([1, 2, 1, 1, 2, 9])
    r = jnp.array([1.0, 0.0, 0.0, 4.0, 3.0, 7.0])
    # group 1 {1, 0, 4}: 1 - (0+4)/2 = -1, 0 - (1+4)/2 = -2.5, 4 - (1+0)/2 = 3.5
    # group 2 {0, 3}: 0 - 3 = -3, 3 - 0 = 3; group 9 single -> 0
    np.testing.assert_allclose(adv.rloo(r, ids), [-1.0, -3.0, -2.5, 3.5, 3.0, 0.0], rtol=1e-6)
    # = n/(n-1) (r - mean)
    np.testing.assert_allclose(
        adv.rloo(r, ids)[:5],
        np.array([1.5, 2, 1.5, 1.5, 2]) * adv.grpo(r, ids, normalize_std=False)[:5],
        rtol=1e-6,
    )


def test_reinforce_baseline_by_hand():
    ids = jnp.array([0, 0, 1, 1])
    r = jnp.array([1.0, 0.0, 2.0, 2.0])
    # centred: .5, -.5, 0, 0; batch population std sqrt((.25+.25)/4)
    std = math.sqrt(0.5 / 4)
    np.testing.assert_allclose(
        adv.reinforce_baseline(r, ids, eps=0.0), [0.5 / std, -0.5 / std, 0.0, 0.0], rtol=1e-6
    )


# ------------------------------------------------------------------ GAE


def _gae_direct(r, v, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_T = 0."""
    t_len = len(r)
    vv = list(v) + [0.0]
    delta = [r[t] + gamma * vv[t + 1] - vv[t] for t in range(t_len)]
    return np.array(
        [sum((gamma * lam) ** k * delta[t + k] for k in range(t_len - t)) for t in range(t_len)]
    )


@pytest.mark.parametrize(
    "mask",
    [
        np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),  # right padding
        np.array([[1, 0, 1, 1, 0], [1, 1, 0, 0, 1], [0, 1, 0, 1, 0]]),  # holes (tool tokens)
    ],
)
def test_gae_matches_double_sum_on_ragged_mask(mask):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    gamma, lam = 0.9, 0.8
    a, ret = adv.gae(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam
    )
    expected = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        idx = np.nonzero(mask[i])[0]  # time = valid tokens only
        expected[i, idx] = _gae_direct(rewards[i, idx], values[i, idx], gamma, lam)
    np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, (expected + values) * mask, rtol=1e-5, atol=1e-6)


def test_gae_monte_carlo_limit_and_outcome_reward():
    # gamma = lam = 1, reward on the last valid token: A_t = R - V_t
    mask = jnp.array([[1, 1, 1, 0]])
    values = jnp.array([[0.1, 0.2, 0.3, 5.0]])
    r = adv.place_at_last_token(jnp.array([2.0]), mask)
    np.testing.assert_allclose(r, [[0.0, 0.0, 2.0, 0.0]])
    a, ret = adv.gae(r, values, mask)
    np.testing.assert_allclose(a, [[1.9, 1.8, 1.7, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[2.0, 2.0, 2.0, 0.0]], rtol=1e-6)
    # values are constants
    g = jax.grad(lambda v: jnp.sum(adv.gae(r, v, mask)[0]))(values)
    np.testing.assert_array_equal(g, 0.0)


# ------------------------------------------------------------------ DAPO and shaping helpers


def test_dynamic_sampling_mask():
    ids = jnp.array([0, 1, 0, 2, 1, 2, 3])
    r = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    # group 0 all 1 -> drop; group 1 all 0 -> drop; group 2 mixed -> keep; group 3 single -> drop
    np.testing.assert_array_equal(
        adv.dynamic_sampling_mask(r, ids), [False, False, False, True, False, True, False]
    )
    # an invalid row does not make its group mixed, and is itself dropped
    valid = jnp.array([1, 1, 1, 1, 1, 0, 1])
    np.testing.assert_array_equal(adv.dynamic_sampling_mask(r, ids, valid=valid), [False] * 7)


def test_overlong_penalty_boundaries():
    # max_len 20, cache 5: free up to 15 tokens, linear to -1 at 20, -1 beyond
    lengths = jnp.array([0, 15, 16, 18, 20, 21, 100])
    np.testing.assert_allclose(
        adv.overlong_penalty(lengths, max_len=20, cache_len=5),
        [0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0],
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="cache_len"):
        adv.overlong_penalty(lengths, max_len=20, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        adv.overlong_penalty(lengths, max_len=4, cache_len=5)


def test_kl_in_reward_and_whiten():
    tok = jnp.array([[0.0, 1.0, 0.0]])
    kl = jnp.array([[0.5, 0.2, 9.0]])
    np.testing.assert_allclose(
        adv.kl_in_reward(tok, kl, 0.1, mask=jnp.array([[1, 1, 0]])), [[-0.05, 0.98, 0.0]], rtol=1e-6
    )
    x = jnp.array([[1.0, 3.0, 100.0]])
    w = adv.whiten(x, jnp.array([[1, 1, 0]]), eps=0.0)
    np.testing.assert_allclose(w, [[-1.0, 1.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(
        adv.whiten(x, jnp.array([[1, 1, 0]]), shift_mean=False, eps=0.0),
        [[1.0, 3.0, 0.0]],
        rtol=1e-6,
    )


# ------------------------------------------------------------------ registry / uniform call


def test_estimator_registry_uniform_call():
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    r = jnp.array([1.0, 0.0, 0.0, 1.0])
    ids = jnp.array([0, 0, 0, 0])
    assert {"grpo", "drgrpo", "rloo", "gae", "reinforce_baseline"} <= set(adv.ESTIMATORS)
    out = adv.compute_advantages("grpo", r, mask, group_ids=ids, adv_eps=0.0, std_ddof=0)
    assert out.returns is None and out.advantages.shape == (4, 3)
    np.testing.assert_allclose(
        out.advantages, np.array([1.0, -1, -1, 1])[:, None] * mask, rtol=1e-6
    )
    # token rewards reduce to the masked sum for outcome estimators
    tok = adv.place_at_last_token(r, mask)
    np.testing.assert_allclose(
        adv.compute_advantages("drgrpo", tok, mask, group_ids=ids).advantages,
        np.array([0.5, -0.5, -0.5, 0.5])[:, None] * mask,
    )
    # gae with [N] rewards places them on the last token
    v = jnp.zeros((4, 3))
    out = adv.compute_advantages("gae", r, mask, values=v, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(out.advantages, np.array([1.0, 0, 0, 1])[:, None] * mask)
    np.testing.assert_allclose(out.returns, out.advantages)
    # an empty row is padding: excluded from the group stats
    mask_pad = mask.at[2].set(0)
    out = adv.compute_advantages("drgrpo", r, mask_pad, group_ids=ids)
    np.testing.assert_allclose(out.advantages[:, 0], [1 / 3, -2 / 3, 0.0, 1 / 3], rtol=1e-6)


def test_estimator_registry_errors():
    mask = jnp.ones((2, 2))
    r = jnp.zeros(2)
    with pytest.raises(ValueError) as e:
        adv.compute_advantages("ppo", r, mask)
    for name in adv.ESTIMATORS:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="group_ids"):
        adv.compute_advantages("grpo", r, mask)
    with pytest.raises(ValueError, match="values"):
        adv.compute_advantages("gae", r, mask)
    with pytest.raises(ValueError, match="gamma"):
        adv.compute_advantages("grpo", r, mask, group_ids=jnp.zeros(2, jnp.int32), gamma=0.9)
    assert adv.ESTIMATORS.meta["gae"]["hparams"] == ("gamma", "lam")
    assert adv.ESTIMATORS.meta["grpo"]["hparams"] == ("adv_eps", "std_ddof")
