"""Named RL algorithms as presets of the pieces in ``rl.losses`` and ``rl.advantages``.

An algorithm is data, not a learner class: ``AlgoConfig`` (a frozen, hashable dataclass, usable as
a static argument of ``jax.jit``) names an advantage estimator, the policy-loss variant, the
reduction, where the KL to the reference goes, and the DAPO switches. Two pure functions consume
it:

  prepare_advantages(cfg, rewards, mask, ...)  rewards -> shaped rewards -> advantages, keep mask
                                               (pipeline side, after scoring)
  rl_loss(logp, old_logp, advantages, mask, cfg=cfg, ...)  the scalar the train step differentiates

Presets (``PRESETS``, see each ``_preset_*`` docstring): "ppo", "grpo", "drgrpo", "dapo", "gspo",
"rloo". ``get_algorithm(name, **overrides)`` builds one; every field is validated against the
registries (names) and ranges, and errors name the field and the valid values.

Run-dependent values have no default: ``max_len`` (the generation budget in tokens) is required by
Dr.GRPO's constant normaliser and by DAPO's overlong shaping, ``overlong_cache_len`` by the latter.

ml_collections: ``cfg.to_dict()`` -> ``ConfigDict(...)`` in a config file, overridable with
``--config.rl.algo.clip_high=0.28``; ``algo_from_config(config_dict)`` builds it back (a "name" key
selects the preset the other keys override).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl import advantages as adv_lib
from rl import losses
from rl.losses import Registry

Array = jax.Array

# Where the KL(pi || ref) term goes. Values are descriptions; the keys are the valid names.
KL_PLACEMENTS = Registry("kl placement")
KL_PLACEMENTS.register("none", "no KL to the reference policy (no reference forward needed)")
KL_PLACEMENTS.register(
    "loss", "kl_coef * aggregate(kl_penalty(logp, ref_logp, kl_kind)) is added to the loss (GRPO)"
)
KL_PLACEMENTS.register(
    "reward",
    "-kl_coef * kl_penalty(old_logp, ref_logp, kl_kind) is added to token rewards before the "
    "estimator (PPO-RLHF, RLOO)",
)

PRESETS = Registry("algorithm")


def register_preset(name: str):
    """Registers a preset: a function returning the AlgoConfig fields that differ from the
    defaults. Its docstring documents the algorithm (``describe_algorithm``)."""

    def deco(fn):
        PRESETS.register(name, fn)
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _bad(field: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"AlgoConfig.{field}={value!r}: expected {expected}")


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """One RL algorithm. Validated on construction (``__post_init__``).

    Advantages (``rl.advantages``)
      estimator: a name in ESTIMATORS ("grpo", "drgrpo", "rloo", "reinforce_baseline", "gae").
      gamma, lam: GAE discount and lambda (gae only).
      adv_eps: added to the std (grpo, reinforce_baseline).
      std_ddof: GRPO std's delta degrees of freedom (1 = torch.std, 0 = population).
    Policy loss (``rl.losses.policy_loss``)
      clip_low, clip_high: ratio clip range [1 - clip_low, 1 + clip_high].
      clip_c: dual-clip constant (> 1) for negative advantages, or None.
      ratio_level: "token" (PPO) or "sequence" (GSPO).
      agg: the reduction of every per-token loss term (policy, KL, entropy, value): a name in
        AGGREGATIONS.
      max_len: generation budget in tokens; required by agg "seq-mean-token-sum-norm" and by
        overlong shaping, otherwise unused.
      tis_cap: truncated-IS cap against the sampler's log-probs (then rl_loss needs rollout_logp),
        or None (no TIS).
    KL to the reference
      kl_placement: "none" | "loss" | "reward" (KL_PLACEMENTS); kl_kind: a name in KL_ESTIMATORS;
      kl_coef: beta >= 0 (must be 0 when kl_placement is "none").
    Other loss terms
      entropy_coef: >= 0, loss -= entropy_coef * aggregate(entropy).
      vf_coef: >= 0, loss += vf_coef * value_loss (when values are passed to rl_loss).
      vf_clip: PPO value clip (absolute), or None.
    DAPO
      dynamic_sampling: drop groups whose raw rewards are all equal (prepare_advantages' keep).
        The refill half of DAPO's dynamic sampling (drawing more prompts so that the batch
        holds groups that carry a signal) is a run setting: rl.oversample (configs/rl.py,
        rl/pipeline.py:select_groups).
      overlong_shaping: add overlong_penalty(length; max_len, overlong_cache_len) to the reward.
      overlong_cache_len: the soft window in tokens (DAPO used 4096 of 20480); required by
        overlong_shaping, otherwise unused (like max_len, a run parameter any preset accepts).
    """

    name: str = "custom"
    estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    adv_eps: float = 1e-6
    std_ddof: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = None
    ratio_level: str = "token"
    agg: str = "token-mean"
    max_len: int | None = None
    tis_cap: float | None = None
    kl_placement: str = "none"
    kl_kind: str = "k3"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    vf_coef: float = 0.0
    vf_clip: float | None = None
    dynamic_sampling: bool = False
    overlong_shaping: bool = False
    overlong_cache_len: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise _bad("name", self.name, "a string")
        adv_lib.ESTIMATORS.validate(self.estimator, field="AlgoConfig.estimator")
        losses.AGGREGATIONS.validate(self.agg, field="AlgoConfig.agg")
        losses.RATIO_LEVELS.validate(self.ratio_level, field="AlgoConfig.ratio_level")
        losses.KL_ESTIMATORS.validate(self.kl_kind, field="AlgoConfig.kl_kind")
        KL_PLACEMENTS.validate(self.kl_placement, field="AlgoConfig.kl_placement")

        if self.max_len is not None and not (_is_real(self.max_len) and self.max_len > 0):
            raise _bad("max_len", self.max_len, "a positive number of tokens or None")
        losses.check_max_len(self.agg, self.max_len, field="AlgoConfig.max_len")

        for f in ("gamma", "lam"):
            v = getattr(self, f)
            if not (_is_real(v) and 0.0 <= v <= 1.0):
                raise _bad(f, v, "a number in [0, 1]")
        if not (_is_real(self.adv_eps) and self.adv_eps >= 0):
            raise _bad("adv_eps", self.adv_eps, "a number >= 0")
        if self.std_ddof not in (0, 1) or isinstance(self.std_ddof, bool):
            raise _bad("std_ddof", self.std_ddof, "0 or 1")
        if not (_is_real(self.clip_low) and 0.0 <= self.clip_low < 1.0):
            raise _bad("clip_low", self.clip_low, "a number in [0, 1)")
        if not (_is_real(self.clip_high) and self.clip_high >= 0.0):
            raise _bad("clip_high", self.clip_high, "a number >= 0")
        if self.clip_c is not None and not (_is_real(self.clip_c) and self.clip_c > 1.0):
            raise _bad("clip_c", self.clip_c, "None or a number > 1 (dual clip)")
        if self.tis_cap is not None and not (_is_real(self.tis_cap) and self.tis_cap > 0):
            raise _bad("tis_cap", self.tis_cap, "None or a number > 0")
        for f in ("kl_coef", "entropy_coef", "vf_coef"):
            v = getattr(self, f)
            if not (_is_real(v) and v >= 0):
                raise _bad(f, v, "a number >= 0")
        if self.kl_placement == "none" and self.kl_coef != 0:
            raise _bad(
                "kl_coef", self.kl_coef, "0 when kl_placement='none' (choose 'loss' or 'reward')"
            )
        if self.vf_clip is not None and not (_is_real(self.vf_clip) and self.vf_clip > 0):
            raise _bad("vf_clip", self.vf_clip, "None or a number > 0")
        for f in ("dynamic_sampling", "overlong_shaping"):
            if not isinstance(getattr(self, f), bool):
                raise _bad(f, getattr(self, f), "a bool")
        if self.overlong_shaping:
            if not _is_int(self.max_len):
                raise _bad(
                    "max_len", self.max_len, "an int (tokens): overlong_shaping needs the budget"
                )
            c = self.overlong_cache_len
            if not (_is_int(c) and 0 < c <= self.max_len):
                raise _bad(
                    "overlong_cache_len",
                    c,
                    f"an int in (0, max_len={self.max_len}] when overlong_shaping (DAPO: max_len // 5)",
                )
        elif self.overlong_cache_len is not None and not (
            _is_int(self.overlong_cache_len) and self.overlong_cache_len > 0
        ):
            raise _bad("overlong_cache_len", self.overlong_cache_len, "None or a positive int")

        missing = [h for h in self.estimator_hparam_names() if h not in _FIELD_NAMES]
        if missing:  # an estimator registered a hyper-parameter AlgoConfig cannot provide
            raise ValueError(
                f"estimator {self.estimator!r} hyper-parameters {missing} are not AlgoConfig fields"
            )

    # -- derived --------------------------------------------------------------------------

    def estimator_hparam_names(self) -> tuple[str, ...]:
        return adv_lib.ESTIMATORS.meta[self.estimator]["hparams"]

    def estimator_hparams(self) -> dict[str, Any]:
        """The estimator's keyword hyper-parameters, read from the fields of the same names."""
        return {h: getattr(self, h) for h in self.estimator_hparam_names()}

    @property
    def needs_ref(self) -> bool:
        """Whether a reference-policy forward is needed (KL in loss or reward)."""
        return self.kl_placement != "none"

    @property
    def needs_values(self) -> bool:
        """Whether the estimator needs a critic's values."""
        return adv_lib.ESTIMATORS.meta[self.estimator]["needs_values"]

    @property
    def needs_groups(self) -> bool:
        return adv_lib.ESTIMATORS.meta[self.estimator]["needs_groups"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **overrides: Any) -> AlgoConfig:
        _check_fields(overrides)
        return dataclasses.replace(self, **overrides)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AlgoConfig))


def _check_fields(d: Mapping[str, Any]) -> None:
    unknown = sorted(set(d) - set(_FIELD_NAMES))
    if unknown:
        raise ValueError(f"unknown AlgoConfig fields {unknown}; valid fields: {list(_FIELD_NAMES)}")


def get_algorithm(name: str, **overrides: Any) -> AlgoConfig:
    """The preset ``name`` with ``overrides`` applied, validated (cfg.name is the preset name
    unless overridden)."""
    preset = PRESETS.lookup(name, field="algorithm")
    _check_fields(overrides)
    fields = {"name": name, **preset(), **overrides}
    return AlgoConfig(**fields)


# Fields that make one choice together: when a preset switch keeps one of them (because the
# config chose it), it keeps the others too (e.g. KL in the loss with k3 at 0.05).
_FIELD_GROUPS = (("kl_placement", "kl_kind", "kl_coef"),)


def preset_fields(name: str) -> dict[str, Any]:
    """Every AlgoConfig field of preset ``name`` (defaults + the preset's own values), unvalidated
    (run-dependent fields such as max_len may still be None)."""
    d = {f.name: f.default for f in dataclasses.fields(AlgoConfig)}
    d.update(PRESETS.lookup(name, field="algorithm")())
    d["name"] = name
    return d


def algo_from_config(config: Mapping[str, Any]) -> AlgoConfig:
    """From a dict / ml_collections.ConfigDict: ``name`` (a preset, or anything else for a fully
    specified custom config) plus fields overriding it. Inverse of ``AlgoConfig.to_dict``.

    A config that lists every field (configs/rl.py does, so each is overridable by a flag) says
    which preset filled them in ``filled_from``. When ``name`` names another preset (e.g.
    ``--config.rl.algo.name=dapo`` on a GRPO config), fields still equal to the filling preset's
    value follow the new preset; fields that differ from it (the config's run choices and your
    overrides) are kept, the KL fields (placement, kind, coefficient) as one choice."""
    d = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    name = d.pop("name", "custom")
    filled_from = d.pop("filled_from", None)
    if filled_from is not None and filled_from != name:
        if name not in PRESETS:
            raise ValueError(f"rl.algo.name={name!r} is not a preset ({sorted(PRESETS)}) but the "
                             f"other fields were filled from preset {filled_from!r}: give a "
                             "preset name, or write every field and drop filled_from")
        base = preset_fields(filled_from)
        chosen = {k for k, v in d.items() if k not in base or v != base[k]}
        for group in _FIELD_GROUPS:  # one choice: keep all of a group or none
            if chosen & set(group):
                chosen |= set(group) & set(d)
        d = {k: d[k] for k in chosen}
    if name in PRESETS:
        return get_algorithm(name, **d)
    _check_fields(d)
    return AlgoConfig(name=name, **d)


def describe_algorithm(name: str) -> str:
    return (PRESETS.lookup(name, field="algorithm").__doc__ or "").strip()


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------


@register_preset("ppo")
def _preset_ppo():
    """PPO with a critic (RLHF style, e.g. verl's defaults): GAE(gamma=1, lam=0.95) on token
    rewards, clip 0.2, token-mean, k1 KL folded into the reward (beta 1e-3), value loss with
    coefficient 0.5 and value clip 0.2. The value loss is added when rl_loss is given values."""
    return dict(
        estimator="gae",
        gamma=1.0,
        lam=0.95,
        clip_low=0.2,
        clip_high=0.2,
        agg="token-mean",
        kl_placement="reward",
        kl_kind="k1",
        kl_coef=1e-3,
        vf_coef=0.5,
        vf_clip=0.2,
    )


@register_preset("grpo")
def _preset_grpo():
    """GRPO (DeepSeekMath): group-normalised outcome advantages (sample std), clip 0.2, per
    sequence token-mean then mean over sequences, k3 KL in the loss with beta 0.04."""
    return dict(
        estimator="grpo",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-mean",
        kl_placement="loss",
        kl_kind="k3",
        kl_coef=0.04,
    )


@register_preset("drgrpo")
def _preset_drgrpo():
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std normalisation,
    token sums divided by the constant generation budget (max_len, required), no KL, clip 0.2."""
    return dict(
        estimator="drgrpo",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-sum-norm",
        kl_placement="none",
        kl_coef=0.0,
    )


@register_preset("dapo")
def _preset_dapo():
    """DAPO (Yu et al. 2025): GRPO advantages, clip-higher (0.2 / 0.28), token-level loss
    (token-mean), no KL, dynamic sampling, soft overlong shaping (max_len and overlong_cache_len
    required; the paper used 20480 and 4096)."""
    return dict(
        estimator="grpo",
        clip_low=0.2,
        clip_high=0.28,
        agg="token-mean",
        kl_placement="none",
        kl_coef=0.0,
        dynamic_sampling=True,
        overlong_shaping=True,
    )


@register_preset("gspo")
def _preset_gspo():
    """GSPO (Zheng et al. 2025): sequence-level length-normalised ratio (token-gradient form),
    clip 3e-4 / 4e-4, seq-mean-token-mean, GRPO advantages, no KL."""
    return dict(
        estimator="grpo",
        ratio_level="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
        agg="seq-mean-token-mean",
        kl_placement="none",
        kl_coef=0.0,
    )


@register_preset("rloo")
def _preset_rloo():
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, sequence-level REINFORCE reduction
    (seq-mean-token-sum) with PPO clip 0.2 for off-policy steps, k1 KL folded into the reward
    (a sequence-level penalty, beta 0.05 as TRL's RLOOTrainer)."""
    return dict(
        estimator="rloo",
        clip_low=0.2,
        clip_high=0.2,
        agg="seq-mean-token-sum",
        kl_placement="reward",
        kl_kind="k1",
        kl_coef=0.05,
    )


# --------------------------------------------------------------------------------------------
# Pipeline side: rewards -> advantages
# --------------------------------------------------------------------------------------------


class PreparedAdvantages(NamedTuple):
    advantages: Array  # [N, L], zero where masked
    returns: Array | None  # [N, L] value targets (gae) or None
    keep: Array  # [N] bool: rows to train on (dynamic sampling, non-empty rows)
    metrics: dict[str, Array]


def prepare_advantages(
    cfg: AlgoConfig,
    rewards: Array,
    mask: Array,
    *,
    group_ids: Array | None = None,
    values: Array | None = None,
    kl: Array | None = None,
    lengths: Array | None = None,
) -> PreparedAdvantages:
    """Rewards -> advantages as ``cfg`` says, in order:

    1. keep = rows with a valid token, and (cfg.dynamic_sampling) not in a group whose *raw*
       rewards are all equal (DAPO filters on accuracy, before any shaping).
    2. cfg.overlong_shaping: reward += overlong_penalty(lengths; cfg.max_len,
       cfg.overlong_cache_len); lengths default to mask.sum(-1) (pass the generated length if the
       mask has holes).
    3. cfg.kl_placement == "reward": token rewards = place_at_last_token(reward) - kl_coef * kl;
       ``kl`` [N, L] is required (kl_penalty(old_logp, ref_logp, cfg.kl_kind)); otherwise passing
       kl is an error (it would be ignored).
    4. compute_advantages(cfg.estimator, ..., **cfg.estimator_hparams()).

    rewards: [N] outcome rewards, or [N, L] token rewards (shaping then lands on the last token).
    Dropped rows (keep False) are masked out of the estimator: they enter no statistic and get
    advantage 0; the pipeline drops them (or zeroes their loss mask) and refills the batch.
    Metrics: reward_mean (raw), reward_shaped_mean, overlong_frac (penalised rows), keep_frac,
    adv_mean, adv_abs_mean (masked token means over kept rows).
    """
    m = jnp.asarray(mask) != 0
    mf = m.astype(jnp.float32)
    r = jnp.asarray(rewards, jnp.float32)
    tokenwise = r.ndim == 2
    seq_r = jnp.sum(jnp.where(m, r, 0.0), -1) if tokenwise else r
    row_valid = jnp.any(m, -1)

    if cfg.dynamic_sampling:
        if group_ids is None:
            raise ValueError("dynamic_sampling needs group_ids")
        keep = adv_lib.dynamic_sampling_mask(seq_r, group_ids, valid=row_valid)
    else:
        keep = row_valid

    shaped = r
    overlong = jnp.zeros_like(seq_r)
    if cfg.overlong_shaping:
        n_tok = jnp.sum(mf, -1) if lengths is None else jnp.asarray(lengths)
        overlong = adv_lib.overlong_penalty(
            n_tok, max_len=cfg.max_len, cache_len=cfg.overlong_cache_len
        )
        shaped = shaped + (adv_lib.place_at_last_token(overlong, m) if tokenwise else overlong)

    if cfg.kl_placement == "reward":
        if kl is None:
            raise ValueError(
                "kl_placement='reward' needs kl [N, L] (kl_penalty of old vs ref logp)"
            )
        tok = shaped if shaped.ndim == 2 else adv_lib.place_at_last_token(shaped, m)
        shaped = adv_lib.kl_in_reward(tok, kl, cfg.kl_coef, mask=m)
    elif kl is not None:
        raise ValueError(f"kl passed but cfg.kl_placement={cfg.kl_placement!r} (not 'reward')")

    # dropped rows are masked out of the estimator: no statistics (e.g. a batch std), advantage 0
    out = adv_lib.compute_advantages(
        cfg.estimator,
        shaped,
        m & keep[:, None],
        group_ids=group_ids,
        values=values,
        **cfg.estimator_hparams(),
    )
    km = mf * keep[:, None]
    n_valid = jnp.maximum(jnp.sum(row_valid), 1)
    shaped_seq = jnp.sum(jnp.where(m, shaped, 0.0), -1) if shaped.ndim == 2 else shaped
    metrics = {
        "reward_mean": jnp.sum(jnp.where(row_valid, seq_r, 0.0)) / n_valid,
        "reward_shaped_mean": jnp.sum(jnp.where(row_valid, shaped_seq, 0.0)) / n_valid,
        "overlong_frac": jnp.sum(row_valid & (overlong < 0)) / n_valid,
        "keep_frac": jnp.sum(keep) / n_valid,
        "adv_mean": jnp.sum(out.advantages * km) / jnp.maximum(jnp.sum(km), 1.0),
        "adv_abs_mean": jnp.sum(jnp.abs(out.advantages) * km) / jnp.maximum(jnp.sum(km), 1.0),
    }
    return PreparedAdvantages(out.advantages, out.returns, keep, metrics)


# --------------------------------------------------------------------------------------------
# Train side: the loss
# --------------------------------------------------------------------------------------------


def rl_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    cfg: AlgoConfig,
    ref_logp: Array | None = None,
    entropy: Array | None = None,
    values: Array | None = None,
    old_values: Array | None = None,
    returns: Array | None = None,
    rollout_logp: Array | None = None,
    counts: losses.AggCounts | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The scalar loss of one (micro-)batch: what the train step differentiates.

      loss = policy_loss(logp, old_logp, advantages, mask; cfg clip/ratio/agg/TIS)
           + cfg.kl_coef * aggregate(kl_penalty(logp, ref_logp, cfg.kl_kind))   if kl in "loss"
           - cfg.entropy_coef * aggregate(entropy)                              if entropy_coef > 0
           + cfg.vf_coef * value_loss(values, old_values, returns; cfg.vf_clip) if values given
    Every term uses the reduction cfg.agg (with cfg.max_len) and the same ``counts`` (batch-local
    by default; pass ``losses.agg_counts(full_batch_mask)`` when accumulating micro-batches).

    Inputs, all [N, L] (advantages may be [N, 1]): logp differentiable (model output); entropy
    per token (``losses.entropy_from_logits``) differentiable; values differentiable; the rest are
    constants. Required: ref_logp when kl is in the loss with kl_coef > 0; entropy when
    entropy_coef > 0; rollout_logp iff cfg.tis_cap is set; old_values and returns with values
    (values need cfg.vf_coef > 0). Passing an input the config would ignore raises, except ref_logp
    and entropy, which are then only reported (kl_ref, entropy metrics).

    Metrics: those of policy_loss and value_loss, plus kl_ref (masked token mean of the cfg.kl_kind
    estimate), kl_loss, entropy, loss.
    """
    sg = jax.lax.stop_gradient
    if cfg.tis_cap is not None and rollout_logp is None:
        raise ValueError(f"cfg.tis_cap={cfg.tis_cap} needs rollout_logp (the sampler's log-probs)")
    if cfg.tis_cap is None and rollout_logp is not None:
        raise ValueError("rollout_logp passed but cfg.tis_cap is None: set tis_cap to use TIS")
    if counts is None:
        counts = losses.agg_counts(mask)
    agg = dict(agg=cfg.agg, max_len=cfg.max_len, counts=counts)

    loss, metrics = losses.policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_c=cfg.clip_c,
        ratio_level=cfg.ratio_level,
        rollout_logp=rollout_logp,
        tis_cap=cfg.tis_cap,
        **agg,
    )
    mf = (jnp.asarray(mask) != 0).astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(mf), 1.0)

    kl_active = cfg.kl_placement == "loss" and cfg.kl_coef > 0
    if kl_active and ref_logp is None:
        raise ValueError("cfg.kl_placement='loss' with kl_coef > 0 needs ref_logp")
    if ref_logp is not None:
        kl = losses.kl_penalty(logp, ref_logp, cfg.kl_kind, mask=mask)  # [N, L]
        metrics["kl_ref"] = sg(jnp.sum(kl) / n_tok)
        if kl_active:
            kl_loss = losses.aggregate(kl, mask, cfg.agg, cfg.max_len, counts=counts)
            metrics["kl_loss"] = sg(kl_loss)
            loss = loss + cfg.kl_coef * kl_loss

    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("cfg.entropy_coef > 0 needs entropy [N, L] (losses.entropy_from_logits)")
    if entropy is not None:
        ent = jnp.where(mf > 0, jnp.asarray(entropy, jnp.float32), 0.0)
        metrics["entropy"] = sg(jnp.sum(ent) / n_tok)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * losses.aggregate(
                ent, mask, cfg.agg, cfg.max_len, counts=counts
            )

    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("values given without old_values and returns")
        if cfg.vf_coef <= 0:
            raise ValueError("values given but cfg.vf_coef is 0: set vf_coef to train the critic")
        vloss, vmetrics = losses.value_loss(
            values, old_values, returns, mask, clip=cfg.vf_clip, **agg
        )
        metrics.update(vmetrics)
        loss = loss + cfg.vf_coef * vloss

    metrics["loss"] = sg(loss)
    return loss, metrics


__all__ = [
    "KL_PLACEMENTS",
    "PRESETS",
    "AlgoConfig",
    "PreparedAdvantages",
    "algo_from_config",
    "describe_algorithm",
    "preset_fields",
    "get_algorithm",
    "prepare_advantages",
    "register_preset",
    "rl_loss",
]
