"""rl.losses against hand computations (numpy) on tiny ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import losses

# 3 sequences, L = 4, ragged: lengths 2, 4, 1
MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
LOSS_MAT = np.array(
    [[1.0, 2.0, 99.0, 99.0], [3.0, -1.0, 0.5, 0.5], [4.0, 99.0, 99.0, 99.0]], np.float32
)


def _np_agg(loss, mask, agg, max_len=None):
    lens = mask.sum(1)
    sums = (loss * mask).sum(1)
    s = (lens > 0).sum()
    if agg == "token-mean":
        return sums.sum() / mask.sum()
    if agg == "seq-mean-token-sum":
        return sums.sum() / s
    if agg == "seq-mean-token-mean":
        return (sums[lens > 0] / lens[lens > 0]).sum() / s
    if agg == "seq-mean-token-sum-norm":
        return sums.sum() / (s * max_len)
    raise AssertionError(agg)


# ------------------------------------------------------------------ aggregation


def test_aggregation_registry_is_the_list_of_modes():
    assert sorted(losses.AGGREGATIONS) == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]


@pytest.mark.parametrize("agg", sorted(losses.AGGREGATIONS))
def test_aggregate_matches_numpy_on_ragged_mask(agg):
    got = losses.aggregate(jnp.asarray(LOSS_MAT), jnp.asarray(MASK), agg, max_len=8)
    # by hand: token sums per row 3, 3, 4; lengths 2, 4, 1; 3 sequences, 7 tokens
    expected = {
        "token-mean": 10.0 / 7,
        "seq-mean-token-sum": 10.0 / 3,
        "seq-mean-token-mean": (3 / 2 + 3 / 4 + 4 / 1) / 3,
        "seq-mean-token-sum-norm": 10.0 / (3 * 8),
    }[agg]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got, _np_agg(LOSS_MAT, MASK, agg, 8), rtol=1e-6)


def test_aggregation_gradient_scales():
    """d loss / d l[i,t] is the weight each mode gives a valid token."""
    lens = MASK.sum(1)  # 2, 4, 1
    expected = {
        "token-mean": np.full((3, 4), 1 / 7),
        "seq-mean-token-sum": np.full((3, 4), 1 / 3),
        "seq-mean-token-mean": (1 / (3 * lens))[:, None] * np.ones((3, 4)),
        "seq-mean-token-sum-norm": np.full((3, 4), 1 / (3 * 8)),
    }
    for agg, w in expected.items():
        g = jax.grad(lambda x, a=agg: losses.aggregate(x, jnp.asarray(MASK), a, 8))(
            jnp.asarray(LOSS_MAT)
        )
        np.testing.assert_allclose(g, w * MASK, rtol=1e-6, err_msg=agg)
    # the short sequence's token weighs 4x a long-sequence token under seq-mean-token-mean only
    g = jax.grad(lambda x: losses.aggregate(x, jnp.asarray(MASK), "seq-mean-token-mean"))(
        jnp.asarray(LOSS_MAT)
    )
    np.testing.assert_allclose(g[2, 0] / g[1, 0], 4.0, rtol=1e-6)


def test_empty_rows_do_not_count_as_sequences():
    mask = np.concatenate([MASK, np.zeros((1, 4), np.float32)])
    loss = np.concatenate([LOSS_MAT, np.full((1, 4), 7.0, np.float32)])
    for agg in losses.AGGREGATIONS:
        np.testing.assert_allclose(
            losses.aggregate(jnp.asarray(loss), jnp.asarray(mask), agg, 8),
            losses.aggregate(jnp.asarray(LOSS_MAT), jnp.asarray(MASK), agg, 8),
            rtol=1e-6,
        )


@pytest.mark.parametrize("agg", sorted(losses.AGGREGATIONS))
def test_global_counts_make_micro_batches_add_up(agg):
    counts = losses.agg_counts(jnp.asarray(MASK))
    full = losses.aggregate(jnp.asarray(LOSS_MAT), jnp.asarray(MASK), agg, 8)
    parts = sum(
        losses.aggregate(jnp.asarray(LOSS_MAT[s]), jnp.asarray(MASK[s]), agg, 8, counts=counts)
        for s in (slice(0, 1), slice(1, 3))
    )
    np.testing.assert_allclose(parts, full, rtol=1e-6)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="max_len"):
        losses.aggregate(jnp.asarray(LOSS_MAT), jnp.asarray(MASK), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError) as e:
        losses.aggregate(jnp.asarray(LOSS_MAT), jnp.asarray(MASK), "mean")
    for name in losses.AGGREGATIONS:
        assert repr(name) in str(e.value)


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        losses.register_agg("token-mean")(lambda *a, **k: 0.0)


# ------------------------------------------------------------------ policy loss


def _ppo_case():
    # one row, 6 tokens with chosen ratios and advantage signs
    ratios = np.array([1.5, 1.1, 0.5, 0.9, 0.5, 1.5], np.float32)
    adv = np.array([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], np.float32)
    old = np.full((1, 6), -1.0, np.float32)
    logp = old + np.log(ratios)[None]
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv[None]), ratios, adv


def test_ppo_clip_gradient_zero_outside_clip_region():
    logp, old, adv, ratios, a = _ppo_case()
    mask = jnp.ones((1, 6))
    g = jax.grad(lambda lp: losses.policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0])(
        logp
    )
    g = np.asarray(g)[0]
    # token 0: A>0, r=1.5>1.2 clipped; token 2: A<0, r=0.5<0.8 clipped -> exactly zero
    assert g[0] == 0.0 and g[2] == 0.0
    # inside (or on the unclipped side): d(-A r)/dlogp / T = -A r / 6
    for t in (1, 3, 4, 5):
        np.testing.assert_allclose(g[t], -a[t] * ratios[t] / 6, rtol=1e-5)
        assert g[t] != 0.0
    loss, m = losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    per_tok = [-1.2, -1.1, 0.8, 0.9, -0.5, 1.5]  # max(-A r, -A clip(r))
    np.testing.assert_allclose(loss, np.mean(per_tok), rtol=1e-5)
    np.testing.assert_allclose(m["pg_clipfrac_high"], 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(m["pg_clipfrac_low"], 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-5)
    np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-5)
    np.testing.assert_allclose(m["ratio_mean"], ratios.mean(), rtol=1e-5)
    # approx_kl: k3 of KL(old || new) with r = new/old: (r - 1) - log r
    np.testing.assert_allclose(m["approx_kl"], np.mean(ratios - 1 - np.log(ratios)), rtol=1e-5)


def test_clip_higher_is_asymmetric():
    old = jnp.full((1, 1), -1.0)
    logp = old + jnp.log(1.25)
    adv, mask = jnp.ones((1, 1)), jnp.ones((1, 1))

    def grad(ch):
        return jax.grad(
            lambda lp: losses.policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=ch)[0]
        )(logp)

    assert float(grad(0.2)[0, 0]) == 0.0  # 1.25 > 1.2: clipped
    np.testing.assert_allclose(grad(0.28)[0, 0], -1.25, rtol=1e-5)  # 1.25 < 1.28: live


def test_dual_clip_bounds_negative_advantage_loss():
    old = jnp.full((1, 2), -2.0)
    logp = old + jnp.log(jnp.array([[10.0, 2.0]]))
    adv, mask = jnp.full((1, 2), -1.0), jnp.ones((1, 2))
    f = lambda lp, c: losses.policy_loss(lp, old, adv, mask, clip_c=c)
    loss_plain, _ = f(logp, None)
    loss_dual, m = f(logp, 3.0)
    np.testing.assert_allclose(loss_plain, (10.0 + 2.0) / 2, rtol=1e-5)  # unbounded in r
    np.testing.assert_allclose(loss_dual, (3.0 + 2.0) / 2, rtol=1e-5)  # capped at -A c = 3
    np.testing.assert_allclose(m["pg_clipfrac_dual"], 0.5)
    g = jax.grad(lambda lp: f(lp, 3.0)[0])(logp)
    assert float(g[0, 0]) == 0.0 and float(g[0, 1]) != 0.0
    # dual clip never touches positive advantages
    pos = losses.policy_loss(logp, old, -adv, mask, clip_c=3.0)[0]
    np.testing.assert_allclose(pos, -(1.2 + 1.2) / 2, rtol=1e-5)
    with pytest.raises(ValueError, match="clip_c"):
        f(logp, 0.5)


def test_gspo_sequence_ratio_is_exp_mean_log_ratio():
    rng = np.random.default_rng(0)
    old = rng.normal(-2.0, 0.3, (3, 4)).astype(np.float32)
    logp = old + rng.normal(0.0, 0.2, (3, 4)).astype(np.float32)
    logp_pad = np.where(MASK > 0, logp, -np.inf).astype(np.float32)  # garbage on padding
    lens = MASK.sum(1)
    s = np.exp(((logp - old) * MASK).sum(1) / lens)  # [3] by hand
    adv = -jnp.ones((3, 1))  # loss per token = s_i (wide clip keeps it unclipped)
    kw = dict(ratio_level="sequence", clip_low=0.99, clip_high=100.0, agg="seq-mean-token-mean")
    loss, m = losses.policy_loss(
        jnp.asarray(logp_pad), jnp.asarray(old), adv, jnp.asarray(MASK), **kw
    )
    np.testing.assert_allclose(loss, s.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_max"], s.max(), rtol=1e-5)
    np.testing.assert_allclose(m["ratio_min"], s.min(), rtol=1e-5)
    # token-gradient form == gradient of the sequence objective mean_i s_i(theta)
    g = jax.grad(
        lambda lp: losses.policy_loss(lp, jnp.asarray(old), adv, jnp.asarray(MASK), **kw)[0]
    )(jnp.asarray(logp))
    g_seq = jax.grad(lambda lp: jnp.mean(jnp.exp(jnp.sum((lp - old) * MASK, 1) / lens)))(
        jnp.asarray(logp)
    )
    np.testing.assert_allclose(g, g_seq, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g)[0, :2], s[0] / (2 * 3), rtol=1e-5)
    # all tokens of a sequence share the clip decision: ratio s_0 clipped with a tiny range
    loss_c, mc = losses.policy_loss(
        jnp.asarray(logp),
        jnp.asarray(old),
        adv,
        jnp.asarray(MASK),
        ratio_level="sequence",
        clip_low=1e-4,
        clip_high=1e-4,
    )
    assert np.isfinite(float(loss_c)) and 0.0 <= float(mc["pg_clipfrac_low"]) <= 1.0


def test_tis_weight_capped_and_stop_gradient():
    old = jnp.full((1, 2), -1.0)
    logp = old + jnp.log(jnp.array([[1.1, 0.95]]))
    rollout = old - jnp.log(jnp.array([[0.5, 3.0]]))  # exp(old - rollout) = 0.5, 3.0
    adv, mask = jnp.ones((1, 2)), jnp.ones((1, 2))
    f = lambda lp, ro: losses.policy_loss(lp, old, adv, mask, rollout_logp=ro, tis_cap=2.0)
    loss, m = f(logp, rollout)
    w = np.array([0.5, 2.0])  # min(w, 2)
    np.testing.assert_allclose(loss, np.mean(-w * np.array([1.1, 0.95])), rtol=1e-5)
    np.testing.assert_allclose(m["tis_weight_mean"], 1.25, rtol=1e-6)
    np.testing.assert_allclose(m["tis_weight_max"], 2.0, rtol=1e-6)
    np.testing.assert_allclose(m["tis_capfrac"], 0.5)
    g_ro = jax.grad(lambda ro: f(logp, ro)[0])(rollout)
    np.testing.assert_array_equal(g_ro, 0.0)
    g = jax.grad(lambda lp: f(lp, rollout)[0])(logp)
    np.testing.assert_allclose(g, -w[None] * np.array([[1.1, 0.95]]) / 2, rtol=1e-5)
    with pytest.raises(ValueError, match="tis_cap"):
        losses.policy_loss(logp, old, adv, mask, rollout_logp=rollout)
    _, m0 = losses.policy_loss(logp, old, adv, mask)
    assert float(m0["tis_weight_mean"]) == 1.0 and float(m0["tis_capfrac"]) == 0.0


def test_padding_garbage_is_harmless_and_advantage_shapes():
    logp = jnp.where(MASK > 0, -1.0, -jnp.inf)
    old = jnp.where(MASK > 0, -1.1, jnp.nan)
    for adv in (jnp.ones((3, 1)), jnp.ones((3,)), jnp.ones((3, 4))):
        loss, m = losses.policy_loss(logp, old, adv, jnp.asarray(MASK))
        g = jax.grad(lambda lp, a=adv: losses.policy_loss(lp, old, a, jnp.asarray(MASK))[0])(logp)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(g))
        assert np.all(np.asarray(g)[MASK == 0] == 0)
        assert all(np.isfinite(float(v)) for v in m.values())
    with pytest.raises(ValueError, match="advantages"):
        losses.policy_loss(logp, old, jnp.ones((3, 2)), jnp.asarray(MASK))
    with pytest.raises(ValueError) as e:
        losses.policy_loss(logp, old, jnp.ones((3, 1)), jnp.asarray(MASK), ratio_level="seq")
    assert "'sequence'" in str(e.value) and "'token'" in str(e.value)


def test_policy_loss_jits():
    f = jax.jit(lambda lp, o, a, m: losses.policy_loss(lp, o, a, m, clip_high=0.28, clip_c=3.0))
    loss, _ = f(jnp.full((3, 4), -1.0), jnp.full((3, 4), -1.0), jnp.ones((3, 1)), jnp.asarray(MASK))
    np.testing.assert_allclose(loss, -1.0, rtol=1e-6)  # r = 1 everywhere: loss = -mean(A)


# ------------------------------------------------------------------ KL


P = np.array([0.5, 0.3, 0.15, 0.05])
Q = np.array([0.25, 0.25, 0.25, 0.25])


def _expect(kind, logits, logq):
    """E_{x ~ p}[k(x)] computed exactly over the categorical, p = softmax(logits) held fixed."""
    logp = jax.nn.log_softmax(logits)
    k = losses.kl_penalty(logp[None], logq[None], kind)[0]
    return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * k)


def test_kl_estimators_expectations_closed_form():
    logits, logq = jnp.log(jnp.asarray(P)), jnp.log(jnp.asarray(Q))
    kl_pq = np.sum(P * np.log(P / Q))
    np.testing.assert_allclose(_expect("k1", logits, logq), kl_pq, rtol=1e-5)
    np.testing.assert_allclose(_expect("k3", logits, logq), kl_pq, rtol=1e-5)
    np.testing.assert_allclose(_expect("low_var_kl", logits, logq), kl_pq, rtol=1e-5)
    np.testing.assert_allclose(
        _expect("k2", logits, logq), 0.5 * np.sum(P * np.log(P / Q) ** 2), rtol=1e-5
    )
    # per-sample values and signs
    x = np.log(Q / P)  # log r
    k = {
        kind: np.asarray(losses.kl_penalty(jnp.log(P)[None], jnp.log(Q)[None], kind))[0]
        for kind in ("k1", "k2", "k3")
    }
    np.testing.assert_allclose(k["k1"], -x, rtol=1e-5)
    np.testing.assert_allclose(k["k2"], 0.5 * x**2, rtol=1e-5)
    np.testing.assert_allclose(k["k3"], np.exp(x) - 1 - x, rtol=1e-5)
    assert np.any(k["k1"] < 0) and np.all(k["k3"] >= 0) and np.all(k["k2"] >= 0)


def test_kl_estimators_gradients_as_losses():
    logits, logq = jnp.log(jnp.asarray(P)), jnp.log(jnp.asarray(Q))

    def kl(a, b):
        return jnp.sum(a * (jnp.log(a) - jnp.log(b)))

    g_rev = jax.grad(lambda z: kl(jax.nn.softmax(z), jnp.asarray(Q)))(logits)
    g_fwd = jax.grad(lambda z: kl(jnp.asarray(Q), jax.nn.softmax(z)))(logits)
    g = {
        kind: jax.grad(lambda z, k=kind: _expect(k, z, logq))(logits) for kind in ("k1", "k2", "k3")
    }
    np.testing.assert_allclose(g["k1"], 0.0, atol=1e-6)
    np.testing.assert_allclose(g["k2"], g_rev, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g["k3"], g_fwd, rtol=1e-4, atol=1e-6)
    # ref_logp is a constant
    gq = jax.grad(lambda q: jnp.sum(losses.kl_penalty(logits[None], q[None], "k3")))(logq)
    np.testing.assert_array_equal(gq, 0.0)


def test_kl_mask_low_var_cap_and_errors():
    logp = jnp.array([[-1.0, -30.0, -jnp.inf]])
    ref = jnp.array([[-1.0, -1.0, -1.0]])
    kl = losses.kl_penalty(logp, ref, "low_var_kl", mask=jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose(kl, [[0.0, 10.0, 0.0]], atol=1e-6)
    with pytest.raises(ValueError) as e:
        losses.kl_penalty(logp, ref, "k4")
    for name in ("'k1'", "'k2'", "'k3'", "'low_var_kl'"):
        assert name in str(e.value)


# ------------------------------------------------------------------ entropy, value loss


def test_entropy_from_logits():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 4, 5)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = -(p * np.log(p)).sum(-1) * MASK
    got = losses.entropy_from_logits(jnp.asarray(logits), jnp.asarray(MASK))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    uniform = losses.entropy_from_logits(jnp.zeros((1, 1, 5)), jnp.ones((1, 1)))
    np.testing.assert_allclose(uniform, np.log(5.0), rtol=1e-6)


def test_value_loss_clipping():
    values = jnp.array([[1.0, 0.5, 0.0]])
    old = jnp.array([[0.0, 0.4, 0.0]])
    ret = jnp.array([[0.0, 1.0, 9.0]])
    mask = jnp.array([[1, 1, 0]])
    loss, m = losses.value_loss(values, old, ret, mask, clip=0.2, agg="token-mean")
    # token 0: v=1, v_clip=0.2, R=0 -> max(1, .04) = 1 (unclipped side)
    # token 1: v=.5, v_clip=.5 (inside), R=1 -> .25
    np.testing.assert_allclose(loss, 0.5 * (1.0 + 0.25) / 2, rtol=1e-6)
    values2 = jnp.array([[-1.0, 0.5, 0.0]])  # token 0: v=-1, v_clip=-0.2; R=0 -> max(1, .04)
    ret2 = jnp.array([[-0.5, 1.0, 0.0]])  # v moved past R: (v-R)^2=.25, (v_clip-R)^2=.09
    l2, m2 = losses.value_loss(values2, old, ret2, mask, clip=0.2)
    np.testing.assert_allclose(l2, 0.5 * (0.25 + 0.25) / 2, rtol=1e-6)
    np.testing.assert_allclose(m2["vf_clipfrac"], 0.0)
    ret3 = jnp.array([[-0.1, 1.0, 0.0]])  # (v-R)^2 = .81, (v_clip-R)^2 = .01: unclipped larger
    g = jax.grad(lambda v: losses.value_loss(v, old, ret3, mask, clip=0.2)[0])(values2)
    np.testing.assert_allclose(
        g, [[0.5 * 2 * (-1.0 + 0.1) / 2, 0.5 * 2 * (0.5 - 1.0) / 2, 0.0]], rtol=1e-6
    )
    ret4 = jnp.array([[-2.0, 1.0, 0.0]])  # v=-1 clipped to -0.2: (v_clip-R)^2 = 3.24 > 1
    g4 = jax.grad(lambda v: losses.value_loss(v, old, ret4, mask, clip=0.2)[0])(values2)
    assert float(g4[0, 0]) == 0.0
    _, m4 = losses.value_loss(values2, old, ret4, mask, clip=0.2)
    np.testing.assert_allclose(m4["vf_clipfrac"], 0.5)
    l_noclip, _ = losses.value_loss(values, old, ret, mask)
    np.testing.assert_allclose(l_noclip, 0.5 * (1.0 + 0.25) / 2, rtol=1e-6)
    assert np.isfinite(float(m["vf_explained_var"]))
