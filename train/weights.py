"""Where a run's weights come from: the final SFT weights (sft_checkpoint_dir,
load_sft_variables), the indexer warm-up's (load_warmup_variables), a released checkpoint's
(checkpoint_variables), the latest RL checkpoint's (load_rl_variables), the weights RL starts
from (initial_variables, rl.init_from) and its frozen reference policy (reference_variables).
Every loader restores straight into the shardings of a mesh."""

from __future__ import annotations

import os

import jax

from model import sharding as shd
from model.hf import import_hf
from model.transformer import Model
from rl.algorithms import algo_from_config
from rl.checkpoint import Checkpointer
from rl.train_step import indexer_mask, init_train_state, make_optimizer, train_state_shardings
from train.run_config import INIT_FROM, RunConfig
from train.state import optim_config, optim_numerics, rl_state_shapes


def _restore_variables(directory, model: Model, opt, mesh=None, rules=None, abstract_fn=None):
    """The variables of the latest good train state under `directory` (None if there is none),
    restored straight into their shardings on `mesh` (default: this process's first device),
    with no unsharded copy: the target is built from shapes only."""
    if abstract_fn is None:
        abstract = jax.eval_shape(
            lambda: init_train_state(model.init(jax.random.key(0)), opt))
    else:
        abstract = abstract_fn()
    if mesh is not None:
        vp = getattr(abstract, "value_params", None)
        abstract = shd.sharded_abstract(abstract, train_state_shardings(
            model, opt, mesh, rules, value_params=vp))
    ckpt = Checkpointer(directory, keep=2)
    restored = ckpt.restore_latest(abstract)
    ckpt.close()
    return None if restored is None else next(iter(restored)).variables


def sft_checkpoint_dir(config) -> str:
    """Where the final SFT weights live (what load_sft_variables and RL's init_from="sft" read):
    workdir/sft/checkpoints, or the QAT phase's workdir/sft/qat/checkpoints when sft.qat_steps
    > 0 (run_sft)."""
    sub = ("qat",) if config.sft.qat_steps else ()
    return os.path.join(config.workdir, "sft", *sub, "checkpoints")


def load_sft_variables(config, model: Model, *, mesh=None, rules=None) -> dict:
    """The final SFT weights (sft_checkpoint_dir; error if absent); sharded on `mesh` if
    given."""
    opt = make_optimizer(optim_config(1e-3, 1, 2, 0.0, optim_numerics(config)))
    d = sft_checkpoint_dir(config)
    v = _restore_variables(d, model, opt, mesh, rules)
    if v is None:
        raise FileNotFoundError(
            f"no SFT checkpoint under {d}: run scripts/sft.py with the same --config first"
            + (" (it runs the sft.qat_steps QAT phase after a finished SFT)"
               if config.sft.qat_steps else "") + ", or set --config.rl.init_from=scratch")
    return v


def load_warmup_variables(config, model: Model, *, mesh=None, rules=None) -> dict | None:
    """The weights after the indexer warm-up (workdir/sft/indexer_warmup), or None if the run
    had no warm-up checkpoint."""
    s = config.sft
    wopt = make_optimizer(optim_config(s.indexer_warmup_lr, 1, 2, 0.0, optim_numerics(config)),
                          trainable=indexer_mask)
    return _restore_variables(os.path.join(config.workdir, "sft", "indexer_warmup",
                                           "checkpoints"), model, wopt, mesh, rules)


def hf_checkpoint_dir(config) -> str:
    d = config.hf_dir
    if not d:
        raise ValueError("rl.init_from='hf' needs the checkpoint directory: set "
                         "--config.hf_dir=DIR (configs/rl.py:hf)")
    return d


def checkpoint_variables(config, model: Model, *, mesh=None, rules=None) -> dict:
    """The released checkpoint's weights (config.hf_dir, model.hf.import_hf) in `model`'s layout,
    streamed onto the model's shardings on `mesh` (one device without one)."""
    m = model.cfg
    cfg, variables = import_hf(hf_checkpoint_dir(config), dtype=m.dtype, param_dtype=m.param_dtype,
                               scan_layers=m.scan_layers, mesh=mesh, rules=rules)
    if cfg != m:
        raise ValueError(f"the checkpoint in {config.hf_dir} translates to another model config "
                         "than this run's model section: run with the section that "
                         "resolve_checkpoint gives (do not override model fields of an hf run)")
    return variables


def initial_variables(config, model: Model, *, mesh=None, rules=None) -> dict:
    """The weights RL starts from (rl.init_from): the final SFT weights (load_sft_variables:
    workdir, sft section) or a fresh init from config.seed; sharded on `mesh`."""
    init_from = config.rl.init_from
    if init_from == "sft":
        return load_sft_variables(config, model, mesh=mesh, rules=rules)
    if init_from == "scratch":
        return shd.init_sharded(model, jax.random.key(config.seed), mesh, rules)
    if init_from == "hf":
        return checkpoint_variables(config, model, mesh=mesh, rules=rules)
    raise ValueError(f"rl.init_from must be one of {INIT_FROM}, got {init_from!r}")


def reference_variables(init_vars: dict, state) -> dict:
    """The frozen reference policy's variables with exactly the tree structure of
    state.variables ({"params", "router_state"}, an empty router state included), so the
    log-prob forward compiled for the policy serves the reference without a recompile."""
    missing = set(state.variables) - set(init_vars) - {"router_state"}
    if missing:
        raise ValueError(f"the reference variables lack {sorted(missing)}")
    return {k: init_vars.get(k, {}) for k in state.variables}


def load_rl_variables(config, model: Model, directory: str | None = None, *, mesh=None,
                      rules=None) -> dict:
    """The latest good RL checkpoint's variables (workdir/rl/checkpoints or `directory`),
    restored into their shardings on `mesh` (default: this process's first device). A
    checkpoint written on any mesh and process count restores here."""
    config = RunConfig.from_config(config)
    algo = algo_from_config(config.rl.algo)  # with a critic the state holds a value head
    opt = make_optimizer(config.optim)
    d = directory or os.path.join(config.workdir, "rl", "checkpoints")
    v = _restore_variables(d, model, opt, mesh, rules,
                           abstract_fn=lambda: rl_state_shapes(config, model, algo))
    if v is None:
        raise FileNotFoundError(f"no RL checkpoint under {d}: run scripts/train_rl.py first")
    return v
