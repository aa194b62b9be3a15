"""Advantage estimators and reward shaping for LLM RL (pure, jit-able, no params).

Shapes: N sequences, L response tokens.
  rewards: [N] one scalar per sequence (outcome reward), or [N, L] per token
  group_ids: [N] int, sequences sampled from the same prompt share an id; ids are arbitrary
    integers in any order, and groups may have any (and different) sizes
  mask, values: [N, L]

Group statistics use segment ops over a dense re-indexing of ``group_ids`` (``jnp.unique`` with a
static size), so nothing assumes contiguous or equal-sized groups. ``valid`` [N] bool (optional)
excludes rows (padding, dropped groups) from every statistic; their advantage is 0.

Low-level estimators (direct use):
  grpo, rloo, reinforce_baseline -> per-sequence advantages [N]
  gae -> (advantages [N, L], returns [N, L])
Uniform interface (what the trainer calls): ``compute_advantages(name, rewards, mask, ...)`` over
the ``ESTIMATORS`` registry -> ``AdvantageOutput(advantages [N, L], returns [N, L] | None)``.
Each registered estimator declares whether it needs group ids / values and its hyper-parameters
(its keyword-only arguments), which ``rl.algorithms.AlgoConfig`` provides by the same names.

Shaping helpers: ``dynamic_sampling_mask`` and ``overlong_penalty`` (DAPO), ``kl_in_reward``,
``place_at_last_token``, ``whiten``.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl.losses import Registry

Array = jax.Array

ESTIMATORS = Registry("advantage estimator")


# --------------------------------------------------------------------------------------------
# Group helpers
# --------------------------------------------------------------------------------------------


def _dense_groups(group_ids: Array) -> Array:
    """Maps arbitrary int ids [N] to dense indices in [0, N) (static size: jit-safe)."""
    g = jnp.asarray(group_ids)
    if g.ndim != 1:
        raise ValueError(f"group_ids must be [N], got shape {g.shape}")
    _, inv = jnp.unique(g, size=g.shape[0], return_inverse=True, fill_value=g.min())
    return inv.reshape(-1)


def _valid_f(valid: Array | None, n: int) -> Array:
    if valid is None:
        return jnp.ones((n,), jnp.float32)
    return (jnp.asarray(valid) != 0).astype(jnp.float32).reshape(n)


def _group_sum(x: Array, idx: Array) -> Array:
    """Per-row sum of x over the row's group: [N] -> [N]."""
    n = x.shape[0]
    return jax.ops.segment_sum(x, idx, num_segments=n)[idx]


def _check_rewards_1d(rewards: Array) -> Array:
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [N] per-sequence scalars, got shape {r.shape}")
    return r


# --------------------------------------------------------------------------------------------
# Outcome (per-sequence) estimators
# --------------------------------------------------------------------------------------------


def grpo(
    rewards: Array,
    group_ids: Array,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std_ddof: int = 1,
    valid: Array | None = None,
) -> Array:
    """GRPO group-relative advantages [N]: (r - mean_g) / (std_g + eps).

    normalize_std=False gives Dr.GRPO (r - mean_g, no std division: no difficulty bias).
    std_ddof: the std's delta degrees of freedom; 1 (sample std, as TRL / verl / OpenRLHF, i.e.
      torch.std) or 0 (population std). Groups with count <= std_ddof get std 0 (and, having a
      single member, advantage 0).
    eps: added to the std (not the variance).
    valid: optional [N] bool; invalid rows are excluded from mean/std and get advantage 0.
    """
    r = _check_rewards_1d(rewards)
    n = r.shape[0]
    idx = _dense_groups(group_ids)
    w = _valid_f(valid, n)
    r = jnp.where(w > 0, r, 0.0)  # invalid rows may hold garbage (NaN)
    cnt = _group_sum(w, idx)  # [N] size of the row's group
    mean = _group_sum(r * w, idx) / jnp.maximum(cnt, 1.0)
    centred = (r - mean) * w
    if not normalize_std:
        return centred
    ssq = _group_sum(jnp.square(centred), idx)
    dof = cnt - std_ddof
    std = jnp.sqrt(jnp.where(dof > 0, ssq / jnp.maximum(dof, 1.0), 0.0))
    den = std + eps
    return centred / jnp.where(den > 0, den, 1.0)  # std 0 <=> all equal: centred is 0 there


def rloo(rewards: Array, group_ids: Array, *, valid: Array | None = None) -> Array:
    """REINFORCE leave-one-out advantages [N]: r_i - mean_{j in g, j != i} r_j.

    Equals n/(n-1) * (r_i - mean_g) for a group of n. Groups of one get advantage 0.
    valid: optional [N] bool; invalid rows are excluded from baselines and get advantage 0.
    """
    r = _check_rewards_1d(rewards)
    idx = _dense_groups(group_ids)
    w = _valid_f(valid, r.shape[0])
    r = jnp.where(w > 0, r, 0.0)
    cnt = _group_sum(w, idx)
    others = _group_sum(r * w, idx) - r * w
    baseline = others / jnp.maximum(cnt - 1.0, 1.0)
    return jnp.where(cnt > 1.0, r - baseline, 0.0) * w


def reinforce_baseline(
    rewards: Array, group_ids: Array, *, eps: float = 1e-6, valid: Array | None = None
) -> Array:
    """REINFORCE++-baseline advantages [N]: (r - mean_g) / (std_batch + eps).

    The group mean removes the prompt's difficulty; the std is the population std (ddof 0) of the
    centred rewards over all valid rows of the batch (their batch mean is exactly 0), which
    normalises scale without per-group std (no difficulty bias). Per-sequence whitening (the
    OpenRLHF version whitens over tokens, weighting rows by length).
    """
    centred = grpo(rewards, group_ids, normalize_std=False, valid=valid)
    w = _valid_f(valid, centred.shape[0])
    var = jnp.sum(jnp.square(centred) * w) / jnp.maximum(jnp.sum(w), 1.0)
    den = jnp.sqrt(var) + eps
    return centred / jnp.where(den > 0, den, 1.0)


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------


def gae(
    rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Array, Array]:
    """Generalised advantage estimation over valid tokens -> (advantages, returns), both [N, L].

    rewards [N, L] per token (an outcome reward sits on the last valid token: see
    ``place_at_last_token``), values [N, L] (treated as constants), mask [N, L].
    Time runs over the *valid* tokens of each row only: a masked position (right padding, or a
    hole such as tool output inside a multi-turn completion) is skipped, its reward and value are
    ignored, and the recursion passes through it. After the last valid token the episode ends
    (V = 0, no bootstrap). With t, t' consecutive valid positions:
      delta_t = r_t + gamma V_t' - V_t;  A_t = delta_t + gamma lam A_t';  R_t = A_t + V_t.
    Computed with a reverse ``lax.scan`` over L; zero where masked.
    """
    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
    r = jnp.where(m > 0, jnp.asarray(rewards, jnp.float32), 0.0)
    v = jax.lax.stop_gradient(jnp.where(m > 0, jnp.asarray(values, jnp.float32), 0.0))
    if r.shape != m.shape or v.shape != m.shape:
        raise ValueError(
            f"gae needs rewards, values, mask of equal shape [N, L]: {r.shape}, {v.shape}, {m.shape}"
        )

    def step(carry, x):
        next_v, next_adv = carry  # [N], [N]: value / advantage at the next valid token
        r_t, v_t, m_t = x  # [N] each
        delta = r_t + gamma * next_v - v_t
        adv_t = delta + gamma * lam * next_adv
        keep = m_t > 0
        carry = (jnp.where(keep, v_t, next_v), jnp.where(keep, adv_t, next_adv))
        return carry, jnp.where(keep, adv_t, 0.0)

    zeros = jnp.zeros(m.shape[:1], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)  # [L, N]
    adv = adv_t.T
    returns = jnp.where(m > 0, adv + v, 0.0)
    return adv, returns


# --------------------------------------------------------------------------------------------
# Shaping helpers
# --------------------------------------------------------------------------------------------


def dynamic_sampling_mask(rewards: Array, group_ids: Array, *, valid: Array | None = None) -> Array:
    """DAPO dynamic sampling: bool [N], False for every row of a group whose (valid) rewards are all
    equal (all right or all wrong: zero advantage, no gradient), and for invalid rows.

    The pipeline drops False rows (or zeroes their loss mask) and refills the batch with new groups.
    Equality is exact (max == min); quantise continuous rewards first if needed.
    """
    r = _check_rewards_1d(rewards)
    n = r.shape[0]
    idx = _dense_groups(group_ids)
    ok = _valid_f(valid, n) > 0
    gmax = jax.ops.segment_max(jnp.where(ok, r, -jnp.inf), idx, num_segments=n)[idx]
    gmin = jax.ops.segment_min(jnp.where(ok, r, jnp.inf), idx, num_segments=n)[idx]
    return ok & (gmax > gmin)


def overlong_penalty(lengths: Array, *, max_len: int, cache_len: int) -> Array:
    """DAPO soft overlong punishment (eq. 13), counted in tokens, float [N]:
      0                                       if len <= max_len - cache_len
      ((max_len - cache_len) - len) / cache_len   if max_len - cache_len < len <= max_len
      -1                                      if len > max_len
    i.e. linear from 0 at the start of the cache window to -1 at the budget ``max_len``. Add it to
    the outcome reward before the estimator.
    """
    if not isinstance(max_len, numbers.Integral) or not isinstance(cache_len, numbers.Integral):
        raise ValueError(
            f"max_len and cache_len must be ints (tokens), got {max_len!r}, {cache_len!r}"
        )
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    n = jnp.asarray(lengths, jnp.float32)
    start = float(max_len - cache_len)
    soft = (start - n) / float(cache_len)
    return jnp.where(n <= start, 0.0, jnp.where(n <= max_len, soft, -1.0))


def place_at_last_token(seq_rewards: Array, mask: Array) -> Array:
    """Token rewards [N, L]: seq_rewards [N] on the last valid token of each row, 0 elsewhere
    (rows without valid tokens get nothing)."""
    r = _check_rewards_1d(seq_rewards)
    m = jnp.asarray(mask) != 0
    length = m.shape[1]
    pos = jnp.arange(length)
    last = jnp.max(jnp.where(m, pos, -1), axis=1)  # [N], -1 for empty rows
    return jnp.where(pos[None, :] == last[:, None], r[:, None], 0.0)


def kl_in_reward(
    token_rewards: Array, kl: Array, beta: float, *, mask: Array | None = None
) -> Array:
    """Token rewards with a KL penalty folded in: token_rewards - beta * kl, both [N, L].

    kl: per-token estimate (``rl.losses.kl_penalty`` of the rollout policy vs the reference, k1 is
    the usual choice here). Constant (stop-gradient). Masked entries (if mask given) are 0.
    Outcome estimators sum token rewards over the sequence, so for them this is a sequence-level
    penalty r - beta * sum_t kl_t (RLOO's formulation); GAE sees it per token (PPO-RLHF).
    """
    out = jnp.asarray(token_rewards, jnp.float32) - beta * jax.lax.stop_gradient(
        jnp.asarray(kl, jnp.float32)
    )
    if mask is not None:
        out = jnp.where(jnp.asarray(mask) != 0, out, 0.0)
    return out


def whiten(x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """Masked whitening over all valid entries: (x - mean) / sqrt(var + eps) (population var);
    shift_mean=False adds the mean back (only the deviations are rescaled). Zero where masked."""
    m = (jnp.asarray(mask) != 0).astype(jnp.float32)
    x = jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)
    cnt = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(x) / cnt
    var = jnp.sum(jnp.square(x - mean) * m) / cnt
    out = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m > 0, out, 0.0)


# --------------------------------------------------------------------------------------------
# Registry with a uniform signature
# --------------------------------------------------------------------------------------------


class AdvantageOutput(NamedTuple):
    advantages: Array  # [N, L], zero where masked
    returns: Array | None  # [N, L] value targets (estimators with a critic), else None


def register_estimator(name: str, *, needs_groups: bool, needs_values: bool):
    """Registers ``fn(rewards, mask, group_ids, values, *, <hparams>) -> AdvantageOutput``.

    The keyword-only arguments of ``fn`` are its hyper-parameters (recorded in
    ``ESTIMATORS.meta[name]["hparams"]`` with their defaults); ``rl.algorithms.AlgoConfig`` has a
    field of the same name for each.
    """

    def deco(fn: Callable[..., AdvantageOutput]):
        params = inspect.signature(fn).parameters.values()
        kw = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        return ESTIMATORS.register(
            name,
            fn,
            needs_groups=needs_groups,
            needs_values=needs_values,
            hparams=tuple(kw),
            defaults=kw,
        )

    return deco


def _seq_rewards(rewards: Array, mask: Array) -> Array:
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim == 2:  # token rewards -> undiscounted sequence return
        return jnp.sum(jnp.where(jnp.asarray(mask) != 0, r, 0.0), axis=-1)
    return _check_rewards_1d(r)


def _row_valid(mask: Array) -> Array:
    return jnp.any(jnp.asarray(mask) != 0, axis=-1)


def _per_token(adv: Array, mask: Array) -> Array:
    return jnp.where(jnp.asarray(mask) != 0, adv[:, None], 0.0)


@register_estimator("grpo", needs_groups=True, needs_values=False)
def _est_grpo(rewards, mask, group_ids, values, *, adv_eps=1e-6, std_ddof=1):
    del values
    a = grpo(
        _seq_rewards(rewards, mask),
        group_ids,
        normalize_std=True,
        eps=adv_eps,
        std_ddof=std_ddof,
        valid=_row_valid(mask),
    )
    return AdvantageOutput(_per_token(a, mask), None)


@register_estimator("drgrpo", needs_groups=True, needs_values=False)
def _est_drgrpo(rewards, mask, group_ids, values):
    del values
    a = grpo(_seq_rewards(rewards, mask), group_ids, normalize_std=False, valid=_row_valid(mask))
    return AdvantageOutput(_per_token(a, mask), None)


@register_estimator("rloo", needs_groups=True, needs_values=False)
def _est_rloo(rewards, mask, group_ids, values):
    del values
    a = rloo(_seq_rewards(rewards, mask), group_ids, valid=_row_valid(mask))
    return AdvantageOutput(_per_token(a, mask), None)


@register_estimator("reinforce_baseline", needs_groups=True, needs_values=False)
def _est_reinforce_baseline(rewards, mask, group_ids, values, *, adv_eps=1e-6):
    del values
    a = reinforce_baseline(
        _seq_rewards(rewards, mask), group_ids, eps=adv_eps, valid=_row_valid(mask)
    )
    return AdvantageOutput(_per_token(a, mask), None)


@register_estimator("gae", needs_groups=False, needs_values=True)
def _est_gae(rewards, mask, group_ids, values, *, gamma=1.0, lam=1.0):
    del group_ids
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim == 1:
        r = place_at_last_token(r, mask)
    adv, ret = gae(r, values, mask, gamma=gamma, lam=lam)
    return AdvantageOutput(adv, ret)


def compute_advantages(
    estimator: str,
    rewards: Array,
    mask: Array,
    *,
    group_ids: Array | None = None,
    values: Array | None = None,
    **hparams: Any,
) -> AdvantageOutput:
    """Runs the named estimator with the uniform signature.

    rewards: [N] outcome rewards or [N, L] token rewards. Outcome estimators (grpo, drgrpo, rloo,
      reinforce_baseline) reduce token rewards to the undiscounted masked sum; gae places [N]
      rewards on the last valid token.
    mask [N, L]: rows without valid tokens are excluded from group statistics (advantage 0).
    group_ids [N] (required by group estimators), values [N, L] (required by gae).
    hparams: only the estimator's own (``ESTIMATORS.meta[name]["hparams"]``); unknown names raise.
    Returns AdvantageOutput(advantages [N, L] zero where masked, returns [N, L] or None).
    """
    fn = ESTIMATORS.lookup(estimator, field="estimator")
    meta = ESTIMATORS.meta[estimator]
    unknown = sorted(set(hparams) - set(meta["hparams"]))
    if unknown:
        raise ValueError(
            f"estimator {estimator!r} got unknown hyper-parameters {unknown}; it accepts "
            f"{list(meta['hparams'])}"
        )
    if meta["needs_groups"] and group_ids is None:
        raise ValueError(f"estimator {estimator!r} needs group_ids [N]")
    if meta["needs_values"] and values is None:
        raise ValueError(f"estimator {estimator!r} needs values [N, L] (a critic)")
    m = jnp.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"mask must be [N, L], got shape {m.shape}")
    return fn(rewards, m, group_ids, values, **hparams)


__all__ = [
    "ESTIMATORS",
    "AdvantageOutput",
    "compute_advantages",
    "dynamic_sampling_mask",
    "gae",
    "grpo",
    "kl_in_reward",
    "overlong_penalty",
    "place_at_last_token",
    "register_estimator",
    "reinforce_baseline",
    "rloo",
    "whiten",
]
