"""The critic of PPO-style algorithms: a value head on the policy trunk's hidden states.

    critic = CriticConfig.from_config(config.rl.critic)          # detached=True, hidden_dim=0, ...
    value_params = init_value_params(critic, model.cfg, rng)    # own params (not in the policy's)
    out = model.apply(variables, tokens, valid)                 # the policy forward
    values = token_values(critic, value_params, out.hidden)     # [N,L]: V at each target position

The head reads ``ModelOutput.hidden`` (the trunk output before the final norm, [N,L,D]) of the
same forward that produces the policy logits, so a critic costs one RMSNorm + Dense per token, not
a second model. Its params live beside the policy's in ``rl.train_step.TrainState.value_params``
(with their own optimizer state), ``None`` for critic-free algorithms.

Alignment (as the log-probs, see ``rl.sampler.pack``): position t of a packed row holds target
token t, the action taken in state tok_<t, whose representation is hidden[t-1]. So
``values[:, t] = head(hidden[:, t-1])`` and position 0 (never a target) holds 0.

Gradient routing (``CriticConfig.detached``): detached (default) stops the gradient at ``hidden``,
so the value loss trains the head only and the policy's gradient is exactly the policy objective's
(stable: a badly scaled value loss cannot disturb the policy); shared lets the value loss train the
trunk as well (more signal to the representation, but vf_coef then trades off against the policy
loss in the trunk's update).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.layers.norms import RMSNorm


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The value head and how it trains (hashable: a static argument of the train step).

    detached: True (default) = stop_gradient on the trunk's hidden states: the value loss updates
      only the head's params. False = shared trunk: the value-loss gradient also flows into the
      policy params (scaled by the algorithm's vf_coef, through the policy's optimizer).
    hidden_dim: 0 = linear head, RMSNorm -> Dense(d_model -> 1); > 0 = 2-layer MLP,
      RMSNorm -> Dense(d_model -> hidden_dim) -> GELU -> Dense(hidden_dim -> 1).
    lr_scale: the critic's learning rate is optim.lr * lr_scale (same warmup/cosine schedule,
      clipping and AdamW settings, its own optimizer state and global-norm clip). Critics are
      usually trained faster than the policy (verl's defaults: 10x); the head's output layer
      starts at zero, so V = 0 before the first update.
    """

    detached: bool = True
    hidden_dim: int = 0
    lr_scale: float = 10.0

    def __post_init__(self):
        if not isinstance(self.detached, bool):
            raise ValueError(f"CriticConfig.detached={self.detached!r}: expected a bool")
        if not (isinstance(self.hidden_dim, numbers.Integral) and not isinstance(
                self.hidden_dim, bool) and self.hidden_dim >= 0):
            raise ValueError(f"CriticConfig.hidden_dim={self.hidden_dim!r}: expected an int >= 0 "
                             "(0 = linear head)")
        if not (isinstance(self.lr_scale, numbers.Real) and not isinstance(self.lr_scale, bool)
                and self.lr_scale > 0):
            raise ValueError(f"CriticConfig.lr_scale={self.lr_scale!r}: expected a number > 0")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> CriticConfig:
        """From a dict / ml_collections.ConfigDict (missing keys take the defaults)."""
        d = dict(config.to_dict() if hasattr(config, "to_dict") else (config or {}))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown CriticConfig fields {unknown}; valid: {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ValueHead(nn.Module):
    """hidden [..., D] -> scalar values [...] (f32). The output layer is zero-initialised."""

    hidden_dim: int = 0
    eps: float = 1e-6

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        x = RMSNorm(self.eps, name="norm")(h.astype(jnp.float32))  # [..., D]
        if self.hidden_dim:
            x = nn.gelu(nn.Dense(self.hidden_dim, name="hidden")(x))  # [..., H]
        v = nn.Dense(1, kernel_init=nn.initializers.zeros, name="out")(x)  # [..., 1]
        return v[..., 0]


def _head(critic: CriticConfig) -> ValueHead:
    return ValueHead(hidden_dim=critic.hidden_dim)


def init_value_params(critic: CriticConfig, model_cfg, rng: jax.Array) -> dict:
    """The head's params for a trunk of width model_cfg.d_model (plain arrays, no boxes)."""
    h = jnp.zeros((1, 1, model_cfg.d_model), jnp.float32)  # [B,T,D]
    variables = _head(critic).init(rng, h)
    return nn.meta.unbox(variables)["params"]


def token_values(critic: CriticConfig, value_params: dict, hidden: jax.Array) -> jax.Array:
    """Values [N,L] f32 aligned with the targets: position t = V(tok_<t) = head(hidden[:, t-1]),
    position 0 = 0. hidden [N,L,D] from ModelOutput.hidden; stop-gradient when critic.detached.
    Not masked: callers mask (rl_loss / value_loss ignore masked positions)."""
    if critic.detached:
        hidden = jax.lax.stop_gradient(hidden)
    v = _head(critic).apply({"params": value_params}, hidden[:, :-1])  # [N,L-1]
    return jnp.pad(v, ((0, 0), (1, 0)))  # [N,L]


def critic_optim_config(optim, critic: CriticConfig):
    """The critic's optimizer config: a copy of ``optim`` (a run config's optim section, or a
    mapping) with lr scaled by critic.lr_scale."""
    import ml_collections

    if dataclasses.is_dataclass(optim):
        return dataclasses.replace(optim, lr=float(optim.lr) * float(critic.lr_scale))
    d = dict(optim.to_dict() if hasattr(optim, "to_dict") else optim)
    d["lr"] = float(d["lr"]) * float(critic.lr_scale)
    return ml_collections.ConfigDict(d)


__all__ = [
    "CriticConfig",
    "ValueHead",
    "critic_optim_config",
    "init_value_params",
    "token_values",
]
