"""rl.algorithms: presets build and validate against the registries; rl_loss composes the terms."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rl import advantages as adv_lib
from rl import algorithms as algos
from rl import losses

N, L = 4, 5
MASK = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], jnp.float32)
# every preset builds with these (max_len is the generation budget, the cache the DAPO window)
RUN_ARGS = dict(max_len=L, overlong_cache_len=2)


def _batch(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    old = -jax.random.uniform(k[0], (N, L), minval=0.5, maxval=2.0)
    logp = old + 0.1 * jax.random.normal(k[1], (N, L))
    ref = old + 0.1 * jax.random.normal(k[2], (N, L))
    rollout = old + 0.05 * jax.random.normal(k[3], (N, L))
    values = jax.random.normal(k[4], (N, L))
    entropy = jax.random.uniform(k[5], (N, L))
    return dict(logp=logp, old=old, ref=ref, rollout=rollout, values=values, entropy=entropy)


def test_preset_names():
    assert {"ppo", "grpo", "drgrpo", "dapo", "gspo", "rloo"} <= set(algos.PRESETS)
    for name in algos.PRESETS:
        assert algos.describe_algorithm(name)


@pytest.mark.parametrize("name", sorted(algos.PRESETS))
def test_every_preset_end_to_end_finite_with_grad(name):
    cfg = algos.get_algorithm(name, **RUN_ARGS)
    assert cfg.name == name
    b = _batch()
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0])
    ids = jnp.array([5, 5, 2, 2])
    kl = (
        losses.kl_penalty(b["old"], b["ref"], cfg.kl_kind, mask=MASK)
        if cfg.kl_placement == "reward"
        else None
    )
    prep = algos.prepare_advantages(
        cfg, rewards, MASK, group_ids=ids, values=b["values"] if cfg.needs_values else None, kl=kl
    )
    assert prep.advantages.shape == (N, L)
    assert (prep.returns is not None) == cfg.needs_values

    def f(logp, values, loss_fn=algos.rl_loss):
        return loss_fn(
            logp,
            b["old"],
            prep.advantages,
            MASK,
            cfg=cfg,
            ref_logp=b["ref"] if cfg.needs_ref else None,
            entropy=b["entropy"],
            values=values if cfg.needs_values else None,
            old_values=b["values"] if cfg.needs_values else None,
            returns=prep.returns,
        )

    (loss, metrics), (g_logp, g_v) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        b["logp"], b["values"] + 0.1
    )
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    assert np.all(np.isfinite(g_logp)) and np.any(g_logp != 0)
    np.testing.assert_array_equal(np.asarray(g_logp)[np.asarray(MASK) == 0], 0.0)
    if cfg.needs_values:
        assert "vf_loss" in metrics and np.any(g_v != 0)
    np.testing.assert_allclose(metrics["loss"], loss)
    # jit with the config as a static argument (frozen dataclass: hashable)
    jitted = jax.jit(algos.rl_loss, static_argnames=("cfg",))
    np.testing.assert_allclose(f(b["logp"], b["values"] + 0.1, jitted)[0], loss, rtol=1e-5)


def test_run_dependent_fields_are_required():
    with pytest.raises(ValueError, match="max_len"):
        algos.get_algorithm("drgrpo")
    with pytest.raises(ValueError, match="max_len"):
        algos.get_algorithm("dapo", overlong_cache_len=4)
    with pytest.raises(ValueError, match="overlong_cache_len"):
        algos.get_algorithm("dapo", max_len=16)
    with pytest.raises(ValueError, match="overlong_cache_len"):
        algos.get_algorithm("dapo", max_len=16, overlong_cache_len=32)
    cfg = algos.get_algorithm("dapo", max_len=16, overlong_cache_len=4)
    assert cfg.dynamic_sampling and cfg.overlong_shaping and cfg.clip_high == 0.28


def test_validation_errors_name_field_and_valid_values():
    with pytest.raises(ValueError) as e:
        algos.get_algorithm("trpo")
    for name in algos.PRESETS:
        assert repr(name) in str(e.value)
    cases = {
        "agg": "mean",
        "estimator": "vtrace",
        "kl_kind": "k9",
        "kl_placement": "advantage",
        "ratio_level": "chunk",
    }
    registries = {
        "agg": losses.AGGREGATIONS,
        "estimator": adv_lib.ESTIMATORS,
        "kl_kind": losses.KL_ESTIMATORS,
        "kl_placement": algos.KL_PLACEMENTS,
        "ratio_level": losses.RATIO_LEVELS,
    }
    for field, bad in cases.items():
        with pytest.raises(ValueError) as e:
            algos.get_algorithm("grpo", **{field: bad})
        msg = str(e.value)
        assert field in msg and repr(bad) in msg
        for valid in registries[field]:
            assert repr(valid) in msg
    for field, bad in dict(
        clip_c=0.5,
        clip_low=1.0,
        kl_coef=-1.0,
        tis_cap=0.0,
        gamma=1.5,
        std_ddof=2,
        vf_clip=0.0,
        dynamic_sampling=1,
    ).items():
        with pytest.raises(ValueError, match=field):
            algos.get_algorithm("grpo", **{field: bad})
    with pytest.raises(ValueError, match="kl_coef"):
        algos.get_algorithm("dapo", max_len=8, overlong_cache_len=2, kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_hihg"):
        algos.get_algorithm("grpo", clip_hihg=0.3)


def test_validation_reads_the_registries():
    """A newly registered name becomes valid in configs with no other change."""
    name = "test-only-token-sum"
    losses.register_agg(name)(lambda loss_mat, mask, *, max_len, counts: jnp.sum(loss_mat))
    try:
        cfg = algos.get_algorithm("grpo", agg=name)
        b = _batch()
        loss, _ = algos.rl_loss(
            b["logp"], b["old"], jnp.ones((N, 1)), MASK, cfg=cfg, ref_logp=b["ref"]
        )
        assert np.isfinite(float(loss))
    finally:
        del losses.AGGREGATIONS[name], losses.AGGREGATIONS.meta[name]


def test_estimator_hparams_are_config_fields():
    fields = {f.name for f in dataclasses.fields(algos.AlgoConfig)}
    for name, meta in adv_lib.ESTIMATORS.meta.items():
        assert set(meta["hparams"]) <= fields, name
    ppo = algos.get_algorithm("ppo")
    assert ppo.estimator_hparams() == {"gamma": 1.0, "lam": 0.95}


def test_config_dict_round_trip():
    cfg = algos.get_algorithm("gspo", clip_high=5e-4)
    assert algos.algo_from_config(cfg.to_dict()) == cfg
    cd = ml_collections.ConfigDict(
        algos.get_algorithm("dapo", max_len=64, overlong_cache_len=16).to_dict()
    )
    cd.clip_high = 0.3  # as --config.rl.algo.clip_high=0.3 would
    cd.tis_cap = 2.0  # a None field takes a value
    cfg2 = algos.algo_from_config(cd)
    assert cfg2.name == "dapo" and cfg2.clip_high == 0.3 and cfg2.tis_cap == 2.0
    custom = algos.algo_from_config(
        {"name": "mine", "estimator": "rloo", "agg": "seq-mean-token-sum"}
    )
    assert custom.name == "mine" and custom.estimator == "rloo"
    assert cfg.replace(clip_low=0.1).clip_low == 0.1
    with pytest.raises(ValueError, match="clip_c"):
        cfg.replace(clip_c=1.0)


def test_rl_loss_is_the_sum_of_its_terms():
    b = _batch(1)
    cfg = algos.AlgoConfig(
        estimator="gae",
        agg="seq-mean-token-mean",
        clip_c=3.0,
        kl_placement="loss",
        kl_kind="k2",
        kl_coef=0.1,
        entropy_coef=0.01,
        vf_coef=0.5,
        vf_clip=0.2,
    )
    advs = jax.random.normal(jax.random.PRNGKey(3), (N, L))
    returns = b["values"] + 0.3
    loss, m = algos.rl_loss(
        b["logp"],
        b["old"],
        advs,
        MASK,
        cfg=cfg,
        ref_logp=b["ref"],
        entropy=b["entropy"],
        values=b["values"] + 0.1,
        old_values=b["values"],
        returns=returns,
    )
    pg, _ = losses.policy_loss(b["logp"], b["old"], advs, MASK, clip_c=3.0, agg=cfg.agg)
    kl = losses.aggregate(losses.kl_penalty(b["logp"], b["ref"], "k2"), MASK, cfg.agg)
    ent = losses.aggregate(b["entropy"], MASK, cfg.agg)
    vf, _ = losses.value_loss(b["values"] + 0.1, b["values"], returns, MASK, clip=0.2, agg=cfg.agg)
    np.testing.assert_allclose(loss, pg + 0.1 * kl - 0.01 * ent + 0.5 * vf, rtol=1e-5)
    np.testing.assert_allclose(m["kl_loss"], kl, rtol=1e-5)
    np.testing.assert_allclose(m["vf_loss"], vf, rtol=1e-5)


def test_rl_loss_micro_batches_add_up_with_global_counts():
    b = _batch(2)
    advs = jax.random.normal(jax.random.PRNGKey(4), (N, 1))
    for agg in sorted(losses.AGGREGATIONS):
        cfg = algos.get_algorithm("grpo", agg=agg, max_len=L)
        full, _ = algos.rl_loss(b["logp"], b["old"], advs, MASK, cfg=cfg, ref_logp=b["ref"])
        counts = losses.agg_counts(MASK)
        parts = sum(
            algos.rl_loss(
                b["logp"][s],
                b["old"][s],
                advs[s],
                MASK[s],
                cfg=cfg,
                ref_logp=b["ref"][s],
                counts=counts,
            )[0]
            for s in (slice(0, 1), slice(1, 4))
        )
        np.testing.assert_allclose(parts, full, rtol=1e-5, err_msg=agg)


def test_rl_loss_input_errors():
    b = _batch()
    a = jnp.ones((N, 1))
    with pytest.raises(ValueError, match="ref_logp"):
        algos.rl_loss(b["logp"], b["old"], a, MASK, cfg=algos.get_algorithm("grpo"))
    tis = algos.get_algorithm("dapo", max_len=L, overlong_cache_len=2, tis_cap=2.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        algos.rl_loss(b["logp"], b["old"], a, MASK, cfg=tis)
    loss, m = algos.rl_loss(b["logp"], b["old"], a, MASK, cfg=tis, rollout_logp=b["rollout"])
    assert np.isfinite(float(loss)) and float(m["tis_weight_mean"]) != 1.0
    gspo = algos.get_algorithm("gspo")
    with pytest.raises(ValueError, match="tis_cap"):
        algos.rl_loss(b["logp"], b["old"], a, MASK, cfg=gspo, rollout_logp=b["rollout"])
    with pytest.raises(ValueError, match="vf_coef"):
        algos.rl_loss(
            b["logp"],
            b["old"],
            a,
            MASK,
            cfg=gspo,
            values=b["values"],
            old_values=b["values"],
            returns=b["values"],
        )
    with pytest.raises(ValueError, match="entropy"):
        algos.rl_loss(b["logp"], b["old"], a, MASK, cfg=gspo.replace(entropy_coef=0.01))
    # reported without being part of the loss
    _, m = algos.rl_loss(
        b["logp"], b["old"], a, MASK, cfg=gspo, ref_logp=b["ref"], entropy=b["entropy"]
    )
    assert "kl_ref" in m and "entropy" in m and "kl_loss" not in m


def test_prepare_advantages_dapo_and_kl_in_reward():
    ids = jnp.array([0, 0, 1, 1])
    rewards = jnp.array([1.0, 1.0, 1.0, 0.0])  # group 0 all correct: dropped by dynamic sampling
    cfg = algos.get_algorithm("dapo", max_len=L, overlong_cache_len=2)
    prep = algos.prepare_advantages(cfg, rewards, MASK, group_ids=ids)
    np.testing.assert_array_equal(prep.keep, [False, False, True, True])
    # lengths 3, 5, 1, 4; free up to 3 tokens; 4 -> -0.5, 5 -> -1
    shaped = np.array([1.0, 0.0, 1.0, -0.5])
    g1 = shaped[2:] - shaped[2:].mean()
    std = np.sqrt((g1**2).sum() / 1)
    np.testing.assert_allclose(prep.advantages[2:, 0], g1 / (std + 1e-6), rtol=1e-5)
    np.testing.assert_array_equal(prep.advantages[:2], 0.0)
    np.testing.assert_allclose(prep.metrics["keep_frac"], 0.5)
    np.testing.assert_allclose(prep.metrics["overlong_frac"], 0.5)
    with pytest.raises(ValueError, match="group_ids"):
        algos.prepare_advantages(cfg, rewards, MASK)

    rloo = algos.get_algorithm("rloo")
    kl = jnp.full((N, L), 0.1)
    prep = algos.prepare_advantages(rloo, rewards, MASK, group_ids=ids, kl=kl)
    seq = np.asarray(rewards) - 0.05 * 0.1 * np.asarray(MASK).sum(1)  # r - beta sum_t kl
    expected = np.array([seq[0] - seq[1], seq[1] - seq[0], seq[2] - seq[3], seq[3] - seq[2]])
    np.testing.assert_allclose(prep.advantages[:, 0], expected, rtol=1e-5)
    with pytest.raises(ValueError, match="kl"):
        algos.prepare_advantages(rloo, rewards, MASK, group_ids=ids)
    with pytest.raises(ValueError, match="kl"):
        algos.prepare_advantages(algos.get_algorithm("grpo"), rewards, MASK, group_ids=ids, kl=kl)

    ppo = algos.get_algorithm("ppo")
    values = jnp.zeros((N, L))
    prep = algos.prepare_advantages(ppo, rewards, MASK, values=values, kl=kl)
    # lam < 1 but V = 0: A_t = sum_{k} (gamma lam)^k r_{t+k}; last token gets reward - beta kl
    last = np.asarray(rewards) - 1e-3 * 0.1
    np.testing.assert_allclose(prep.advantages[1, 4], last[1], rtol=1e-5)
    np.testing.assert_allclose(prep.advantages[1, 3], -1e-4 + 0.95 * last[1], rtol=1e-4)
    assert prep.returns is not None
