"""Launch checks of a run config, without training, sampling or touching the sandbox: what
`--dry_run` of the run scripts prints (validate_run_config; per phase check_run_config: the
mesh, the batch and group splits over devices and processes, the train state built for the mesh
as abstract arrays), the weights RL starts from (check_rl_start), and, at the start of a
multi-process job, that every process runs the same config (config_agreement)."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp

from model import sharding as shd
from model.config import ModelConfig
from rl.algorithms import algo_from_config
from rl.train_step import init_train_state, make_optimizer, train_state_shardings
from train.data import sft_domains, task_domains
from train.models import (
    config_model,
    model_config,
    qat_model,
    rl_model,
    trainable_experts,
)
from train.run_config import RunConfig
from train.sft import sft_dense_steps
from train.state import abstract_rl_state, optim_config, optim_numerics
from train.weights import hf_checkpoint_dir, sft_checkpoint_dir


def config_fields(config) -> dict[str, str]:
    """A run config flattened to {dotted field: repr(value)} (what config_agreement compares)."""
    out = {}

    def walk(node, prefix):
        for k in sorted(node.keys()):
            v = node[k]
            if hasattr(v, "keys") and hasattr(v, "items"):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = repr(v)

    walk(config.to_dict(), "")
    return out


def config_agreement(config) -> str:
    """Checks that every process runs this same config (a digest of config_fields exchanged
    through the distributed runtime: one all-gather of 32 bytes, and the fields only when the
    digests differ). Raises ValueError on every process naming the differing fields and the
    processes, so the job stops at start-up instead of training on mixed configs, failing in
    a collective or hanging. Returns a report line."""
    import hashlib

    n = jax.process_count()
    fields = config_fields(config)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    if n == 1:
        return f"  config digest {digest[:16]} (one process)"
    digests = shd.allgather_json(digest)
    if len(set(digests)) == 1:
        return f"  config digest {digest[:16]}: the same on all {n} processes"
    every = shd.allgather_json(fields)
    diff = []
    for key in sorted(set().union(*every)):
        vals = [f.get(key, "<absent>") for f in every]
        if len(set(vals)) > 1:
            by = {}
            for i, v in enumerate(vals):
                by.setdefault(v, []).append(i)
            diff.append(f"{key} (" + "; ".join(f"{v} on process(es) {ps}"
                                                for v, ps in by.items()) + ")")
    raise ValueError(f"the {n} processes run different configs; every process must run the "
                     f"same command. Differing fields: {', '.join(diff[:20])}"
                     + (f" and {len(diff) - 20} more" if len(diff) > 20 else ""))


def process_layout(shape: dict, rows: int, processes: int, rules=None) -> tuple[int, int]:
    """(row blocks, rows per process) of a batch of `rows` on a mesh of `shape` run by
    `processes` processes, each holding an equal contiguous block of the devices (the mesh's
    outer axes across hosts): the batch axes split the rows into row blocks, a process holds
    blocks / processes of them (or shares one block with the others when there are fewer
    blocks than processes)."""
    axes = shd.batch_axes(shape, rows, rules)
    blocks = math.prod(shape[a] for a in axes)
    return blocks, rows // min(blocks, processes)


def check_groups(config, shape: dict, processes: int, rules=None) -> str:
    """The RL batch's split over processes: each process generates, scores and computes the
    GRPO-style group statistics of its own rows, so its rows must hold whole groups
    (rl.pipeline.host_prompt_slice). Raises ValueError naming the numbers and the fix."""
    r = config.rl
    rows = r.prompts_per_batch * r.group_size
    blocks, per = process_layout(shape, rows, processes, rules)
    need = r.group_size * min(blocks, processes)
    if rows % need:
        raise ValueError(
            f"rl.prompts_per_batch={r.prompts_per_batch} x rl.group_size={r.group_size} = "
            f"{rows} rollout rows give each of the {processes} processes "
            f"{rows / min(blocks, processes):g} rows (the batch axes split them into {blocks} "
            f"blocks), which splits a group of {r.group_size}: "
            f"make the rollout rows a multiple of {need} (rl.prompts_per_batch a multiple of "
            f"{need // r.group_size})")
    return (f"  rollout rows per process: {per} (whole groups of {r.group_size}: "
            f"{per // r.group_size}; {processes} processes, {blocks} row blocks)")


def phase_optimizer(config, phase: str):
    """The optimizer whose state the phase's train state holds (rl: config.optim; sft: the SFT
    phase's), built as the drivers build it."""
    if phase == "rl":
        return make_optimizer(config.optim)
    s = config.sft
    return make_optimizer(optim_config(s.lr, s.warmup_steps, s.steps, s.weight_decay,
                                 optim_numerics(config)))


def abstract_train_state(config, shape: dict, phase: str = "rl"):
    """The phase's fresh train state as ShapeDtypeStructs with its shardings on an abstract mesh
    of `shape` (jax.sharding.AbstractMesh: no device needed, so a pod's mesh is built on a
    laptop; jax.eval_shape only, nothing allocated): the parameters by the rules, the
    optimizer state (an f32 master copy and moments included) like its parameters. What a run
    builds at start-up, so a layout that cannot be built fails here."""
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh(tuple(shape.values()), tuple(shape))
    rules = shd.rules_from_config(config)
    if phase == "rl":
        return abstract_rl_state(config, rl_model(config), algo_from_config(config.rl.algo),
                                 mesh=mesh, rules=rules)
    model, opt = config_model(config), phase_optimizer(config, phase)
    abstract = jax.eval_shape(lambda: init_train_state(model.init(jax.random.key(0)), opt))
    return shd.sharded_abstract(abstract, train_state_shardings(model, opt, mesh, rules))


def state_bytes_per_device(state) -> int:
    """Bytes one device holds of an abstract sharded state (each leaf's shard shape)."""
    total = 0
    for x in jax.tree.leaves(state):
        total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def default_processes(num_devices: int) -> int:
    """The process count a launch check assumes: this job's when it checks this job's devices,
    else one process per 4 devices (a TPU host; an 8-GPU node runs half as many processes, which
    only makes each hold more rows)."""
    if num_devices == jax.device_count():
        return jax.process_count()
    return max(num_devices // 4, 1)


def check_run_config(config, num_devices: int, phase: str = "rl",
                     processes: int | None = None, state: bool = True) -> str:
    """Validate a run config for a job of `num_devices` devices run by `processes` processes
    (default_processes) without touching any device: the model config, the mesh
    (config.sharding.mesh, -1 resolved), the rules, the expert axis against num_experts when
    the MoE is expert-parallel, trainable experts (trainable_experts), how the phase's batches
    split (rows over the batch axes; an axis that does not divide leaves them replicated over
    it), RL's rows per process against the group size (check_groups), and, with `state`, the
    phase's train state and optimizer-state shardings built for the real mesh
    (abstract_train_state). Raises ValueError on what cannot run; returns a report (warnings
    included)."""
    config = RunConfig.from_config(config)
    cfg = model_config(config)
    shape = shd.mesh_shape(config.sharding.mesh, num_devices)
    rules = shd.rules_from_config(config)
    processes = processes or default_processes(num_devices)
    lines = [f"config {config.name}: model {cfg.name}, mesh "
             + ",".join(f"{a}={n}" for a, n in shape.items()) + f" ({num_devices} devices, "
             f"{processes} processes)"]
    ep = shape["expert"]
    if cfg.moe.num_experts and cfg.moe.expert_parallel != "none" and cfg.moe.num_experts % ep:
        divs = [d for d in range(2, 257) if cfg.moe.num_experts % d == 0][:8]
        raise ValueError(f"model.moe.num_experts={cfg.moe.num_experts} is not divisible by the "
                         f"expert axis ({ep}): expert parallelism cannot run on this mesh; use "
                         f"an expert axis in {divs} (--config.sharding.mesh)")
    trainable_experts(cfg, {"sft": "SFT", "rl": "RL"}[phase])
    full = math.prod(shape[a] for a in rules["batch"] if a in shape)
    batches = {"sft": {"sft.batch_size": config.sft.batch_size},
               "rl": {"rollout rows (rl.prompts_per_batch x rl.group_size)":
                      config.rl.prompts_per_batch * config.rl.group_size,
                      "eval rows (eval.batch_prompts)": config.eval.batch_prompts}}[phase]
    for what, n in batches.items():
        axes = shd.batch_axes(shape, n, rules)
        split = math.prod(shape[a] for a in axes)
        lines.append(f"  {what} = {n}: split {split} ways over {', '.join(axes) or 'nothing'}")
        if split < full:
            lines.append(f"  warning: {what} = {n} is not divisible by the {full} devices of "
                         f"the batch axes {rules['batch']}: rows are replicated over the rest")
    if phase == "rl":
        lines.append(check_groups(config, shape, processes, rules))
    if state:
        st = abstract_train_state(config, shape, phase)
        lines.append(f"  {phase} train state built for this mesh (abstract): "
                     f"{len(jax.tree.leaves(st))} arrays, "
                     f"{state_bytes_per_device(st) / 1e9:.2f} GB per device")
    return "\n".join(lines)


def check_rl_start(config, required: bool = True) -> str:
    """The weights an RL run starts from (rl.init_from): with "sft", whether the SFT checkpoint
    (sft_checkpoint_dir) is there. `required`: a missing one raises ValueError (the job at
    hand would fail at start-up); else (checking another machine's job) a report line."""
    init_from = config.rl.init_from
    if init_from == "scratch":
        return f"  RL starts from a fresh init (seed {config.seed})"
    if init_from == "hf":
        return f"  RL starts from the released checkpoint in {hf_checkpoint_dir(config)}"
    d = sft_checkpoint_dir(config)
    found = os.path.isdir(d) and any(n.isdigit() for n in os.listdir(d))
    if found:
        return f"  RL starts from the SFT checkpoint in {d}"
    msg = (f"rl.init_from='sft' but there is no SFT checkpoint under {d}: run scripts/sft.py "
           "with the same --config first, or set --config.rl.init_from=scratch")
    if required:
        raise ValueError(msg)
    return f"  warning: {msg} (not found on this machine; the job needs it in its workdir)"


def resolve_devices(config, num_devices: int | None = None) -> int:
    """The device count a launch check is for: `num_devices` when given, else the mesh's own
    size when config.sharding.mesh sizes every axis (a pod launch line), otherwise this host's
    devices (so XLA_FLAGS' fake device count applies)."""
    if num_devices:
        return int(num_devices)
    d = shd.parse_mesh(config.sharding.mesh)
    return math.prod(d.values()) if d and -1 not in d.values() else jax.device_count()


def validate_run_config(config, phases=("sft", "rl"), num_devices: int | None = None,
                        processes: int | None = None) -> str:
    """What `--dry_run` of the run scripts prints: everything a run would reject at start-up,
    checked without training, sampling or touching the sandbox (so a launch line is cheap to
    check): the model config, the RL algorithm (preset plus overrides, rl/algorithms.py), the
    task domains, and each phase's mesh, batch and group splits and train state built for the
    mesh (check_run_config) for `num_devices` (resolve_devices) run by `processes`.
    Raises ValueError on what cannot run; returns a report."""
    config = RunConfig.from_config(config)  # every field's type and range; hf_dir's model
    num_devices = resolve_devices(config, num_devices)
    algo = algo_from_config(config.rl.algo)
    oversample = config.rl.oversample if "rl" in phases else 1
    doms, sft_doms = task_domains(config), sft_domains(config)
    lines = [check_run_config(config, num_devices, phase=p, processes=processes)
             for p in phases]
    if "sft" in phases and (dense := sft_dense_steps(config, model_config(config))):
        lines.append(f"  SFT dense stage: the first {dense} of {config.sft.steps} steps attend "
                     "densely (indexer KL over every causal key), "
                     + ("the rest" if dense < config.sft.steps else "RL and sampling")
                     + " through the top-k")
    if qat := config.sft.qat_steps:  # SFT runs the phase; RL starts from its weights
        qat_model(ModelConfig.from_dict(config.model))
        lines.append(f"  SFT QAT phase: {qat} steps (lr {config.sft.qat_lr}, MXFP4 fake-quantised"
                     f" experts), checkpoints in {sft_checkpoint_dir(config)}: the SFT weights "
                     "RL starts from")
    lines.append(f"  algorithm {algo.name}: estimator {algo.estimator}, clip "
                 f"[{algo.clip_low}, {algo.clip_high}], agg {algo.agg}, KL {algo.kl_kind} x "
                 f"{algo.kl_coef} in the {algo.kl_placement}; tasks {', '.join(doms)}"
                 + (f" (SFT: {', '.join(sft_doms)})" if sft_doms != doms else "")
                 + f"; workdir {config.workdir}")
    if oversample > 1:
        lines.append(f"  dynamic sampling: {oversample} batches' prompts drawn per update, one "
                     "batch of groups trained (informative groups first)")
    if "rl" in phases and config.rl.seed is not None:
        lines.append(f"  RL seed {config.rl_seed()} (prompt order, rollout draws; SFT: seed "
                     f"{config.seed})")
    if "rl" in phases and (power := config.rl.template_power) != 1.0:
        lines.append(f"  RL prompts drawn per template: each domain's draws split over its "
                     f"templates as count ** {power:g}")
    return "\n".join(lines)
