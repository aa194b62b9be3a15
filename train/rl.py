"""The RL driver: GRPO-family RL from the SFT weights (run_rl), its prompt launcher and update,
the update's programs compiled ahead, and evaluation during RL.

    run_rl(config)     -> TrainState     workdir/rl/{checkpoints, metrics.jsonl, events}

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
(the default GRPO), else from the state once it exists.

Row widths: RL prompt batches come from one kind each (task_dataset(group_by=
is_multi_turn_task)), and each RL batch is packed at its kind's width (train_width): two
compiled shapes, and a one-shot row is never padded to an episode's width.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import time

import jax
import numpy as np

from model import sharding as shd
from model.tokenizer import load_tokenizer
from rl.algorithms import algo_from_config
from rl.checkpoint import Checkpointer
from rl.metrics import MetricsWriter
from rl.pipeline import (
    PendingSelection,
    ScoredGroup,
    build_train_batch,
    evaluate,
    host_prompt_slice,
    task_dataset,
)
from rl.train_step import TrainState, make_logp_fn, make_logp_value_fn, make_train_step
from sandbox.tasks.domains import is_multi_turn_task
from train.data import balanced, load_task_splits, phase_data
from train.models import rl_model
from train.phase import (
    end_phase,
    is_primary,
    next_global_batch,
    progress_bar,
    resume_state,
    start_phase,
)
from train.rollouts import (
    RolloutForward,
    eval_sampling,
    make_rollout_worker,
    old_logp_source,
    open_pool,
    ref_logp_source,
    rollout_policy,
    rollout_sampling,
)
from train.run_config import RunConfig
from train.state import abstract_rl_state, init_rl_state, rl_optimizers
from train.weights import initial_variables, reference_variables
from train.workdir import check_resumable


def train_width(r, tasks=()) -> int:
    """Width of the packed train rows from the RL section `r` (config.rl): one-shot rows
    (max_prompt_len + max_new_tokens), or the multi-turn episode width (agent.width) when any
    task is multi-turn."""

    w = r.max_prompt_len + r.max_new_tokens
    return max(w, int(r.agent.width)) if any(is_multi_turn_task(t) for t in tasks) else w


class _Position:
    """A data-iterator view whose saved state is a recorded earlier position."""

    def __init__(self, it, pos):
        self._it, self._pos = it, pos

    def get_state(self) -> bytes:  # grain's checkpoint handler takes non-DatasetIterator
        return json.dumps(self._pos).encode()  # states as JSON bytes

    def set_state(self, state: bytes):
        self._it.set_state(json.loads(state))


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


def train_on_group(group, state, *, algo, width, forward: RolloutForward, step_fn, mesh, rules):
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
                       forward: RolloutForward, step_fn, mesh, rules):
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
    val_tasks = balanced([t for t, _ in splits["val"]], e.val_tasks)
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
    ahead = RolloutForward.planned(r, algo, abstract, **on_mesh)  # shapes only: nothing runs
    compiling = None  # the update's programs, compiling behind the set-up, evaluation, rollouts
    if r.precompile and not ahead.runs and (not resume or (ckpt.latest_step() or 0) < r.steps):
        compiling = precompile(abstract, forward=ahead)

    # the policy's train state (with a critic: the value head) from the initial weights, or the
    # latest checkpoint; the frozen reference policy is the initial weights in their own buffers
    # (the train state is donated to each update), reloaded rather than checkpointed
    init_vars = initial_variables(config, model, **on_mesh)
    state = init_rl_state(config, model, algo, init_vars, **on_mesh)[0]
    rng = jax.random.key(seed + 1)
    if resume:
        state, rng = resume_state(ckpt, state, state_sh, rng, data, "RL")

    # rollouts: the sampler's policy (rl.rollout_experts: the trained model or its MXFP4
    # quantisation), the sandbox that scores them, the rollout and evaluation workers
    sample_model, to_sampler = rollout_policy(config, model, **on_mesh)
    own_pool = pool is None
    if own_pool:
        pool, verifier = open_pool(config)
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
    train_on = functools.partial(train_on_group, algo=algo, width=width, forward=forward,
                                 step_fn=step_fn, **on_mesh)
    if compiling is None and r.precompile and int(state.step) < r.steps:
        compiling = precompile(state, forward=forward)  # the forward's programs run on the state
    writer = MetricsWriter(workdir, config=config) if is_primary() else None
    evaluate_at = functools.partial(_evaluate, e, eval_worker, val_tasks, writer, on_eval)

    start = int(state.step)
    bar = progress_bar(r.steps, "rl", start) if progress and is_primary() else None
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
    end_phase(ckpt, bar, writer)
    if own_pool:
        pool.close()
    return state
