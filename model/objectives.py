"""The training objective on a ModelOutput, shared by SFT and RL.

`auxiliary_losses` owns every term besides the primary one (MTP per depth, MoE balance, the DSA
indexer KL), each weighted by one field of the model config; `lm_loss` (SFT) adds it to the
next-token cross-entropy and the RL train step (rl/train_step.py) adds it to the policy loss, so
both phases train the same auxiliary terms the same way.

Reductions are explicit: every cross-entropy is a (sum, count) pair over masked tokens, with
counts that can be taken over the full batch (`target_counts`), so gradient accumulation over
micro-batches gives the global token mean.
"""

import jax
import jax.numpy as jnp

from model.config import ModelConfig


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(targets) under logits: [B,T,V], [B,T] -> [B,T] f32."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    tgt = jnp.take_along_axis(logits.astype(jnp.float32), targets[..., None], axis=-1)[..., 0]
    return tgt - lse


def xent_sum(logits, targets, mask) -> tuple[jax.Array, jax.Array]:
    """(sum of -log p over mask, number of masked tokens)."""
    m = mask.astype(jnp.float32)
    return -jnp.sum(token_logprobs(logits, targets) * m), jnp.sum(m)


def target_counts(loss_mask: jax.Array, mtp_depth: int) -> dict[str, jax.Array]:
    """Normalisers of the token-mean cross-entropies over a (full) batch: loss_mask [B,T] ->
    {"next": scalar count of next-token targets, "mtp": [depth] counts of MTP targets per depth}.
    Compute once over the whole batch and pass to every micro-batch's `auxiliary_losses`, so the
    summed micro-batch losses equal the full-batch loss."""
    m = loss_mask.astype(jnp.float32)
    out = {"next": jnp.sum(m[:, 1:])}
    out["mtp"] = jnp.stack([jnp.sum(m[:, k + 2:]) for k in range(mtp_depth)]) if mtp_depth \
        else jnp.zeros((0,), jnp.float32)
    return out


def auxiliary_losses(out, tokens, loss_mask, cfg: ModelConfig, *, counts=None,
                     micro_batches: int = 1) -> tuple[jax.Array, dict]:
    """Every training term besides the primary one (next-token CE in SFT, the policy loss in RL),
    each with its one weight from the model config:

      mtp.loss_weight * mean_k CE_k         MTP depth k+1 predicts token t+k+2; CE_k is a token
                                            mean over depth k's own targets (counts["mtp"][k])
      moe.aux_loss_coef * balance_loss      sequence-wise balance loss, summed over MoE layers
      dsa.indexer_loss_weight * indexer_kl  KL(attention || indexer), summed over DSA layers; its
                                            stage (dense warm-up or sparse) is dsa.indexer_stage

    tokens, loss_mask [B,T] as in `lm_loss`. counts: `target_counts` of the full batch (default:
    this batch). With micro_batches > 1 the balance and indexer terms (batch means inside the
    model) are divided by micro_batches, so summing micro-batches gives their average.
    Returns (weighted sum, metrics: mtp_ce (the mean over depths), mtp_ce_<k>, balance_loss,
    indexer_kl; metrics are per-batch values once micro-batches are summed).
    """
    if counts is None:
        counts = target_counts(loss_mask, out.mtp_logits.shape[0] if out.mtp_logits is not None
                               else 0)
    total = jnp.zeros((), jnp.float32)
    metrics = {}
    if out.mtp_logits is not None and cfg.mtp.loss_weight:
        depth = out.mtp_logits.shape[0]
        per_depth = []
        for k in range(depth):
            sh = k + 2  # depth k+1 predicts t+k+2
            s, _ = xent_sum(out.mtp_logits[k][:, :-sh], tokens[:, sh:], loss_mask[:, sh:])
            per_depth.append(s / jnp.maximum(counts["mtp"][k], 1.0))
            metrics[f"mtp_ce_{k + 1}"] = per_depth[-1]
        mtp = jnp.mean(jnp.stack(per_depth))
        total = total + cfg.mtp.loss_weight * mtp
        metrics["mtp_ce"] = mtp
    metrics["balance_loss"] = out.balance_loss / micro_batches
    if cfg.moe.num_experts and cfg.moe.aux_loss_coef:
        total = total + cfg.moe.aux_loss_coef * metrics["balance_loss"]
    if cfg.dsa.indexer_loss_weight:
        metrics["indexer_kl"] = out.indexer_kl / micro_batches
        total = total + cfg.dsa.indexer_loss_weight * metrics["indexer_kl"]
    return total, metrics


def lm_loss(out, tokens, loss_mask, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """The SFT objective: next-token CE (token mean over loss_mask targets) + `auxiliary_losses`.

    tokens [B,T]; loss_mask [B,T] marks tokens that are targets (position t's target is t+1, so
    the mask is read at t+1). Token means are over all masked targets of the batch. The RL train
    step adds the same `auxiliary_losses` to its policy loss (rl/train_step.py).
    """
    s, n = xent_sum(out.logits[:, :-1], tokens[:, 1:], loss_mask[:, 1:])
    ce = s / jnp.maximum(n, 1.0)
    aux, metrics = auxiliary_losses(out, tokens, loss_mask, cfg)
    total = ce + aux
    metrics.update({"ce": ce, "tokens": n, "aux_loss": aux, "loss": total})
    return total, metrics


def counting_tokens(key: jax.Array, n: int, length: int, span: int = 50) -> jax.Array:
    """A synthetic task an LM and its MTP head learn in a few dozen steps: n rows counting
    upward from random starts, token = 3 + (start + t) % span. [n,length] int32."""
    starts = jax.random.randint(key, (n, 1), 0, span)
    return ((starts + jnp.arange(length)[None]) % span + 3).astype(jnp.int32)


def fit_lm_on_batch(model, variables, tokens, *, steps: int, lr: float):
    """Full-batch AdamW on `lm_loss` over `tokens` [B,T] (every token a target), one jitted step
    (for tests, benchmarks and notebooks). Returns (variables, per-step metrics)."""
    import optax

    cfg = model.cfg
    mask = jnp.ones_like(tokens, bool)
    opt = optax.adamw(lr)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return lm_loss(model.apply({**variables, "params": p}, tokens), tokens, mask, cfg)
        (_, met), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        up, state = opt.update(g, state, params)
        return optax.apply_updates(params, up), state, met

    params, state, history = variables["params"], opt.init(variables["params"]), []
    for _ in range(steps):
        params, state, met = step(params, state)
        history.append(met)
    return {**variables, "params": params}, history
