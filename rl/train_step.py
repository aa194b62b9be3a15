"""The jit-compiled RL train step (policy loss + KL + entropy + MTP + MoE aux) on a plain pytree.

    opt = make_optimizer(config.optim)
    state = init_train_state(variables, opt)
    step = make_train_step(model, algo, opt, micro_batches=2, mtp_loss_weight=0.1)
    state, metrics = step(state, batch)       # state is donated: do not reuse the old one

batch (all [N,L] unless noted; position t holds the value for target token t, see
rl/sampler.pack): tokens int32, loss_mask bool (completion targets), advantages f32 ([N,L] or
[N,1]), old_logp f32 (the policy that generated / the behaviour policy, usually = the trainer's
log-probs before this update), optional ref_logp (frozen reference policy), optional
rollout_logp (the sampler's own log-probs, for TIS when algo.tis_cap is set); with a critic
(algo.needs_values, e.g. PPO) also old_values (the value head's V at rollout time,
make_logp_value_fn) and returns (the estimator's value targets).

Critic (rl/critic.py): the value head runs on the hidden states of the same forward as the policy
logits; its params (CriticTrainState.value_params) have their own optimizer state
(value_opt_state, value_optimizer) and join the loss through rl_loss's value term (vf_coef,
vf_clip).

    state = init_train_state(variables, opt, value_params=init_value_params(critic, cfg, rng),
                             value_optimizer=vopt)
    step = make_train_step(model, get_algorithm("ppo"), opt, critic=critic, value_optimizer=vopt)

Reductions: every loss term uses algo.agg with normalisers (token and sequence counts) taken over
the whole batch, and gradients are summed over micro-batches, so the update equals the full-batch
update whatever micro_batches is. The MoE balance loss is averaged over micro-batches; the MTP
loss is a token mean over all completion targets of the batch.

Guards and extras: updates whose gradients are not finite are skipped (params and optimizer state
kept) and counted in state.skipped; the aux-free router bias moves by moe.bias_update_rate against
each layer's load (sigmoid routers); metrics include grad norm, KL, entropy, clip fractions, router
max-violation, and the sampler/trainer log-prob gap; with a critic, vf_loss, vf_clipfrac,
vf_explained_var, values_mean, returns_mean (over the whole batch) and value_grad_norm.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax

from model.layers.moe import aux_free_bias_update
from model.objectives import token_logprobs, xent_sum
from model.transformer import Model, moe_layer_names
from rl import losses
from rl.algorithms import AlgoConfig, rl_loss
from rl.critic import CriticConfig, token_values


@flax.struct.dataclass
class TrainState:
    params: dict
    router_state: dict
    opt_state: optax.OptState
    step: jax.Array  # int32 updates applied
    skipped: jax.Array  # int32 updates skipped for non-finite gradients

    @property
    def variables(self) -> dict:
        return {"params": self.params, "router_state": self.router_state}


@flax.struct.dataclass
class CriticTrainState(TrainState):
    """The train state of an algorithm with a critic (algo.needs_values): TrainState plus the
    value head's params (rl/critic.py) and their own optimizer state. A subclass rather than
    optional fields, so critic-free states (and their checkpoints: orbax checks the tree
    structure) are exactly what they were."""

    value_params: dict
    value_opt_state: optax.OptState


def make_optimizer(ocfg) -> optax.GradientTransformation:
    """Global-norm clipping -> AdamW with linear warmup + cosine decay.

    ocfg fields: lr, warmup_steps, total_steps, final_lr_frac, weight_decay, b1, b2, eps,
    clip_norm (0 disables clipping).
    """
    warm = max(int(ocfg.warmup_steps), 1)
    sched = optax.warmup_cosine_decay_schedule(  # the first update already uses lr / warmup
        init_value=ocfg.lr / warm, peak_value=ocfg.lr, warmup_steps=max(int(ocfg.warmup_steps), 1),
        decay_steps=max(int(ocfg.total_steps), int(ocfg.warmup_steps) + 1),
        end_value=ocfg.lr * ocfg.final_lr_frac)
    parts = [optax.clip_by_global_norm(ocfg.clip_norm)] if ocfg.clip_norm else []
    parts.append(optax.adamw(sched, b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps,
                             weight_decay=ocfg.weight_decay))
    return optax.chain(*parts)


def init_train_state(variables: dict, optimizer: optax.GradientTransformation, *,
                     value_params: dict | None = None,
                     value_optimizer: optax.GradientTransformation | None = None) -> TrainState:
    """A TrainState; with value_params (rl.critic.init_value_params) a CriticTrainState whose
    critic is optimized by value_optimizer (default: optimizer) with its own state."""
    params = variables["params"]
    common = dict(params=params, router_state=variables.get("router_state", {}),
                  opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                  skipped=jnp.zeros((), jnp.int32))
    if value_params is None:
        return TrainState(**common)
    return CriticTrainState(**common, value_params=value_params,
                            value_opt_state=(value_optimizer or optimizer).init(value_params))


def update_router_bias(cfg, router_state: dict, expert_counts) -> dict:
    """Aux-free bias step for every MoE layer (sigmoid routers); identity otherwise.
    expert_counts [n_layers, E] in moe_layer_names order (MTP blocks last, maybe absent)."""
    if not (cfg.moe.num_experts > 0 and cfg.moe.router == "sigmoid") or expert_counts is None:
        return router_state
    rs = dict(router_state)
    for i, name in enumerate(moe_layer_names(cfg)[: expert_counts.shape[0]]):
        nb = aux_free_bias_update(rs[name]["ffn"]["bias"], expert_counts[i],
                                  cfg.moe.bias_update_rate)
        rs[name] = {**rs[name], "ffn": {**rs[name]["ffn"], "bias": nb}}
    return rs


def _pad_left(x):  # [N,L-1] -> [N,L] (position t holds target t)
    return jnp.pad(x, ((0, 0), (1, 0)))


def _input_valid(mask):
    """Positions up to the last target of each row (right padding excluded from the model)."""
    L = mask.shape[1]
    last = jnp.max(jnp.where(mask, jnp.arange(L)[None], 0), axis=1)
    return jnp.arange(L)[None] <= last[:, None]


def make_train_step(model: Model, algo: AlgoConfig, optimizer: optax.GradientTransformation, *,
                    micro_batches: int = 1, mtp_loss_weight: float = 0.0, donate: bool = True,
                    critic: CriticConfig | None = None,
                    value_optimizer: optax.GradientTransformation | None = None):
    """critic / value_optimizer: used when algo.needs_values (PPO with GAE): the value head
    (default CriticConfig()) runs on the same forward's hidden states, the batch must hold
    old_values and returns ([N,L], from the rollout-time forward and the estimator), and the
    state's value_params are updated by value_optimizer (default: optimizer) with their own
    state; an update is skipped when either gradient is not finite."""
    cfg = model.cfg
    with_mtp = cfg.mtp.depth > 0 and mtp_loss_weight > 0
    with_critic = algo.needs_values
    if with_critic:
        critic = critic or CriticConfig()
        value_optimizer = value_optimizer or optimizer

    def micro_loss(trainable, router_state, mb, counts, n_targets):
        params, value_params = trainable  # value_params: None without a critic
        tokens, mask = mb["tokens"], mb["loss_mask"]
        out = model.apply({"params": params, "router_state": router_state}, tokens,
                          _input_valid(mask), with_mtp=with_mtp)
        logits = out.logits[:, :-1]
        logp = _pad_left(token_logprobs(logits, tokens[:, 1:]))
        entropy = _pad_left(losses.entropy_from_logits(logits, mask[:, 1:]))
        values = token_values(critic, value_params, out.hidden) if with_critic else None  # [n,L]
        loss, met = rl_loss(
            logp, mb["old_logp"], mb["advantages"], mask, cfg=algo,
            ref_logp=mb.get("ref_logp"), entropy=entropy,
            values=values, old_values=mb["old_values"] if with_critic else None,
            returns=mb["returns"] if with_critic else None,
            rollout_logp=mb.get("rollout_logp") if algo.tis_cap is not None else None,
            counts=counts)
        for k in ("pg_loss", "kl_loss", "vf_loss"):  # per-micro shares -> batch value after
            if k in met:                               # averaging over micro-batches
                met[k] = met[k] * micro_batches
        if cfg.moe.num_experts and cfg.moe.aux_loss_coef:
            loss = loss + cfg.moe.aux_loss_coef * out.balance_loss / micro_batches
        if with_mtp:
            mtp = 0.0
            for k in range(cfg.mtp.depth):
                sh = k + 2
                s, _ = xent_sum(out.mtp_logits[k][:, :-sh], tokens[:, sh:], mask[:, sh:])
                mtp = mtp + s / jnp.maximum(n_targets, 1.0)
            mtp = mtp / cfg.mtp.depth
            loss = loss + mtp_loss_weight * mtp
            met["mtp_ce"] = mtp * micro_batches  # per-micro share -> batch mean after averaging
        if "rollout_logp" in mb:
            m = mask.astype(jnp.float32)
            met["logp_gap_abs"] = jnp.sum(jnp.abs(logp - mb["rollout_logp"]) * m) / jnp.maximum(
                jnp.sum(m), 1.0)
        met["balance_loss"] = out.balance_loss
        if out.router is not None:
            met["router_max_vio"] = jnp.mean(out.router["max_vio"])
            met["router_dead_experts"] = jnp.mean(out.router["dead_experts"])
            met["router_entropy"] = jnp.mean(out.router["routing_entropy"])
        counts_e = out.expert_counts if out.expert_counts is not None else jnp.zeros((0, 0))
        vals = jax.lax.stop_gradient(values) if with_critic else jnp.zeros((0,))
        return loss, (met, counts_e, vals)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: TrainState, batch: dict):
        mask = batch["loss_mask"]
        N = mask.shape[0]
        if N % micro_batches:
            raise ValueError(f"batch of {N} rows does not split into {micro_batches} micro-batches")
        if with_critic:
            if not isinstance(state, CriticTrainState):
                raise ValueError(f"algorithm {algo.name!r} trains a critic: build the state with "
                                 "init_train_state(..., value_params=rl.critic.init_value_params"
                                 "(...))")
            missing = [k for k in ("old_values", "returns") if k not in batch]
            if missing:
                raise ValueError(f"algorithm {algo.name!r} needs batch {missing} [N,L] (rollout "
                                 "values and the estimator's returns, see "
                                 "rl.pipeline.build_train_batch)")
        counts = losses.agg_counts(mask)
        n_targets = jnp.sum(mask.astype(jnp.float32))
        mbs = jax.tree.map(lambda x: x.reshape(micro_batches, N // micro_batches, *x.shape[1:]),
                           batch)
        trainable = (state.params, state.value_params if with_critic else None)

        def body(acc, mb):
            (loss, (met, ce, vals)), g = grad_fn(trainable, state.router_state, mb, counts,
                                                 n_targets)
            g_acc, l_acc, m_acc, c_acc = acc
            return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss,
                    jax.tree.map(jnp.add, m_acc, met), c_acc + ce), vals

        mb0 = jax.tree.map(lambda x: x[0], mbs)
        (_, (met_shape, ce_shape, _)), _ = jax.eval_shape(
            grad_fn, trainable, state.router_state, mb0, counts, n_targets)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
        init = (zeros(trainable), jnp.zeros((), jnp.float32), zeros(met_shape),
                zeros(ce_shape))
        (grads, loss, met, expert_counts), vals = jax.lax.scan(body, init, mbs)
        met = jax.tree.map(lambda x: x / micro_batches, met)
        p_grads, v_grads = grads

        gnorm = optax.tree.norm(p_grads)
        finite = jnp.isfinite(gnorm) & jnp.isfinite(loss)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        extra, critic_update = {}, {}
        if with_critic:
            vgnorm = optax.tree.norm(v_grads)
            finite = finite & jnp.isfinite(vgnorm)
            # value metrics over the whole batch (exact whatever micro_batches is)
            _, vmet = losses.value_loss(
                vals.reshape(N, *vals.shape[2:]), batch["old_values"], batch["returns"], mask,
                clip=algo.vf_clip, agg=algo.agg, max_len=algo.max_len, counts=counts)
            extra = {**vmet, "value_grad_norm": vgnorm}
            v_updates, new_vopt = value_optimizer.update(v_grads, state.value_opt_state,
                                                         state.value_params)
            critic_update = dict(
                value_params=keep(optax.apply_updates(state.value_params, v_updates),
                                  state.value_params),
                value_opt_state=keep(new_vopt, state.value_opt_state))
        updates, new_opt = optimizer.update(p_grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        router_state = keep(update_router_bias(cfg, state.router_state, expert_counts),
                            state.router_state)
        new_state = state.replace(  # keeps the class (TrainState / CriticTrainState)
            params=keep(new_params, state.params), router_state=router_state,
            opt_state=keep(new_opt, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
            skipped=state.skipped + (~finite).astype(jnp.int32), **critic_update)
        met = {**met, **extra, "loss": loss, "grad_norm": gnorm, "skipped": new_state.skipped,
               "update_finite": finite.astype(jnp.float32),
               "target_tokens": n_targets}
        return new_state, met

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_logp_fn(model: Model):
    """Jitted teacher-forced log-probs [N,L] (position t = log p(tok_t | tok_<t), 0 elsewhere)
    for old_logp / ref_logp; no MTP, no gradients."""

    @jax.jit
    def logp_fn(variables, tokens, loss_mask):
        out = model.apply(variables, tokens, _input_valid(loss_mask), with_mtp=False)
        lp = _pad_left(token_logprobs(out.logits[:, :-1], tokens[:, 1:]))
        return jnp.where(loss_mask, lp, 0.0)

    return logp_fn


def make_logp_value_fn(model: Model, critic: CriticConfig):
    """Jitted rollout-time forward of an algorithm with a critic: (old_logp, old_values), both
    [N,L] f32, 0 outside loss_mask, from ONE forward (the value head reads its hidden states).
    Call as fn(state.variables, state.value_params, tokens, loss_mask); no MTP, no gradients."""

    @jax.jit
    def logp_value_fn(variables, value_params, tokens, loss_mask):
        out = model.apply(variables, tokens, _input_valid(loss_mask), with_mtp=False)
        lp = _pad_left(token_logprobs(out.logits[:, :-1], tokens[:, 1:]))  # [N,L]
        v = token_values(critic, value_params, out.hidden)  # [N,L]
        return jnp.where(loss_mask, lp, 0.0), jnp.where(loss_mask, v, 0.0)

    return logp_value_fn


def make_sft_step(model: Model, optimizer: optax.GradientTransformation, *, donate: bool = True):
    """Supervised step on packed rows: next-token + MTP (+ MoE aux, indexer KL) loss from
    model.objectives.lm_loss over loss_mask (completion) targets; same state and guard as RL."""
    from model.objectives import lm_loss

    def step(state: TrainState, batch: dict):
        tokens, mask = batch["tokens"], batch["loss_mask"]

        def loss_fn(params):
            out = model.apply({"params": params, "router_state": state.router_state}, tokens,
                              _input_valid(mask))
            loss, met = lm_loss(out, tokens, mask, model.cfg)
            return loss, (met, out.expert_counts)

        (loss, (met, ecounts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(gnorm) & jnp.isfinite(loss)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        router_state = keep(update_router_bias(model.cfg, state.router_state, ecounts),
                            state.router_state)
        new_state = TrainState(
            params=keep(optax.apply_updates(state.params, updates), state.params),
            router_state=router_state, opt_state=keep(new_opt, state.opt_state),
            step=state.step + finite.astype(jnp.int32),
            skipped=state.skipped + (~finite).astype(jnp.int32))
        return new_state, {**met, "grad_norm": gnorm, "skipped": new_state.skipped}

    return jax.jit(step, donate_argnums=(0,) if donate else ())
