"""Training objectives on a ModelOutput: next-token + MTP cross-entropy and the auxiliary losses.

Reductions are explicit: every cross-entropy is a (sum, count) pair over masked tokens so that
gradient accumulation over micro-batches gives the global token mean.
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


def lm_loss(out, tokens, loss_mask, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """Next-token loss + mtp.loss_weight * mean over depths of MTP losses
    + moe.aux_loss_coef * balance + dsa.indexer_loss_weight * indexer KL.

    tokens [B,T]; loss_mask [B,T] marks tokens that are targets (position t's target is t+1, so
    the mask is read at t+1). Token means are over all masked targets of the batch.
    """
    tgt, m = tokens[:, 1:], loss_mask[:, 1:]
    s, n = xent_sum(out.logits[:, :-1], tgt, m)
    ce = s / jnp.maximum(n, 1.0)
    total = ce
    metrics = {"ce": ce, "tokens": n}
    if out.mtp_logits is not None:
        mtp = []
        for k in range(out.mtp_logits.shape[0]):
            sh = k + 2  # depth k+1 predicts t+k+2
            sk, nk = xent_sum(out.mtp_logits[k][:, :-sh], tokens[:, sh:], loss_mask[:, sh:])
            mtp.append(sk / jnp.maximum(nk, 1.0))
        mtp_loss = jnp.mean(jnp.stack(mtp))
        total = total + cfg.mtp.loss_weight * mtp_loss
        metrics["mtp_ce"] = mtp_loss
    if cfg.moe.num_experts and cfg.moe.aux_loss_coef:
        total = total + cfg.moe.aux_loss_coef * out.balance_loss
    metrics["balance_loss"] = out.balance_loss
    if cfg.dsa.indexer_loss_weight:
        total = total + cfg.dsa.indexer_loss_weight * out.indexer_kl
        metrics["indexer_kl"] = out.indexer_kl
    metrics["loss"] = total
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
