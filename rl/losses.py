"""RL losses for post-training: PPO-family policy loss, KL penalties, entropy, value loss.

Pure functions of per-token log-probabilities (no params, no model): the train step computes
``logp`` (and optionally entropy / values) from the model and calls these. Everything is f32
internally whatever the input dtype.

Shapes (N sequences in the batch, L response tokens, V vocabulary):
  logp, old_logp, ref_logp, rollout_logp, mask, values: [N, L]
  advantages: [N, L] per token, or [N, 1] / [N] per sequence (broadcast over L)
  logits: [N, L, V]

Masks are binary: any nonzero entry is a valid response token; masked entries never reach a
loss, a gradient or a metric (inputs are zeroed with ``jnp.where`` first, so garbage such as
``-inf`` log-probs on padding is harmless).

Reductions are explicit. Every loss takes ``agg`` (a name in ``AGGREGATIONS``), and the
normalisers come from ``AggCounts`` (batch-local by default; pass global counts when the batch
is split into micro-batches so the accumulated gradient equals the full-batch one). Metrics are
always masked token means (independent of ``agg``) so they are comparable across algorithms.

Registries are dicts filled by decorators; config validation reads their keys, so adding an
entry here is the only step needed to make a name valid everywhere:
  AGGREGATIONS   register_agg          "token-mean", "seq-mean-token-sum", ...
  KL_ESTIMATORS  register_kl           "k1", "k2", "k3", "low_var_kl"
  RATIO_LEVELS   register_ratio_level  "token" (PPO), "sequence" (GSPO)
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

# exp() of a log-ratio beyond this is clamped (exp(20) ~ 4.9e8): keeps ratios finite for
# pathological inputs; gradients of clamped entries are zero.
_LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


class Registry(dict):
    """A name -> object dict filled by a decorator; unknown names raise a ValueError.

    ``meta[name]`` holds the keyword metadata given at registration (e.g. whether an
    aggregation needs ``max_len``). ``lookup``/``validate`` are the only ways configs check
    names, so the registry keys are the single list of valid names.
    """

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, obj: Any = None, **meta: Any):
        """``@reg.register(name, **meta)`` decorator, or ``reg.register(name, obj, **meta)``."""

        def add(o):
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = o
            self.meta[name] = dict(meta)
            return o

        return add if obj is None else add(obj)

    def valid_names(self) -> list[str]:
        return sorted(self)

    def validate(self, name: Any, *, field: str | None = None) -> str:
        """Returns ``name`` if registered; otherwise a ValueError naming the field and the keys."""
        if not isinstance(name, str) or name not in self:
            where = f" for field {field!r}" if field else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}{where}; valid {self.kind} names: "
                f"{', '.join(repr(n) for n in self.valid_names())}"
            )
        return name

    def lookup(self, name: Any, *, field: str | None = None) -> Any:
        return self[self.validate(name, field=field)]


AGGREGATIONS = Registry("aggregation")
KL_ESTIMATORS = Registry("kl estimator")
RATIO_LEVELS = Registry("ratio level")


def register_agg(name: str, *, needs_max_len: bool = False):
    """Registers ``fn(loss_mat, mask, *, max_len, counts) -> scalar`` (mask f32 0/1, loss_mat
    already zero where masked)."""
    return AGGREGATIONS.register(name, needs_max_len=needs_max_len)


def register_kl(name: str):
    """Registers ``fn(log_r) -> per-token kl`` with ``log_r = ref_logp - logp`` (samples from pi)."""
    return KL_ESTIMATORS.register(name)


def register_ratio_level(name: str):
    """Registers ``fn(logp, old_logp, mask) -> log importance ratio [N, L]`` (differentiable in
    logp; old_logp and mask constant)."""
    return RATIO_LEVELS.register(name)


# --------------------------------------------------------------------------------------------
# Masks and aggregation
# --------------------------------------------------------------------------------------------


def _fmask(mask: Array) -> Array:
    return (jnp.asarray(mask) != 0).astype(jnp.float32)


def _masked(x: Array, m: Array) -> Array:
    """x in f32 with masked entries replaced by 0 (not multiplied: inf * 0 would be NaN)."""
    return jnp.where(m > 0, jnp.asarray(x, jnp.float32), 0.0)


def _masked_mean(x: Array, m: Array) -> Array:
    return jnp.sum(_masked(x, m)) / jnp.maximum(jnp.sum(m), 1.0)


class AggCounts(NamedTuple):
    """Normalisers used by the aggregations (f32 scalars).

    num_tokens: valid tokens in the (full) batch; used by "token-mean".
    num_seqs: sequences with at least one valid token; used by the "seq-mean-*" modes. Rows
      without any valid token (padding rows, groups dropped by dynamic sampling) do not count.
    """

    num_tokens: Array
    num_seqs: Array


def agg_counts(mask: Array) -> AggCounts:
    """Counts for ``mask`` [N, L]. Compute once over the full batch and pass as ``counts=`` to
    every micro-batch so that summing micro-batch losses reproduces the full-batch loss."""
    m = _fmask(mask)
    return AggCounts(jnp.sum(m), jnp.sum((jnp.sum(m, -1) > 0).astype(jnp.float32)))


@register_agg("token-mean")
def _agg_token_mean(loss_mat, mask, *, max_len, counts):
    # sum_{i,t} l[i,t] m[i,t] / sum_{i,t} m[i,t]      (DAPO; every token weighs the same)
    del mask, max_len
    return jnp.sum(loss_mat) / jnp.maximum(counts.num_tokens, 1.0)


@register_agg("seq-mean-token-sum")
def _agg_seq_mean_token_sum(loss_mat, mask, *, max_len, counts):
    # (1/S) sum_i sum_t l[i,t] m[i,t]                 (REINFORCE / RLOO on sequence log-prob)
    del mask, max_len
    return jnp.sum(loss_mat) / jnp.maximum(counts.num_seqs, 1.0)


@register_agg("seq-mean-token-mean")
def _agg_seq_mean_token_mean(loss_mat, mask, *, max_len, counts):
    # (1/S) sum_i (sum_t l[i,t] m[i,t] / |y_i|)       (original GRPO; GSPO)
    del max_len
    per_seq = jnp.sum(loss_mat, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)  # [N]
    return jnp.sum(per_seq) / jnp.maximum(counts.num_seqs, 1.0)


@register_agg("seq-mean-token-sum-norm", needs_max_len=True)
def _agg_seq_mean_token_sum_norm(loss_mat, mask, *, max_len, counts):
    # (1/S) sum_i sum_t l[i,t] m[i,t] / max_len       (Dr.GRPO: a constant, length-free normaliser)
    del mask
    return jnp.sum(loss_mat) / (jnp.maximum(counts.num_seqs, 1.0) * max_len)


def check_max_len(agg: str, max_len: Any, *, field: str = "max_len") -> None:
    """Raises if ``agg`` needs a constant ``max_len`` and none (or a non-positive one) is given."""
    AGGREGATIONS.validate(agg, field="agg")
    if AGGREGATIONS.meta[agg]["needs_max_len"]:
        if max_len is None:
            raise ValueError(
                f"agg={agg!r} divides by a constant generation budget: {field} (tokens) is "
                "required and has no default"
            )
        if not isinstance(max_len, numbers.Real) or max_len <= 0:
            raise ValueError(f"{field} must be a positive number of tokens, got {max_len!r}")


def aggregate(
    loss_mat: Array,
    mask: Array,
    agg: str,
    max_len: int | None = None,
    *,
    counts: AggCounts | None = None,
) -> Array:
    """Reduces a per-token loss [N, L] to a scalar with the named aggregation.

    Modes (S = counts.num_seqs, T = counts.num_tokens, |y_i| = valid tokens of row i):
      "token-mean"               sum_{i,t} l / T
      "seq-mean-token-sum"       sum_i sum_t l / S
      "seq-mean-token-mean"      sum_i (sum_t l / |y_i|) / S
      "seq-mean-token-sum-norm"  sum_i sum_t l / (S * max_len)   (Dr.GRPO; max_len required)
    ``counts`` default to ``agg_counts(mask)`` (this batch). ``|y_i|`` is always this batch's row
    length (a per-sequence quantity, identical under micro-batching).
    """
    fn = AGGREGATIONS.lookup(agg, field="agg")
    check_max_len(agg, max_len)
    m = _fmask(mask)
    if counts is None:
        counts = agg_counts(m)
    return fn(_masked(loss_mat, m), m, max_len=max_len, counts=counts)


# --------------------------------------------------------------------------------------------
# Importance ratios
# --------------------------------------------------------------------------------------------


@register_ratio_level("token")
def _token_log_ratio(logp, old_logp, mask):
    # log r[i,t] = logp[i,t] - old_logp[i,t]                                    (PPO)
    del mask
    return logp - old_logp


@register_ratio_level("sequence")
def _sequence_log_ratio(logp, old_logp, mask):
    # GSPO: log s_i = (1/|y_i|) sum_t (logp - old_logp)[i,t]   (length-normalised sequence ratio)
    # token form (GSPO-token): log s[i,t] = sg(log s_i) + logp[i,t] - sg(logp[i,t]),
    # value s_i at every token, d s[i,t] / d logp[i,t] = s_i. With a per-sequence advantage and
    # "seq-mean-token-mean" aggregation the gradient equals GSPO's sequence-level gradient.
    seq = jnp.sum((logp - old_logp) * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)  # [N]
    sg = jax.lax.stop_gradient
    return sg(seq)[:, None] + logp - sg(logp)


def _broadcast_advantages(advantages: Array, shape: tuple[int, int]) -> Array:
    a = jnp.asarray(advantages, jnp.float32)
    if a.ndim == 1:
        a = a[:, None]  # [N] -> [N, 1]: explicit, never the ambiguous [N] -> [1, N]
    if a.ndim != 2 or a.shape[0] != shape[0] or a.shape[1] not in (1, shape[1]):
        raise ValueError(
            f"advantages must be [N, L], [N, 1] or [N] for logp {shape}, got {a.shape}"
        )
    return jnp.broadcast_to(a, shape)


def _check_clips(clip_low, clip_high, clip_c) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c (dual clip) must be > 1, got {clip_c!r}")


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def policy_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    rollout_logp: Array | None = None,
    tis_cap: float | None = None,
    ratio_level: str = "token",
    max_len: int | None = None,
    counts: AggCounts | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate loss (to minimise) with the common LLM-RL variants.

    Per token, with r the importance ratio pi/pi_old (``ratio_level``) and A the advantage:
      l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      asymmetric clip (DAPO
                                                                  clip-higher: clip_high > clip_low)
      if clip_c and A < 0:  l = min(l, -A clip_c)                 dual clip (Ye et al. 2020): caps
                                                                  the loss of negative-advantage
                                                                  tokens whose ratio exploded
      if rollout_logp:      l = l * sg(min(exp(old_logp - rollout_logp), tis_cap))
                                                                  truncated importance sampling
                                                                  for sampler/trainer mismatch
    loss = aggregate(l, mask, agg, max_len, counts=counts).

    ratio_level: "token" (PPO, r = exp(logp - old_logp) per token) or "sequence" (GSPO, r = exp of
      the masked mean log-ratio of the sequence, in its token-gradient form; clipping then acts
      per sequence, use GSPO's small clip ranges, e.g. 3e-4 / 4e-4).
    agg, max_len, counts: the reduction, see ``aggregate``; max_len is required for
      "seq-mean-token-sum-norm" and unused otherwise.
    rollout_logp / tis_cap: the sampler's log-probs; the TIS weight is per token and constant
      (stop-gradient). tis_cap is required with rollout_logp (use ``float("inf")`` for plain IS);
      without rollout_logp, tis_cap has no effect (the weight is 1).

    Gradients flow only through ``logp``; old_logp, rollout_logp and advantages are constants.
    Log-ratios are clamped to +-20 before exp.

    Metrics (masked token means, stop-gradient): pg_loss; pg_clipfrac_high (A > 0, r > 1+clip_high),
    pg_clipfrac_low (A < 0, r < 1-clip_low), pg_clipfrac_dual (A < 0, r > clip_c); approx_kl
    (k3 estimate of KL(pi_old || pi) from token log-ratios, samples from pi_old); ratio_mean/min/max
    (of the ratio actually used); tis_weight_mean/max and tis_capfrac (1, 1, 0 without TIS).

    Not covered: value clipping (``value_loss``), KL and entropy terms (``rl.algorithms.rl_loss``).
    """
    ratio_fn = RATIO_LEVELS.lookup(ratio_level, field="ratio_level")
    AGGREGATIONS.validate(agg, field="agg")
    check_max_len(agg, max_len)
    _check_clips(clip_low, clip_high, clip_c)
    if rollout_logp is not None and tis_cap is None:
        raise ValueError(
            "rollout_logp given without tis_cap: pass tis_cap (float('inf') for untruncated IS)"
        )
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap!r}")

    sg = jax.lax.stop_gradient
    m = _fmask(mask)  # [N, L]
    logp = _masked(logp, m)  # [N, L]
    old_logp = sg(_masked(old_logp, m))
    adv = sg(_broadcast_advantages(advantages, logp.shape))  # [N, L]

    log_ratio = jnp.clip(ratio_fn(logp, old_logp, m), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)  # [N, L]
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = jnp.maximum(pg_unclipped, pg_clipped)  # pessimistic bound
    if clip_c is not None:
        pg = jnp.where(adv < 0, jnp.minimum(pg, -adv * clip_c), pg)
        dual = (adv < 0) & (ratio > clip_c)
    else:
        dual = jnp.zeros(ratio.shape, bool)

    if rollout_logp is not None:
        tis_log = jnp.clip(
            old_logp - sg(_masked(rollout_logp, m)), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
        )
        tis_raw = jnp.exp(tis_log)
        tis_w = sg(jnp.minimum(tis_raw, tis_cap))  # [N, L]
        pg = pg * tis_w
        tis_capped = tis_raw > tis_cap
    else:
        tis_w = jnp.ones_like(ratio)
        tis_capped = jnp.zeros(ratio.shape, bool)

    loss = aggregate(pg, m, agg, max_len, counts=counts)

    tok_lr = sg(logp - old_logp)  # token log-ratio regardless of ratio_level
    valid = m > 0
    any_valid = jnp.any(valid)
    r = sg(ratio)
    metrics = {
        "pg_loss": sg(loss),
        "pg_clipfrac_high": _masked_mean((adv > 0) & (r > 1.0 + clip_high), m),
        "pg_clipfrac_low": _masked_mean((adv < 0) & (r < 1.0 - clip_low), m),
        "pg_clipfrac_dual": _masked_mean(dual, m),
        "approx_kl": _masked_mean(jnp.expm1(tok_lr) - tok_lr, m),
        "ratio_mean": _masked_mean(r, m),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid, r, -jnp.inf)), 0.0),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid, r, jnp.inf)), 0.0),
        "tis_weight_mean": _masked_mean(tis_w, m),
        "tis_weight_max": jnp.where(any_valid, jnp.max(jnp.where(valid, tis_w, -jnp.inf)), 0.0),
        "tis_capfrac": _masked_mean(tis_capped, m),
    }
    return loss, metrics


# --------------------------------------------------------------------------------------------
# KL penalties
# --------------------------------------------------------------------------------------------
# Schulman's estimators of KL(pi || ref) from samples x ~ pi, with r = ref(x) / pi(x):
#   k1 = -log r              unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2       biased (exact to 2nd order), low variance, >= 0
#   k3 = (r - 1) - log r     unbiased, low variance, >= 0
# As *loss* terms (differentiated at fixed samples) their gradients differ: E_pi[grad k1] = 0,
# E_pi[grad k2] = grad KL(pi || ref), E_pi[grad k3] = grad KL(ref || pi) (the forward KL).


@register_kl("k1")
def _kl_k1(log_r):
    return -log_r


@register_kl("k2")
def _kl_k2(log_r):
    return 0.5 * jnp.square(log_r)


@register_kl("k3")
def _kl_k3(log_r):
    return jnp.expm1(log_r) - log_r


@register_kl("low_var_kl")
def _kl_low_var(log_r):
    # k3 with log r clamped to +-20 and the estimate capped at 10 (verl's "low_var_kl").
    log_r = jnp.clip(log_r, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.clip(jnp.expm1(log_r) - log_r, -10.0, 10.0)


def kl_penalty(
    logp: Array, ref_logp: Array, kind: str = "k3", *, mask: Array | None = None
) -> Array:
    """Per-token KL(pi || ref) estimate [N, L] from log-probs of tokens sampled from pi.

    kind: a name in ``KL_ESTIMATORS`` (k1, k2, k3, low_var_kl; see the table above for what each
    estimates and what its gradient is). ``ref_logp`` is a constant (stop-gradient). No reduction
    here: reduce with ``aggregate`` (loss placement) or add to rewards (``kl_in_reward``).
    mask: optional; masked entries are 0 (and their inputs are zeroed first).
    """
    fn = KL_ESTIMATORS.lookup(kind, field="kl_kind")
    logp = jnp.asarray(logp, jnp.float32)
    ref_logp = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32))
    if mask is not None:
        m = _fmask(mask)
        logp, ref_logp = _masked(logp, m), _masked(ref_logp, m)
        return _masked(fn(ref_logp - logp), m)
    return fn(ref_logp - logp)


# --------------------------------------------------------------------------------------------
# Entropy and value loss
# --------------------------------------------------------------------------------------------


def entropy_from_logits(logits: Array, mask: Array) -> Array:
    """Per-token entropy [N, L] of softmax(logits [N, L, V]) in f32; 0 where masked.

    H = logsumexp(z) - sum_v softmax(z)_v z_v. Differentiable (for an entropy bonus). No
    reduction: aggregate with ``aggregate``.
    """
    z = jnp.asarray(logits, jnp.float32)
    p = jax.nn.softmax(z, axis=-1)
    ent = jax.nn.logsumexp(z, axis=-1) - jnp.einsum("nlv,nlv->nl", p, z)
    return _masked(ent, _fmask(mask))


def value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip: float | None = None,
    agg: str = "token-mean",
    max_len: int | None = None,
    counts: AggCounts | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO value loss: 0.5 * aggregate(max((v - R)^2, (v_clip - R)^2)).

    values [N, L] (differentiable), old_values / returns [N, L] (constants).
    clip: if given, v_clip = old_values + clip(values - old_values, -clip, clip) (PPO value
      clipping, an absolute range in return units); if None the plain squared error is used.
    agg, max_len, counts: the reduction (see ``aggregate``). The 0.5 factor is part of the loss.
    Metrics: vf_loss, vf_clipfrac (tokens where the clipped term is the larger),
      vf_explained_var (1 - Var[R - v] / Var[R], masked), values_mean, returns_mean.
    """
    sg = jax.lax.stop_gradient
    m = _fmask(mask)
    v = _masked(values, m)
    v_old = sg(_masked(old_values, m))
    ret = sg(_masked(returns, m))
    err = jnp.square(v - ret)
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"value clip must be > 0, got {clip!r}")
        v_clip = v_old + jnp.clip(v - v_old, -clip, clip)
        err_clip = jnp.square(v_clip - ret)
        per_tok = jnp.maximum(err, err_clip)
        clipfrac = _masked_mean(err_clip > err, m)
    else:
        per_tok = err
        clipfrac = jnp.zeros((), jnp.float32)
    loss = 0.5 * aggregate(per_tok, m, agg, max_len, counts=counts)

    def _var(x):
        mu = _masked_mean(x, m)
        return _masked_mean(jnp.square(x - mu), m)

    vs = sg(v)
    metrics = {
        "vf_loss": sg(loss),
        "vf_clipfrac": clipfrac,
        "vf_explained_var": 1.0 - _var(ret - vs) / jnp.maximum(_var(ret), 1e-8),
        "values_mean": _masked_mean(vs, m),
        "returns_mean": _masked_mean(ret, m),
    }
    return loss, metrics


__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "RATIO_LEVELS",
    "AggCounts",
    "Registry",
    "agg_counts",
    "aggregate",
    "check_max_len",
    "entropy_from_logits",
    "kl_penalty",
    "policy_loss",
    "register_agg",
    "register_kl",
    "register_ratio_level",
    "value_loss",
]
