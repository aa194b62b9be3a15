"""A phase's optimizer and train state: SFT's optimizer configs (optim_config, optim_numerics) and
RL's (rl_optimizers: with a critic, its value head's too), RL's seed, and RL's fresh train state,
built sharded (init_rl_state) or from shapes alone (abstract_rl_state)."""

from __future__ import annotations

import jax

from model import sharding as shd
from model.transformer import Model
from rl.critic import CriticConfig, critic_optim_config, init_value_params
from rl.train_step import (
    init_train_state,
    init_train_state_sharded,
    make_optimizer,
    train_state_shardings,
)


def optim_numerics(config) -> dict:
    """The optimizer's numerics fields of config.optim (mu_dtype, master_dtype), shared by the
    SFT phases' optimizers."""
    return {k: getattr(config.optim, k) for k in ("mu_dtype", "master_dtype")}


def optim_config(lr, warmup, total, wd, numerics=None):
    import ml_collections
    return ml_collections.ConfigDict(dict(lr=lr, warmup_steps=warmup, total_steps=total,
                                          final_lr_frac=0.1, weight_decay=wd, b1=0.9, b2=0.99,
                                          eps=1e-8, clip_norm=1.0, **(numerics or {})))


def rl_optimizers(config, algo) -> tuple:
    """(optimizer, critic, value optimizer) of the RL run: config.optim's optimizer; with a
    critic (algo.needs_values) its config (config.rl.critic, rl/critic.py) and optimizer
    (config.optim with lr * critic.lr_scale), else both None."""
    if not algo.needs_values:
        return make_optimizer(config.optim), None, None
    critic = CriticConfig.from_config(config.rl.critic)
    return (make_optimizer(config.optim), critic,
            make_optimizer(critic_optim_config(config.optim, critic)))


def rl_state_shapes(config, model: Model, algo):
    """init_rl_state's fresh state as ShapeDtypeStructs (no shardings), from shapes alone."""
    return jax.eval_shape(
        lambda: init_rl_state(config, model, algo, model.init(jax.random.key(0)))[0])


def abstract_rl_state(config, model: Model, algo, *, mesh, rules=None):
    """The fresh RL train state of init_rl_state as ShapeDtypeStructs with its shardings on
    `mesh`, computed from shapes alone (no weights loaded, nothing allocated): what checkpoints
    restore into and what the update's programs compile against before the state exists."""
    abstract = rl_state_shapes(config, model, algo)
    opt, _, value_opt = rl_optimizers(config, algo)
    return shd.sharded_abstract(abstract, train_state_shardings(
        model, opt, mesh, rules, value_params=getattr(abstract, "value_params", None),
        value_optimizer=value_opt))


def init_rl_state(config, model: Model, algo, init_vars: dict, *, mesh=None, rules=None):
    """The fresh RL train state for `algo`: (state, optimizer, critic, value optimizer) (the last
    three rl_optimizers'). With a critic (algo.needs_values) the state holds a new value head
    (config.rl.critic, rl/critic.py) and its optimizer state; else critic and value optimizer
    are None. mesh/rules: the state is created straight into its shardings
    (rl.train_step.train_state_shardings; init_vars sharded or not, they are not donated)."""
    opt, critic, value_opt = rl_optimizers(config, algo)
    value_params = None
    if critic is not None:
        value_params = init_value_params(critic, model.cfg,
                                         jax.random.fold_in(jax.random.key(config.rl_seed()), 2))
    if mesh is None:
        state = init_train_state(init_vars, opt, value_params=value_params,
                                 value_optimizer=value_opt)
        return state, opt, critic, value_opt
    if value_params is not None:  # the same values on every process: replicated global arrays
        value_params = shd.replicate(jax.device_get(value_params), mesh)
    sh = train_state_shardings(model, opt, mesh, rules, value_params=value_params,
                               value_optimizer=value_opt)
    state = init_train_state_sharded(init_vars, opt, sh, value_params=value_params,
                                     value_optimizer=value_opt)
    return state, opt, critic, value_opt
