"""What generates and scores rollouts, for RL and evaluation: the sandbox pool (open_pool), the
rollout worker of a run's RL section (make_rollout_worker; workers_by_temperature), the
sampler's policy and sampling configs (rollout_policy, rollout_sampling, eval_sampling), and
the rollout-time forward of the update (RolloutForward: old and reference log-probs where the
train step does not take them itself, old_logp_source / ref_logp_source)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from model import sharding as shd
from model.transformer import Model
from rl.pipeline import RolloutWorker
from rl.sampler import SamplingConfig
from rl.train_step import kl_in_loss
from sandbox.tasks.domains import is_multi_turn_task
from train.data import agent_env_config


def open_pool(config):
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


@dataclasses.dataclass(frozen=True)
class RolloutForward:
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
    def planned(cls, r, algo, state, *, mesh=None, rules=None) -> RolloutForward:
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
