"""What model/config.py and the layers' config classes share: `ConfigError` and its checks
(`require`, `check_kernel`), the kernel impl names, and the MoE section (`MoEConfig` with the
choices of its fields).

A leaf: it imports nothing from the repository, so the layers (model/layers/*.py) import it and
model/config.py builds on it without either importing the other; model.config re-exports every
name here, and code outside model/layers reads them from there.
"""

from __future__ import annotations

import dataclasses

ROUTERS = ("softmax", "sigmoid")
DISPATCH = ("dropless", "capacity")
GROUPED_MATMUL = ("auto", "ragged_dot", "blocked")  # model/layers/moe.py:grouped_matmul
EXPERT_PARALLEL = ("none", "all_to_all", "ragged_all_to_all")  # model/layers/moe.py
EXPERT_FORMATS = ("bf16", "mxfp4")
# impl names of every kernel choice in a model config (kda.impl, dsa.impl, moe.mxfp4_impl); what
# each op can take is its dispatch table's business (pallas_kernels/dispatch.py, `check_kernel`)
KERNEL_IMPLS = ("auto", "xla", "pallas")


class ConfigError(ValueError):
    """A model configuration field is missing, unknown or inconsistent."""


def require(cond: bool, field: str, msg: str) -> None:
    """Raise ConfigError("<field>: <msg>") unless cond (section validators use it too)."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def set_dotted(config, overrides, what: str = "config") -> None:
    """Set dotted-path fields of a ConfigDict in place ({"moe.qat": True}), the Python
    counterpart of --config.x.y=v; a path the config lacks raises KeyError naming it and `what`
    (ml_collections would not create the field on assignment)."""
    for key, v in overrides.items():
        node = config
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        if leaf not in node:
            raise KeyError(f"{what} has no field {key!r}")
        node[leaf] = v


def check_kernel(table, impl: str, field: str, hint: str = "", **facts) -> None:
    """Config-time kernel choice: `impl` must be a KERNEL_IMPLS name, and an explicit one must
    be able to take the op's calls as far as the config knows them (`facts`: head dims, dtype;
    `table` a pallas_kernels.dispatch.OpTable). hint: which config fields the facts come from."""
    require(impl in KERNEL_IMPLS, field, f"must be one of {KERNEL_IMPLS}")
    why = table.problem(impl, **facts)
    require(why is None, field,
            f"{why}{' ' + hint if hint else ''}; or set {field}='auto' (runs the first of "
            f"{table.auto_order()} that can take the call) or 'xla'")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse feed-forward: routed experts + shared experts; first `first_dense_layers` are dense."""

    num_experts: int
    num_experts_per_tok: int
    expert_dim: int
    num_shared_experts: int = 1
    dense_dim: int = 0  # feed-forward width of the first dense layers (and MoE-free models)
    first_dense_layers: int = 0
    router: str = "sigmoid"  # "softmax" top-k or "sigmoid" + bias (auxiliary-loss-free)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # group-limited routing (DeepSeek-V3, router="sigmoid"): the experts form n_group equal
    # groups, a group's score is the sum of its two highest biased scores, and the top-k experts
    # are chosen only within the topk_group best groups; n_group=1 (default): no grouping
    n_group: int = 1
    topk_group: int = 1
    dispatch: str = "dropless"  # or "capacity" (drops past capacity, counted)
    # few tokens (decode steps, short prefills): where tokens x num_experts is at most this, no
    # assignment can be dropped (dropless, or a capacity >= the token count) and E/k <= 8, every
    # expert runs on every token, weighted by the router (model/layers/moe.py:takes_all_experts):
    # the same numbers without sorting, grouping or capacity buffers; 0 turns it off
    all_experts_max_rows: int = 2048
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.0  # sequence-wise load-balancing loss weight (alpha)
    bias_update_rate: float = 1e-3  # aux-free bias step (gamma)
    expert_format: str = "bf16"  # "mxfp4": experts stored as packed MXFP4
    qat: bool = False  # fake-quantise bf16 experts to MXFP4 in the forward (STE)
    mxfp4_impl: str = "auto"
    # Expert-parallel dispatch under model.sharding.use_mesh: "none" (GSPMD on the local path),
    # "all_to_all" (capacity-padded, every backend), "ragged_all_to_all" (GPU/TPU only).
    expert_parallel: str = "none"
    # dropless's grouped matmul: "ragged_dot" (lax.ragged_dot), "blocked" (block-padded batched
    # einsums), "auto" (blocked on CPU, where XLA's ragged_dot multiplies every row by every
    # expert; ragged_dot elsewhere)
    grouped_matmul: str = "auto"
