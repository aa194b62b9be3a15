"""Drivers: SFT on generated demonstrations and the RL loop, plus what the evaluation scripts share
with them (rollout workers, checkpoint loaders; the task splits and SFT's demonstrations are
rl/data.py's, re-exported here).

    run_sft(config)    -> TrainState     workdir/sft/{checkpoints, metrics.jsonl, events}
    run_rl(config)     -> TrainState     workdir/rl/{checkpoints, metrics.jsonl, events}
    load_sft_variables / load_rl_variables + make_rollout_worker + rl.pipeline.evaluate:
                                         per-domain pass@1 with 95% intervals (scripts/evaluate.py)

Both read one run config (configs/rl.py), validated into train/run_config.py's frozen RunConfig
(a ConfigDict given to them is converted first); run_rl's helpers each get their own section of
it (config.rl, config.rl.agent, config.eval). Every run is resumable: checkpoints hold
the train state (with a critic: the value head and its optimizer state), rng and data-iterator
position; the frozen reference policy is not stored (it is the initial weights, reloaded on
resume). `resume=True` picks up at the last good checkpoint and continues exactly (same data
order, same rng stream), once the workdir's recorded config is found to match on what the phase
depends on (rl/workdir.py: else an error naming the fields); `resume=False` moves a previous run's
phase directory aside (start_phase).

RL iteration (one batch of lookahead when rl.overlap_scoring): generate batch i+1 while the
sandbox scores batch i; then, in a separate forward, the reference log-probs where the KL is
folded into the rewards or rl.ref_logp_pass="separate" (otherwise the train step computes them
from the reference variables in its own program: ref_logp_source), and, where the advantages
need them first (algorithms with a critic such as PPO: the value head's old values from the same
forward; KL in the rewards) or rl.old_logp_pass="always", the old log-probs (otherwise the train
step's own log-probs, stop-gradient, are the old ones: the same numbers, one forward less;
old_logp_source); advantages (GAE with returns for PPO); one jit train step on batch i (its MTP
term weighted by rl.mtp_loss_weight when set). The critic's params
and optimizer state live in the train state and are checkpointed with it.
Timings per iteration are split into generate / score-wait / train, and the fraction of scoring
time hidden behind generation is logged (score_hidden_frac).

Compiles ahead (single process): the update's programs (train step per row width, rollout-time
forward, advantages) compile on a thread behind the first evaluation and rollouts
(precompile_updates, rl.precompile), from the train state's shapes and shardings
(abstract_rl_state) while the weights load when the rollout-time forward has nothing to run
(the default GRPO), else from the state once it exists; SFT's steps compile two at a time on
threads, SFT's own while the indexer warm-up trains (supervised_step).

Row widths: one-shot rows and multi-turn episodes (rl/agent.py) never share a batch. SFT
batches come from one length bucket each (sft_buckets: sft.seq_len / sft.episode_seq_len, mixed
by step share), RL prompt batches from one kind each
(task_dataset(group_by=is_multi_turn_task)), and each RL batch is packed at its kind's width
(train_width): two compiled shapes per phase, and a one-shot row is never padded to an
episode's width.

Scale-out (docs/scaling.md): every driver runs on the mesh of config.sharding
(model.sharding.mesh_from_config; one device for the CPU configs). Parameters are initialised
(or restored) straight into their shardings, the optimizer state is created sharded, the frozen
reference policy is a sharded copy, and the train step, the log-prob forward and the sampler are
MeshJit programs with explicit shardings (the train state donated). In a multi-process job (one
process per host, model.sharding.maybe_initialize_distributed) every process checks at start-up
that all run the same config (config_agreement), reads only its own rows of each global SFT
batch (_sft_stream), iterates the same global RL prompt stream and keeps its rows
(rl.pipeline.host_prompt_slice; a stream that ends on any process ends the job on every one:
next_global_batch), generates and scores its
own rollouts in its own sandbox pool, and the global batch the trainer sees is assembled from
every process's rows (model.sharding.to_global); host-side metrics are reduced over processes
(model.sharding.reduce_host_metrics) and written by process 0; evaluation is split over the
processes and gathered once; checkpoints are written and restored sharded by every process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd
from model.config import ModelConfig
from model.hf import import_hf
from model.tokenizer import load_tokenizer
from model.transformer import Model
from rl.algorithms import algo_from_config
from rl.checkpoint import Checkpointer
from rl.critic import CriticConfig, critic_optim_config, init_value_params
from rl.data import (
    agent_env_config,
    load_task_splits,
    phase_data,
    sft_domains,
    sft_examples,  # noqa: F401  (re-exported: rl.loop is where scripts import it)
    sft_train_examples,
    task_domains,
)
from rl.data import balanced as _balanced
from rl.data import is_episode as _is_episode
from rl.metrics import MetricsWriter
from rl.pipeline import (
    PendingSelection,
    RolloutWorker,
    ScoredGroup,
    build_train_batch,
    evaluate,
    host_prompt_slice,
    task_dataset,
)
from rl.sampler import SamplingConfig
from rl.train_step import (
    TrainState,
    indexer_mask,
    init_train_state,
    init_train_state_sharded,
    kl_in_loss,
    make_logp_fn,
    make_logp_value_fn,
    make_optimizer,
    make_sft_step,
    make_train_step,
    train_state_shardings,
)
from rl.workdir import check_resumable, record_data, set_aside
from sandbox.tasks.domains import is_multi_turn_task
from train.run_config import INIT_FROM, RunConfig

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- model
def _model(config) -> Model:
    return Model(model_config(config))


def model_config(config) -> ModelConfig:
    """config.model as a ModelConfig, checked against config.tokenizer: every token id must
    have an embedding row (e.g. "byte_tools" needs model.vocab_size >= 263)."""
    cfg = ModelConfig.from_dict(config.model)
    n = load_tokenizer(config.tokenizer).vocab_size
    if n > cfg.vocab_size:
        raise ValueError(f"tokenizer {config.tokenizer!r} has {n} ids but model.vocab_size is "
                         f"{cfg.vocab_size}: set --config.model.vocab_size={n}")
    return cfg


def _open_pool(config):
    from sandbox import connect
    from sandbox.verifiers import Verifier

    s = config.sandbox
    if s.remote:
        pool = connect([u.strip() for u in s.remote.split(",") if u.strip()],
                       max_concurrency=client_concurrency(config))
    else:
        pool = connect("local", workers=s.workers)
    return pool, Verifier(executor=pool, reuse=s.reuse_verdicts)


def client_concurrency(config) -> int:
    """Requests this process keeps in flight to a remote sandbox fleet: sandbox.client_concurrency
    when set, else ceil(sandbox.fleet_slots / process count) (together the processes fill every
    fleet slot and queue nothing on the servers), else 16."""
    s = config.sandbox
    if s.client_concurrency:
        return int(s.client_concurrency)
    if s.fleet_slots:
        return max(1, -(-int(s.fleet_slots) // jax.process_count()))
    return 16


def _primary() -> bool:
    return jax.process_index() == 0


def _progress(total, desc, initial=0):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True, leave=True)


# --------------------------------------------------------------------------- SFT
def _sft_rows(tokenizer, seq_len):
    """(prompt, completion, ok) -> dict(tokens [L], loss_mask [L]) with the completion + EOS as
    targets; a multi-turn episode (_is_episode) is rendered by rl.agent.encode_episode (the
    assistant's tokens are targets, observations not)."""
    from rl.agent import encode_episode

    def encode(ex):
        prompt, completion = ex[0], ex[1]
        if _is_episode(ex):
            ids, target = encode_episode(tokenizer, prompt, completion)
        else:
            p = tokenizer.encode(tokenizer.chat_prompt(prompt), bos=True)
            c = tokenizer.encode(completion, eos=True)
            ids, target = p + c, [False] * len(p) + [True] * len(c)
        if len(ids) > seq_len:
            field = "episode_seq_len" if _is_episode(ex) else "seq_len"
            raise ValueError(f"SFT example of {len(ids)} tokens exceeds sft.{field}="
                             f"{seq_len}: raise sft.{field}. Prompt: {prompt[:60]!r}")
        tok = np.full(seq_len, tokenizer.pad_id, np.int32)
        mask = np.zeros(seq_len, bool)
        tok[: len(ids)] = ids
        mask[: len(ids)] = target
        return {"tokens": tok, "loss_mask": mask}
    return encode


def make_rollout_worker(r, model, tok, sampling, verifier, executor, *, group_size: int,
                        tasks=(), mesh=None, rules=None):
    """The rollout worker of a run from the RL section `r` (config.rl: max_prompt_len,
    share_prefix, rollout_slots, agent): rl.pipeline.RolloutWorker for one-shot tasks, wrapped
    in an rl.agent.RoutingWorker with an AgentRolloutWorker (rl.agent: width, turn_tokens, the
    environment's caps) when any of `tasks` is a multi-turn task. A mesh of one device in a
    single process counts as none."""
    from rl.agent import AgentRolloutWorker, RoutingWorker

    if mesh is not None and mesh.size == 1 and jax.process_count() == 1:
        # one device: nothing to shard, so the samplers run as plain jitted programs on it, fed
        # the variables placed plainly on that device: the same programs, for the same
        # argument placement, as workers made without a mesh (e.g. the demo's evaluation),
        # so they compile once
        device = mesh.devices.flat[0]
        return _OnDevice(make_rollout_worker(r, model, tok, sampling, verifier, executor,
                                             group_size=group_size, tasks=tasks), device)
    worker = RolloutWorker(model, tok, sampling, verifier, group_size=group_size,
                           max_prompt_len=r.max_prompt_len, mesh=mesh, rules=rules,
                           share_prefix=bool(r.share_prefix), slots=int(r.rollout_slots))
    if not any(is_multi_turn_task(t) for t in tasks):
        return worker
    a = r.agent
    agent = AgentRolloutWorker(
        model, tok, dataclasses.replace(sampling, max_new_tokens=int(a.turn_tokens)), executor,
        group_size=group_size, width=int(a.width), env_config=agent_env_config(a),
        mesh=mesh, rules=rules, cache_turns=bool(a.cache_turns))
    return RoutingWorker(worker, agent)


class _OnDevice:
    """A rollout worker made without a mesh, whose `start` places the variables it is given
    (e.g. a train state's, laid out on a one-device mesh) on `device` as single-device arrays
    first; everything else is the worker's."""

    def __init__(self, worker, device):
        self._worker, self._device = worker, device

    def start(self, variables, *args, **kwargs):
        return self._worker.start(jax.device_put(variables, self._device), *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._worker, name)


def workers_by_temperature(r, model, tok, sampling, verifier, executor, *, tasks=()):
    """worker_at(temperature) -> the rollout worker of `make_rollout_worker` (group size 1)
    sampling at that temperature, made on first use and kept; every one shares the compiled
    sampler programs (the temperature is a traced argument). For rl.pipeline's
    temperature_sweep / evaluate_at_best_temperatures."""
    workers = {}

    def worker_at(temperature: float):
        if temperature not in workers:
            workers[temperature] = make_rollout_worker(
                r, model, tok, dataclasses.replace(sampling, temperature=temperature), verifier,
                executor, group_size=1, tasks=tasks)
        return workers[temperature]

    return worker_at


def train_width(r, tasks=()) -> int:
    """Width of the packed train rows from the RL section `r` (config.rl): one-shot rows
    (max_prompt_len + max_new_tokens), or the multi-turn episode width (agent.width) when any
    task is multi-turn."""

    w = r.max_prompt_len + r.max_new_tokens
    return max(w, int(r.agent.width)) if any(is_multi_turn_task(t) for t in tasks) else w


def sft_buckets(examples, s) -> list[dict]:
    """SFT examples split by row width (sft section `s`): one-shot rows padded to sft.seq_len,
    multi-turn episodes (a list of turns as the completion) to sft.episode_seq_len, each bucket
    with its batch size (sft.batch_size, sft.episode_batch_size) and its share of the steps
    (sft.episode_share for the episodes; None: proportional to the bucket's batches per epoch,
    so every example is seen equally often). A batch holds one bucket's rows only, so each
    width is one compiled step and a one-shot row never pays for an episode's width.
    -> [{"examples", "width", "batch_size", "weight"}] (one or two buckets)."""
    one = [ex for ex in examples if not _is_episode(ex)]
    eps = [ex for ex in examples if _is_episode(ex)]
    ep_width = int(s.episode_seq_len or s.seq_len)
    ep_batch = int(s.episode_batch_size or s.batch_size)
    buckets = [dict(examples=one, width=int(s.seq_len), batch_size=int(s.batch_size)),
               dict(examples=eps, width=ep_width, batch_size=ep_batch)]
    buckets = [b for b in buckets if b["examples"]]
    if not buckets:
        raise ValueError("no SFT examples: check sft.domains (empty: tasks.domains) and "
                         "tasks.train_per_domain")
    for b in buckets:
        b["weight"] = len(b["examples"]) / b["batch_size"]
    share = s.episode_share  # in (0, 1) (train/run_config.py)
    if share is not None and len(buckets) == 2:
        buckets[0]["weight"], buckets[1]["weight"] = 1.0 - share, share
    return buckets


def _sft_stream(examples, tok, s, seed, *, mesh=None, rules=None):
    """The SFT batch stream: each bucket of sft_buckets encoded (up front, so a row over its
    width fails before training), shuffled, repeated and batched, the buckets' batches
    interleaved by their weights (grain.MapDataset.mix, deterministic). With `mesh`, each
    process's stream yields only its own rows of each global batch (shd.host_batch_slice; grain
    reads them by index from the global shuffled order), so the global batches and their order
    do not depend on the process count and no process assembles the others' rows."""
    import sys

    import grain
    streams, weights = [], []
    for b in sft_buckets(examples, s):
        rows = list(map(_sft_rows(tok, b["width"]), b["examples"]))
        order = grain.MapDataset.source(rows).shuffle(seed=seed).repeat()
        n = b["batch_size"]
        mine = (slice(0, n) if mesh is None
                else shd.host_batch_slice(n, mesh=mesh, rules=rules))

        def local(i, order=order, n=n, mine=mine):  # rows mine of global batch i
            picked = [order[i * n + r] for r in range(mine.start, mine.stop)]
            return {k: np.stack([p[k] for p in picked]) for k in picked[0]}

        streams.append(grain.MapDataset.range(sys.maxsize // n).map(local))
        weights.append(b["weight"])
    ds = streams[0] if len(streams) == 1 else grain.MapDataset.mix(streams, weights)
    return iter(ds.to_iter_dataset())


@dataclasses.dataclass
class _SupervisedStep:
    """A supervised phase's jitted step, its train state's shardings, and the compiles of its
    batch shapes started ahead (futures the phase waits on before its first step)."""

    fn: object
    shardings: object
    compiling: list


def supervised_step(model, opt, variables, *, objective, mesh, rules, shapes=(),
                    compiler=None) -> _SupervisedStep:
    """make_sft_step for a phase; with `compiler` (a thread pool) every (rows, width) batch
    shape of `shapes` (sft_buckets') starts compiling there, lowered on the abstract train state
    of `variables` (shapes only): a later phase's programs compile while an earlier phase
    trains, and two shapes side by side. On 2 CPU cores that saves little (XLA's compile of one
    program already keeps about 1.7 cores busy: docs/speed.md); where the steps run on an
    accelerator the compiles take otherwise idle host cores. No compiles ahead in a
    multi-process job (MeshJit compiles at the first call, behind a barrier)."""
    state_sh = train_state_shardings(model, opt, mesh, rules)
    fn = make_sft_step(model, opt, objective=objective, mesh=mesh, rules=rules,
                       state_shardings=state_sh)
    if compiler is None or jax.process_count() > 1:
        return _SupervisedStep(fn, state_sh, [])
    state = shd.sharded_abstract(jax.eval_shape(lambda v: init_train_state(v, opt), variables),
                                 state_sh)

    def compile_shape(rows: int, width: int):
        b = shd.batch_sharding(mesh, rows, rules)
        batch = {"tokens": jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=b),
                 "loss_mask": jax.ShapeDtypeStruct((rows, width), jnp.bool_, sharding=b)}
        fn.lower(state, batch).compile()

    return _SupervisedStep(fn, state_sh, [compiler.submit(compile_shape, r, w)
                                          for r, w in shapes])


def _supervised_phase(name, model, opt, variables, it, *, steps, objective, workdir, seed,
                      log_every, checkpoint_every, resume, progress, postfix, mesh, rules,
                      config=None, step: _SupervisedStep | None = None,
                      first: tuple[int, _SupervisedStep] | None = None):
    """Runs `steps` supervised steps of `objective` from `variables` (sharded on `mesh`;
    resuming from workdir/checkpoints), logging under `name/` (and `config` to config.json).
    `it` yields this process's rows of each global batch (_sft_stream with the mesh); a stream
    that ends on any process ends the phase on every one (next_global_batch). `step`: the phase's
    supervised_step (compiled ahead), else made here. `first` = (n, step'): steps 0..n-1 run
    step' instead (SFT's dense stage: another model over the same train state). Returns the
    final state."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=2)
    rng = jax.random.key(seed)
    if step is None:
        step = supervised_step(model, opt, variables, objective=objective, mesh=mesh,
                               rules=rules)
    state_sh, step_fn = step.shardings, step.fn
    state = init_train_state_sharded(variables, opt, state_sh)
    if resume:
        state, rng = _resume(ckpt, state, state_sh, rng, it, name)
    start = int(state.step)
    first_n, first_step = first if first is not None and start < first[0] else (0, None)
    for compiling in step.compiling + (first_step.compiling if first_step else []):
        compiling.result()  # this phase's programs, compiled ahead
    writer = MetricsWriter(workdir, config=config) if _primary() else None
    bar = _progress(steps, name, start) if progress and _primary() else None
    for i in range(start, steps):
        batch = next_global_batch(it, name, i)  # this process's rows of the global batch
        gb = shd.to_global({k: np.asarray(v) for k, v in batch.items()}, mesh, rules)
        state, met = (first_step.fn if i < first_n else step_fn)(state, gb)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            m = jax.device_get(met)
            if writer is not None:
                writer.write(i + 1, m, name + "/")
            if bar is not None:
                bar.set_postfix({postfix: f"{float(m[postfix]):.3f}"})
        if (i + 1) % checkpoint_every == 0 or i + 1 == steps:
            ckpt.save(i + 1, state, rng=rng, data_iter=it, meta={"phase": name})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ckpt.wait()
    ckpt.close()
    if writer is not None:
        writer.close()
    return state


class DataExhausted(RuntimeError):
    """A process's data stream ended; raised on every process at the same step
    (next_global_batch), so the job ends everywhere instead of hanging in a collective."""


def next_global_batch(it, what: str, step: int):
    """The next batch of `it`, agreed over processes: when any process's stream has ended,
    every process raises DataExhausted naming the processes and the step."""
    batch = next(it, None)
    if shd.every_process(batch is not None):
        return batch
    out = shd.allgather_json(batch is None)
    ended = [i for i, e in enumerate(out) if e]
    raise DataExhausted(f"{what}: the data stream of process(es) {ended} ended at step {step} "
                        f"(of {jax.process_count()} processes): every process stops here; give "
                        "every process the same data (a repeated stream, or as many batches as "
                        "steps)")


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


def start_phase(config, phase: str, resume: bool, data: dict) -> None:
    """Before a phase ("sft" or "rl") runs: resuming, its checkpoints must come from this config
    and from this data (`data`: rl.workdir.phase_data's record of what the phase trains on;
    rl.workdir.check_resumable raises naming the differences); starting over (resume=False),
    the previous run's directory is moved aside (rl.workdir.set_aside), so its checkpoints are
    kept and never mistaken for the new run's. Then `data` is recorded (data.json)."""
    if resume:
        check_resumable(config, phase, data=data)
    else:
        set_aside(os.path.join(config.workdir, phase))
    record_data(config, phase, data)


def _local_key(rng):
    """A restored rng key (a replicated global array in a multi-process job) as this process's
    own key with the same bits."""
    return jax.random.wrap_key_data(np.asarray(jax.random.key_data(rng)),
                                    impl=jax.random.key_impl(rng))


def _sharded_target(state, shardings):
    """The restore target of a (sharded) state: its shapes/dtypes with `shardings`."""
    return shd.sharded_abstract(jax.eval_shape(lambda: state), shardings)


def _resume(ckpt: Checkpointer, state, shardings, rng, data_iter, name: str):
    """(state, rng) of the latest good checkpoint in `ckpt` (restored into `shardings`, the data
    iterator set to its saved position), or the given (state, rng) when there is none."""
    restored = ckpt.restore_latest(_sharded_target(state, shardings), data_iter=data_iter)
    if restored is None:
        return state, rng
    state, rng, _, _ = restored
    log.info("%s resumed at step %d", name, int(state.step))
    return state, _local_key(rng)


def trainable_experts(cfg: ModelConfig, what: str) -> None:
    """Raises ValueError when `what` (a phase that trains) would take gradients of packed MXFP4
    experts (uint8: nothing float to differentiate); the fix is float experts, with QAT to keep
    the MXFP4 export's forward."""
    if cfg.moe.num_experts and cfg.moe.expert_format == "mxfp4":
        raise ValueError(
            f"{what} trains the model, but model.moe.expert_format='mxfp4' holds the routed "
            "experts packed (uint8), which have no gradient: set "
            "--config.model.moe.expert_format=bf16 --config.model.moe.qat=True (float experts "
            "trained through MXFP4 fake quantisation) and, to sample with packed experts, "
            "--config.rl.rollout_experts=mxfp4")


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
    return make_optimizer(_optim(s.lr, s.warmup_steps, s.steps, s.weight_decay,
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
    model, opt = _model(config), phase_optimizer(config, phase)
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
        return f"  RL starts from the released checkpoint in {_hf_dir(config)}"
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
    fams, sft_fams = task_domains(config), sft_domains(config)
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
                 f"{algo.kl_coef} in the {algo.kl_placement}; tasks {', '.join(fams)}"
                 + (f" (SFT: {', '.join(sft_fams)})" if sft_fams != fams else "")
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


def has_dsa(cfg: ModelConfig) -> bool:
    """Whether the model has a DSA layer (trunk or MTP block)."""
    return "D" in cfg.kinds_used()


def has_indexer(cfg: ModelConfig) -> bool:
    """Whether the model has a DSA layer (trunk or MTP block) whose indexer is trained."""
    return has_dsa(cfg) and cfg.dsa.indexer_loss_weight > 0


def warmup_model(cfg: ModelConfig) -> Model:
    """The model of the indexer's dense warm-up: dense attention, indexer KL over every causal
    key (DeepSeek-V3.2's first stage); same parameters as `cfg`'s model."""
    return Model(cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer_stage="dense_warmup")))


def run_sft(config, *, resume: bool = True, progress: bool = True) -> TrainState:
    """SFT on generated demonstrations, in two phases under workdir/sft:

    1. indexer warm-up (sft.indexer_warmup_steps, 0 skips it; only for models with a trained DSA
       indexer): dense attention, the indexer alone trained on KL(attention || indexer) over
       every causal key, every other parameter frozen by the optimizer's mask (lr
       sft.indexer_warmup_lr); checkpoints in sft/indexer_warmup/.
    2. SFT (sft.steps): next-token + MTP + balance + indexer KL (model.dsa.indexer_stage, sparse
       by default) on every parameter, from the warm-up's weights; checkpoints in sft/. Its
       first sft.dense_steps steps (0: none) are a dense stage (sft_dense_steps): the same
       objective with every DSA layer attending densely and the indexer KL over every causal
       key, then the sparse stage continues the same train state and schedule.
    3. QAT (sft.qat_steps, 0 skips it): the same objective and data (its own shuffle) with the
       routed experts fake-quantised to MXFP4 in the forward (model.moe.qat=True for this phase
       only; straight-through gradients), lr sft.qat_lr with a 10% warm-up, from SFT's final
       weights; checkpoints in sft/qat/. Its weights are then the final SFT weights
       (sft_checkpoint_dir): load_sft_variables, RL's init_from="sft" and its KL reference read
       them. RL itself trains through fake-quantised experts only with model.moe.qat=True.
    Resuming picks up whichever phase was unfinished (a finished SFT skips the warm-up; a
    finished SFT is restored, not rerun, before the QAT phase)."""

    config = RunConfig.from_config(config)
    s = config.sft
    workdir = os.path.join(config.workdir, "sft")
    examples = sft_train_examples(config)
    start_phase(config, "sft", resume, phase_data(config, "sft", examples))
    model, tok = _model(config), load_tokenizer(config.tokenizer)
    qat_steps = s.qat_steps
    qmodel = qat_model(model.cfg) if qat_steps else None  # rejected before SFT runs
    mesh, rules = shd.mesh_from_config(config)
    it = _sft_stream(examples, tok, s, config.seed, mesh=mesh, rules=rules)

    opt = make_optimizer(_optim(s.lr, s.warmup_steps, s.steps, s.weight_decay,
                                optim_numerics(config)))
    variables = (checkpoint_variables(config, model, mesh=mesh, rules=rules)
                 if config.hf_dir else
                 shd.init_sharded(model, jax.random.key(config.seed), mesh, rules))
    done = Checkpointer(os.path.join(workdir, "checkpoints"), keep=2)
    latest = done.latest_step() if resume else None
    done.close()
    sft_started, sft_at = latest is not None, latest or 0  # sft_at: the step SFT resumes at
    warm_steps = s.indexer_warmup_steps
    warm = warm_steps and has_indexer(model.cfg) and not sft_started
    # each phase's step compiles ahead, two programs at a time: the warm-up's batch shapes
    # first, then SFT's while the warm-up trains (supervised_step)
    shapes = [(b["batch_size"], b["width"]) for b in sft_buckets(examples, s)]
    compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sft-compile")
    ahead = dict(mesh=mesh, rules=rules, shapes=shapes, compiler=compiler)
    if warm:
        wmodel = warmup_model(model.cfg)
        wopt = make_optimizer(_optim(s.indexer_warmup_lr, max(warm_steps // 10, 1), warm_steps,
                                     0.0, optim_numerics(config)), trainable=indexer_mask)
        wstep = supervised_step(wmodel, wopt, variables, objective="indexer_warmup", **ahead)
    # SFT's dense stage, then its sparse stage: each compiles ahead only where it will run from
    # the step SFT resumes at (the latest checkpoint's; a lazy jit otherwise)
    dense_n = sft_dense_steps(config, model.cfg)
    lazy = dict(mesh=mesh, rules=rules)
    dense = None if not dense_n else (dense_n, supervised_step(
        warmup_model(model.cfg), opt, variables, objective="lm",
        **(ahead if sft_at < dense_n else lazy)))
    sft_step = supervised_step(model, opt, variables, objective="lm",
                               **(ahead if max(sft_at, dense_n) < s.steps else lazy))
    compiler.shutdown(wait=False)
    if warm:
        wstate = _supervised_phase(
            "sft_indexer_warmup", wmodel, wopt, variables,
            _sft_stream(examples, tok, s, config.seed + 1, mesh=mesh, rules=rules),
            steps=warm_steps,
            objective="indexer_warmup", workdir=os.path.join(workdir, "indexer_warmup"),
            seed=config.seed, log_every=s.log_every, checkpoint_every=s.checkpoint_every,
            resume=resume, progress=progress, postfix="indexer_kl", mesh=mesh, rules=rules,
            config=config, step=wstep)
        variables = wstate.variables
    state = _supervised_phase(
        "sft", model, opt, variables, it, steps=s.steps, objective="lm",
        workdir=workdir, seed=config.seed, log_every=s.log_every,
        checkpoint_every=s.checkpoint_every, resume=resume, progress=progress, postfix="ce",
        mesh=mesh, rules=rules, config=config, step=sft_step, first=dense)
    if not qat_steps:
        return state
    qopt = make_optimizer(_optim(s.qat_lr, max(qat_steps // 10, 1), qat_steps, s.weight_decay,
                                 optim_numerics(config)))
    return _supervised_phase(
        "sft_qat", qmodel, qopt, state.variables,
        _sft_stream(examples, tok, s, config.seed + 2, mesh=mesh, rules=rules),
        steps=qat_steps, objective="lm", workdir=os.path.join(workdir, "qat"), seed=config.seed,
        log_every=s.log_every, checkpoint_every=s.checkpoint_every,
        resume=resume, progress=progress, postfix="ce", mesh=mesh, rules=rules, config=config)


def sft_dense_steps(config, cfg: ModelConfig) -> int:
    """sft.dense_steps (an int in [0, sft.steps], train/run_config.py), checked against the
    model: > 0 only for a model with a DSA layer in the sparse stage (the dense stage's
    difference).

    Why a dense stage: in the sparse stage the indexer's KL covers only the keys it already
    selects, so a key it never picks gets no signal to be picked, and the attention cannot
    learn to use it. DeepSeek-V3.2 avoids this by starting from a trained dense model; here SFT
    starts from random weights, so its first steps play that model's part (README, "Agents":
    what it did to the episodes' name copying)."""
    n = config.sft.dense_steps
    if n and not (has_dsa(cfg) and cfg.dsa.indexer_stage == "sparse"):
        raise ValueError(f"sft.dense_steps={n} needs a model with a DSA layer in the sparse stage"
                         f" (model {cfg.name}: layer pattern {cfg.layer_pattern!r}, "
                         f"dsa.indexer_stage={cfg.dsa.indexer_stage!r}): set sft.dense_steps=0")
    return n


def qat_model(cfg: ModelConfig) -> Model:
    """The model of the SFT QAT phase: `cfg` with model.moe.qat=True (routed experts
    fake-quantised to MXFP4 in the forward). Raises ValueError for a model without routed
    experts, with packed MXFP4 experts (nothing float to train), or with widths that are not
    multiples of the MXFP4 block (32)."""
    from model import quant

    if not cfg.moe.num_experts:
        raise ValueError(f"sft.qat_steps > 0 but model {cfg.name} has no routed experts (only they "
                         "have an MXFP4 path): set sft.qat_steps=0")
    if cfg.moe.expert_format != "bf16":
        raise ValueError(f"sft.qat_steps > 0 needs float experts to train, but "
                         f"model.moe.expert_format={cfg.moe.expert_format!r}")
    quant.mxfp4_config(cfg)  # d_model and moe.expert_dim multiples of 32
    return Model(cfg.replace(moe=dataclasses.replace(cfg.moe, qat=True)))


def optim_numerics(config) -> dict:
    """The optimizer's numerics fields of config.optim (mu_dtype, master_dtype), shared by the
    SFT phases' optimizers."""
    return {k: getattr(config.optim, k) for k in ("mu_dtype", "master_dtype")}


def _optim(lr, warmup, total, wd, numerics=None):
    import ml_collections
    return ml_collections.ConfigDict(dict(lr=lr, warmup_steps=warmup, total_steps=total,
                                          final_lr_frac=0.1, weight_decay=wd, b1=0.9, b2=0.99,
                                          eps=1e-8, clip_norm=1.0, **(numerics or {})))


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
    opt = make_optimizer(_optim(1e-3, 1, 2, 0.0, optim_numerics(config)))
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
    wopt = make_optimizer(_optim(s.indexer_warmup_lr, 1, 2, 0.0, optim_numerics(config)),
                          trainable=indexer_mask)
    return _restore_variables(os.path.join(config.workdir, "sft", "indexer_warmup",
                                           "checkpoints"), model, wopt, mesh, rules)


def heldout_text(config, tokenizer, n: int = 64, width: int = 128):
    """Held-out demonstration text for diagnostics: the first n test tasks' chat prompt +
    reference completion, right-padded ([n,width] int32, valid [n,width] bool)."""
    from rl.agent import encode_episode
    from rl.envs import demo_turns

    rows = []
    for task, demo in load_task_splits(config)["test"]:
        if demo is None:
            continue
        if is_multi_turn_task(task):
            ids = encode_episode(tokenizer, task.prompt,
                                 demo_turns(task, agent_env_config(config.rl.agent), demo))[0]
        else:
            ids = tokenizer.encode(tokenizer.chat_prompt(task.prompt), bos=True)
            ids += tokenizer.encode(demo, eos=True)
        rows.append(ids[:width])
    rows = rows[:: max(len(rows) // n, 1)][:n]  # spread over domains
    tokens = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], valid[i, :len(r)] = r, True
    return jnp.asarray(tokens), jnp.asarray(valid)


# --------------------------------------------------------------------------- RL
class _Position:
    """A data-iterator view whose saved state is a recorded earlier position."""

    def __init__(self, it, pos):
        self._it, self._pos = it, pos

    def get_state(self) -> bytes:  # grain's checkpoint handler takes non-DatasetIterator
        return json.dumps(self._pos).encode()  # states as JSON bytes

    def set_state(self, state: bytes):
        self._it.set_state(json.loads(state))


def rl_optimizers(config, algo) -> tuple:
    """(optimizer, critic, value optimizer) of the RL run: config.optim's optimizer; with a
    critic (algo.needs_values) its config (config.rl.critic, rl/critic.py) and optimizer
    (config.optim with lr * critic.lr_scale), else both None."""
    if not algo.needs_values:
        return make_optimizer(config.optim), None, None
    critic = CriticConfig.from_config(config.rl.critic)
    return (make_optimizer(config.optim), critic,
            make_optimizer(critic_optim_config(config.optim, critic)))


def _rl_state_shapes(config, model: Model, algo):
    """init_rl_state's fresh state as ShapeDtypeStructs (no shardings), from shapes alone."""
    return jax.eval_shape(
        lambda: init_rl_state(config, model, algo, model.init(jax.random.key(0)))[0])


def abstract_rl_state(config, model: Model, algo, *, mesh, rules=None):
    """The fresh RL train state of init_rl_state as ShapeDtypeStructs with its shardings on
    `mesh`, computed from shapes alone (no weights loaded, nothing allocated): what checkpoints
    restore into and what the update's programs compile against before the state exists."""
    abstract = _rl_state_shapes(config, model, algo)
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


def rl_model(config) -> Model:
    """The policy as RL trains it: the config's model, with the indexer KL weight set to 0 when
    rl.train_indexer is False (the indexer then gets no gradient and stays as SFT left it)."""
    cfg = model_config(config)
    if not config.rl.train_indexer:
        cfg = cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer_loss_weight=0.0))
    return Model(cfg)


def rollout_policy(config, model: Model, *, mesh=None, rules=None):
    """(sampler model, variables -> sampler variables) of rl.rollout_experts: "bf16" samples the
    trained model itself; "mxfp4" samples the MXFP4 model (model/quant.py: packed experts,
    grouped MXFP4 matmul, config.quant.high_precision kept as is) on the trained weights
    quantised once per rollout batch (a QAT policy's fake-quantised forward is what that
    sampler runs). The trainer keeps its weights; the sampler/trainer log-prob gap this opens
    is logged (logp_gap/*) and corrected by TIS, so rl.algo.tis_cap must be set."""
    from model import quant

    if config.rl.rollout_experts == "bf16":
        return model, lambda v: v
    if config.rl.algo.get("tis_cap") is None:
        raise ValueError("rl.rollout_experts='mxfp4' samples from the MXFP4 policy, not the "
                         "trained one: truncated importance sampling must correct the gap; set "
                         "rl.algo.tis_cap (2.0 in configs/rl.py)")
    hp = quant.parse_modules(config.quant.high_precision)
    qmodel = Model(quant.mxfp4_config(model.cfg, hp))
    if qmodel.cfg.moe.expert_format != "mxfp4":
        raise ValueError("rl.rollout_experts='mxfp4' but quant.high_precision keeps the experts "
                         "high precision: remove 'experts' from it or use rollout_experts='bf16'")
    return qmodel, quant.make_ptq_fn(qmodel, mesh, rules)


def rollout_sampling(r, eos_id: int) -> SamplingConfig:
    """The rollout sampler's config from the RL section (config.rl); the trainer's log-probs use
    the same distribution."""
    return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k, eos_id=eos_id, speculative=r.speculative,
                          draft_tokens=int(r.draft_tokens))


def eval_sampling(e, sampling: SamplingConfig) -> SamplingConfig:
    """The evaluation sampler from the eval section (config.eval): the rollout sampler at
    temperature 0 when eval.greedy, else at eval.temperature."""
    return dataclasses.replace(sampling, temperature=0.0 if e.greedy else e.temperature)


def _initial_variables(config, model: Model, *, mesh=None, rules=None) -> dict:
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


def _hf_dir(config) -> str:
    d = config.hf_dir
    if not d:
        raise ValueError("rl.init_from='hf' needs the checkpoint directory: set "
                         "--config.hf_dir=DIR (configs/rl.py:hf)")
    return d


def checkpoint_variables(config, model: Model, *, mesh=None, rules=None) -> dict:
    """The released checkpoint's weights (config.hf_dir, model.hf.import_hf) in `model`'s layout,
    streamed onto the model's shardings on `mesh` (one device without one)."""
    m = model.cfg
    cfg, variables = import_hf(_hf_dir(config), dtype=m.dtype, param_dtype=m.param_dtype,
                               scan_layers=m.scan_layers, mesh=mesh, rules=rules)
    if cfg != m:
        raise ValueError(f"the checkpoint in {config.hf_dir} translates to another model config "
                         "than this run's model section: run with the section that "
                         "resolve_checkpoint gives (do not override model fields of an hf run)")
    return variables


def _due(step: int, every: int, last: int) -> bool:
    """Whether something done every `every` steps (and at the last step) is due at `step`."""
    return step % every == 0 or step == last


class _Launcher:
    """Starts rollout batches of this process's prompts (rows `mine` of each global prompt batch
    of `data`) with the sampler's copy of the current policy, and remembers the rng and data
    position from before the latest launch. The checkpoint stores those, so a resume regenerates
    exactly the pending (lookahead) batch (bit-exact when rl.overlap_scoring=False; with overlap
    the lookahead batch was generated one update earlier than on resume)."""

    def __init__(self, worker, data, mine, to_sampler, *, batch: int, oversample: int = 1):
        self._worker, self._data, self._mine, self._to_sampler = worker, data, mine, to_sampler
        self._batch, self._oversample = batch, oversample
        self.rng = self._pos = None  # the launch point (set by launch)

    def launch(self, rng, state):
        """-> (the next rng, the pending rollout group of the next prompt batch). With
        oversample k the data batch holds k global prompt batches: each is generated as one
        (the same compiled shapes) and the scored groups go through rl.pipeline.select_groups,
        which keeps one batch's worth (this process's share), informative groups first."""
        self.rng, self._pos = rng, self._data.get_state()
        tasks = next_global_batch(self._data, "RL prompts", int(state.step))
        variables = self._to_sampler(state.variables)
        pendings = []
        for i in range(self._oversample):
            rng, sub = jax.random.split(rng)
            part = tasks[i * self._batch:(i + 1) * self._batch][self._mine]
            pendings.append(self._worker.start(variables, part, sub, version=int(state.step)))
        if len(pendings) == 1:
            return rng, pendings[0]
        return rng, PendingSelection(pendings, len(tasks[:self._batch][self._mine]))

    def position(self) -> _Position:
        """The data iterator as the checkpoint should save it: at the latest launch point."""
        return _Position(self._data, self._pos)


@dataclasses.dataclass(frozen=True)
class _RolloutForward:
    """The rollout-time forward of build_train_batch: old log-probs (and, with a critic, old
    values from the same forward) under the current policy, and the frozen reference policy's
    log-probs when the algorithm needs them. Takes and returns this process's rows; runs on the
    global batch."""

    logp_fn: object
    logp_value_fn: object  # None without a critic
    ref_vars: dict | None  # None when the algorithm needs no reference
    mesh: object = None
    rules: object = None
    old_logp: bool = True  # False: the train step takes old log-probs itself (old_logp_source)
    ref_in_step: bool = False  # True: the train step takes ref log-probs itself (ref_logp_source)

    @classmethod
    def planned(cls, r, algo, state, *, mesh=None, rules=None) -> _RolloutForward:
        """The forward rl config `r` and `algo` call for (old_logp_source, ref_logp_source),
        without its functions: enough for `runs`, `step_args` and precompile_updates on an
        abstract `state` (its variables stand for the reference's); the real one is
        dataclasses.replace(planned, logp_fn=..., logp_value_fn=..., ref_vars=...)."""
        return cls(logp_fn=None, logp_value_fn=None,
                   ref_vars=state.variables if algo.needs_ref else None,
                   old_logp=old_logp_source(r, algo) == "batch",
                   ref_in_step=ref_logp_source(r, algo) == "step", mesh=mesh, rules=rules)

    @property
    def step_args(self) -> tuple:
        """The train step's arguments after (state, batch): the reference variables when the
        step computes the reference log-probs itself."""
        return (self.ref_vars,) if self.ref_in_step else ()

    @property
    def runs(self) -> bool:
        """Whether there is anything to compute before the step (else `at` gives None and the
        update's programs compile from the state's shapes alone: precompile_updates)."""
        return (self.old_logp or self.logp_value_fn is not None
                or (self.ref_vars is not None and not self.ref_in_step))

    def at(self, state):
        """The forward under `state`'s policy: (tokens, mask) -> {"old_logp", ...} rows (no
        old_logp when self.old_logp is False, no ref_logp when self.ref_in_step; None when there
        is nothing to compute)."""
        if not self.runs:
            return None
        ref_vars = None if self.ref_in_step else self.ref_vars

        def forward(tokens, mask):
            gt, gm = shd.to_global((np.asarray(tokens), np.asarray(mask)), self.mesh, self.rules)
            out = {}
            if self.logp_value_fn is not None:
                out["old_logp"], out["old_values"] = self.logp_value_fn(
                    state.variables, state.value_params, gt, gm)
            elif self.old_logp:
                out["old_logp"] = self.logp_fn(state.variables, gt, gm)
            if ref_vars is not None:
                out["ref_logp"] = self.logp_fn(ref_vars, gt, gm)
            return shd.host_rows(out)
        return forward


def reference_variables(init_vars: dict, state) -> dict:
    """The frozen reference policy's variables with exactly the tree structure of
    state.variables ({"params", "router_state"}, an empty router state included), so the
    log-prob forward compiled for the policy serves the reference without a recompile."""
    missing = set(state.variables) - set(init_vars) - {"router_state"}
    if missing:
        raise ValueError(f"the reference variables lack {sorted(missing)}")
    return {k: init_vars.get(k, {}) for k in state.variables}


def old_logp_source(r, algo) -> str:
    """make_train_step's old_logp from the RL section (config.rl.old_logp_pass): "current" (no
    separate old-log-prob forward: the step's own log-probs, stop-gradient, are the proximal
    policy's) when the pass is "auto", every batch serves exactly one update (the loop's only
    mode: micro-batches accumulate into one optimizer step) and nothing needs old log-probs
    before the advantages (a critic's values, KL in the reward); "batch" otherwise."""
    mode = r.old_logp_pass
    needs_before = algo.needs_values or algo.kl_placement == "reward"
    return "current" if mode == "auto" and not needs_before else "batch"


def ref_logp_source(r, algo) -> str:
    """make_train_step's ref_logp from the RL section (config.rl.ref_logp_pass): "step" (the
    train step computes the reference log-probs from the reference variables inside its own
    program: no separate forward to compile or run) when the pass is "auto" and the algorithm's
    KL term is in the loss; "batch" (a separate forward before the advantages) when it is
    "separate", or the KL is folded into the rewards (needed before the advantages), or there
    is no KL term."""
    mode = r.ref_logp_pass
    return "step" if mode == "auto" and kl_in_loss(algo) else "batch"


def _train_on(group, state, *, algo, width, forward: _RolloutForward, step_fn, mesh, rules):
    """One update on a scored rollout group: old/ref log-probs (+ values), advantages and the
    jit train step on the global batch assembled from every process's rows, packed `width`
    tokens wide (an int, or a function of the group's tasks: one compiled step per width).
    Returns (state, metrics: the batch's host-side values, `staleness` and the train step's,
    seconds taken)."""
    t0 = time.perf_counter()
    if callable(width):  # the width of this group's rows (train_width of its tasks)
        width = width(group.tasks)
    batch, met = build_train_batch(group, algo, width, forward=forward.at(state), mesh=mesh,
                                   rules=rules)
    met["staleness"] = int(state.step) - group.policy_version  # updates behind
    state, tmet = step_fn(state, shd.to_global(batch, mesh, rules), *forward.step_args)
    met.update({k: float(v) for k, v in jax.device_get(tmet).items()})
    if "old_logp" not in batch and "logp_gap_abs" in met:
        # no separate forward: the step's own log-probs (the same parameters) give the gap
        met["logp_gap/sampler_trainer_mean"] = met["logp_gap_abs"]
        met["logp_gap/sampler_trainer_max"] = met["logp_gap_max"]
    return state, met, time.perf_counter() - t0


def placeholder_group(task, rows: int, group_size: int) -> ScoredGroup:
    """A scored group of `rows` one-token rollouts of `task`, all zeros: packed at a width, it
    gives a train batch of the real batches' shapes and dtypes (precompile_updates)."""

    zeros, ones = np.zeros((rows, 1), np.int32), np.ones((rows, 1), bool)  # [N,1]
    return ScoredGroup(
        tasks=[task] * rows, group_ids=np.arange(rows) // group_size, prompts=zeros,
        prompt_lengths=np.ones(rows, np.int32), completions=zeros, completion_mask=ones,
        sampler_logp=np.zeros((rows, 1), np.float32), texts=[""] * rows,
        rewards=np.zeros(rows, np.float32), failed=np.zeros(rows, bool), details=[], gen_s=0.0,
        target_mask=ones if is_multi_turn_task(task) else None)


def precompile_updates(tasks, rows: int, group_size: int, state, *, algo, width,
                       forward: _RolloutForward, step_fn, mesh, rules):
    """Compile the update's programs on a background thread while the first rollouts generate:
    for one task of each row kind among `tasks` (one-shot, multi-turn; `width(tasks)` wide), a
    placeholder batch of `rows` rows goes through build_train_batch (the rollout-time forward
    and the advantages compile and run on it) and the train step is lowered and compiled on it
    (not run: `state` is only read). The real calls then find their programs compiled.
    `state` (and forward.ref_vars) may be abstract (abstract_rl_state: ShapeDtypeStructs with
    the real state's shardings) when the forward has nothing to run (not forward.runs): the
    compile then starts before the weights are loaded.
    -> a Future: wait on it before the first update (the train step must not compile twice).
    None in a multi-process job, where MeshJit compiles each program at its first call and
    the processes meet at a barrier before running it."""
    if jax.process_count() > 1:
        return None

    if forward.runs and any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state)):
        raise ValueError("precompile_updates: the rollout-time forward runs on the state's "
                         "weights; pass the train state itself, not its abstract form")
    kinds = {}  # one task per row kind, in the order the kinds first appear
    for t in tasks:
        kinds.setdefault(is_multi_turn_task(t), t)

    def compile_all():
        fw = forward.at(state)
        for task in kinds.values():
            w = width([task]) if callable(width) else width
            batch, _ = build_train_batch(placeholder_group(task, rows, group_size), algo, w,
                                         forward=fw)
            step_fn.lower(state, shd.to_global(batch, mesh, rules),
                          *forward.step_args).compile()

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="precompile")
    future = pool.submit(compile_all)
    pool.shutdown(wait=False)
    return future


def _timing_metrics(group, train_s: float, iteration_s: float) -> dict:
    """The iteration's time split (generate / score-wait / score / train / whole), the
    fraction of scoring time hidden behind generation and the fraction of rows whose verdict
    was reused (sandbox.reuse_verdicts: an identical completion of the same task scored before)."""
    reused = sum(bool(d.get("reused")) for d in group.details if isinstance(d, dict))
    return {"time/generate_s": group.gen_s, "time/score_wait_s": group.score_wait_s,
            "time/score_s": group.score_s, "time/train_s": train_s,
            "time/iteration_s": iteration_s,
            "score_hidden_frac": 1.0 - group.score_wait_s / max(group.score_s, 1e-9),
            "score_reused_frac": reused / max(len(group.details), 1)}


def _evaluate(e, worker, tasks, writer, on_eval, variables, step: int):
    """Held-out pass@1 of the sampler's `variables` on `tasks` (eval section `e`: batch_prompts),
    written as val/<domain>/pass1 and handed to on_eval(step, results)."""
    res = evaluate(worker, variables, tasks, jax.random.key(step), batch_prompts=e.batch_prompts)
    if writer is not None:
        writer.write(step, {f"{d}/pass1": v["pass@1"] for d, v in res.items()
                            if isinstance(v, dict)}, "val/")
    if on_eval is not None:
        on_eval(step, res)
    return res


def run_rl(config, *, resume: bool = True, progress: bool = True, pool=None,
           on_eval=None) -> TrainState:
    """GRPO-family RL from the SFT checkpoint (see the module docstring). Rollouts are generated
    one batch ahead while the previous batch is scored; the batch trained at update i was
    generated by the policy of update i-1 (staleness 1, logged as `staleness`), and
    the truncated importance weight against the sampler's log-probs (rl.algo.tis_cap, on by
    default in configs/rl.py) corrects for it. `pool`: a sandbox executor to score with (default:
    one opened from config.sandbox and closed at the end); on_eval(step, results) after each
    evaluation."""
    config = RunConfig.from_config(config)
    r, e = config.rl, config.eval
    if r.init_from == "sft":  # the weights RL starts from must be this config's SFT
        check_resumable(config, "sft")
    splits = load_task_splits(config)
    train_tasks = [t for t, _ in splits["train"]]
    start_phase(config, "rl", resume, phase_data(config, "rl", train_tasks))
    model, tok, algo = rl_model(config), load_tokenizer(config.tokenizer), algo_from_config(r.algo)
    workdir = os.path.join(config.workdir, "rl")
    mesh, rules = shd.mesh_from_config(config)
    on_mesh = dict(mesh=mesh, rules=rules)
    val_tasks = _balanced([t for t, _ in splits["val"]], e.val_tasks)
    # one-shot and multi-turn tasks in separate batches (each trains at its own row width)
    oversample = r.oversample  # draw this many batches' prompts, train on one batch
    seed = config.rl_seed()  # the prompts' order and the rollouts' draws
    data = iter(task_dataset(train_tasks, seed=seed,
                             batch_size=r.prompts_per_batch * oversample, group_by=is_multi_turn_task,
                             template_power=r.template_power))

    # the update (the jit train step on the mesh) and its programs, compiling on a thread from
    # the state's shapes while the weights load and the first evaluation and rollouts run
    opt, critic, value_opt = rl_optimizers(config, algo)
    abstract = abstract_rl_state(config, model, algo, **on_mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, abstract)
    sampling = rollout_sampling(r, tok.eos_id)
    old_src, ref_src = old_logp_source(r, algo), ref_logp_source(r, algo)
    step_fn = make_train_step(model, algo, opt, micro_batches=r.micro_batches,
                              sampling=sampling, critic=critic, value_optimizer=value_opt,
                              state_shardings=state_sh, old_logp=old_src, ref_logp=ref_src,
                              mtp_loss_weight=r.mtp_loss_weight, **on_mesh)
    width = functools.partial(train_width, r)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=r.keep_checkpoints)
    precompile = functools.partial(precompile_updates, train_tasks,
                                   r.prompts_per_batch * r.group_size, r.group_size, algo=algo,
                                   width=width, step_fn=step_fn, **on_mesh)
    ahead = _RolloutForward.planned(r, algo, abstract, **on_mesh)  # shapes only: nothing runs
    compiling = None  # the update's programs, compiling behind the set-up, evaluation, rollouts
    if r.precompile and not ahead.runs and (not resume or (ckpt.latest_step() or 0) < r.steps):
        compiling = precompile(abstract, forward=ahead)

    # the policy's train state (with a critic: the value head) from the initial weights, or the
    # latest checkpoint; the frozen reference policy is the initial weights in their own buffers
    # (the train state is donated to each update), reloaded rather than checkpointed
    init_vars = _initial_variables(config, model, **on_mesh)
    state = init_rl_state(config, model, algo, init_vars, **on_mesh)[0]
    rng = jax.random.key(seed + 1)
    if resume:
        state, rng = _resume(ckpt, state, state_sh, rng, data, "RL")

    # rollouts: the sampler's policy (rl.rollout_experts: the trained model or its MXFP4
    # quantisation), the sandbox that scores them, the rollout and evaluation workers
    sample_model, to_sampler = rollout_policy(config, model, **on_mesh)
    own_pool = pool is None
    if own_pool:
        pool, verifier = _open_pool(config)
    else:
        from sandbox.verifiers import Verifier
        verifier = Verifier(executor=pool, reuse=config.sandbox.reuse_verdicts)
    worker = make_rollout_worker(r, sample_model, tok, sampling, verifier, pool,
                                 group_size=r.group_size, tasks=train_tasks, **on_mesh)
    eval_worker = make_rollout_worker(r, sample_model, tok, eval_sampling(e, sampling), verifier,
                                      pool, group_size=1, tasks=val_tasks, **on_mesh)
    launcher = _Launcher(worker, data, host_prompt_slice(r.prompts_per_batch, r.group_size,
                                                         mesh, rules), to_sampler,
                         batch=r.prompts_per_batch, oversample=oversample)

    # training: the rollout-time forward (the log-prob passes the step does not take itself)
    # and the update
    forward = dataclasses.replace(  # `ahead` with the functions and the reference's weights
        ahead, logp_fn=make_logp_fn(model, sampling, **on_mesh),
        logp_value_fn=(make_logp_value_fn(model, critic, sampling, **on_mesh)
                       if critic is not None else None),
        ref_vars=reference_variables(init_vars, state) if algo.needs_ref else None)
    train_on = functools.partial(_train_on, algo=algo, width=width, forward=forward,
                                 step_fn=step_fn, **on_mesh)
    if compiling is None and r.precompile and int(state.step) < r.steps:
        compiling = precompile(state, forward=forward)  # the forward's programs run on the state
    writer = MetricsWriter(workdir, config=config) if _primary() else None
    evaluate_at = functools.partial(_evaluate, e, eval_worker, val_tasks, writer, on_eval)

    start = int(state.step)
    bar = _progress(r.steps, "rl", start) if progress and _primary() else None
    if start == 0 and e.every:
        evaluate_at(to_sampler(state.variables), 0)
    rng, pending = launcher.launch(rng, state)
    for step in range(start + 1, r.steps + 1):
        t_iter, more, nxt = time.perf_counter(), step < r.steps, None
        if r.overlap_scoring and more:  # generate the next batch while this one is scored
            rng, nxt = launcher.launch(rng, state)
        group = pending.result()
        if compiling is not None:  # the first update waits for its programs
            compiling.result()
            compiling = None
        state, met, train_s = train_on(group, state)
        if not r.overlap_scoring and more:
            rng, nxt = launcher.launch(rng, state)
        pending = nxt
        met.update(_timing_metrics(group, train_s, time.perf_counter() - t_iter))
        met.update(group.selection)  # rl.oversample > 1: groups drawn, informative fractions
        if _due(step, r.log_every, r.steps):
            met = shd.reduce_host_metrics(met)  # host-side values over every process's rows
            if writer is not None:
                writer.write(step, met, "rl/")
        if bar is not None:
            bar.set_postfix(reward=f"{met['reward_mean']:.2f}", kl=f"{met.get('kl_ref', 0):.3f}")
            bar.update(1)
        if e.every and _due(step, e.every, r.steps):
            evaluate_at(to_sampler(state.variables), step)
        if _due(step, r.checkpoint_every, r.steps):
            ckpt.save(step, state, rng=launcher.rng, data_iter=launcher.position(),
                      meta={"phase": "rl"})
    if bar is not None:
        bar.close()
    ckpt.wait()
    ckpt.close()
    if writer is not None:
        writer.close()
    if own_pool:
        pool.close()
    return state


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
                           abstract_fn=lambda: _rl_state_shapes(config, model, algo))
    if v is None:
        raise FileNotFoundError(f"no RL checkpoint under {d}: run scripts/train_rl.py first")
    return v
