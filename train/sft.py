"""The SFT driver: SFT on generated demonstrations (run_sft: the indexer warm-up, SFT with its
dense stage, the QAT phase), its rows and batches, and its supervised steps.

    run_sft(config)    -> TrainState     workdir/sft/{checkpoints, metrics.jsonl, events}

Row widths: one-shot rows and multi-turn episodes (rl/agent.py) never share a batch. SFT
batches come from one length bucket each (sft_buckets: sft.seq_len / sft.episode_seq_len, mixed
by step share): one compiled shape per width, and a one-shot row is never padded to an
episode's width. In a multi-process job each process reads only its own rows of each global SFT
batch (sft_stream). SFT's steps compile two at a time on threads, SFT's own while the indexer
warm-up trains (supervised_step).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd
from model.config import ModelConfig
from model.tokenizer import load_tokenizer
from rl.checkpoint import Checkpointer
from rl.metrics import MetricsWriter
from rl.train_step import (
    TrainState,
    indexer_mask,
    init_train_state,
    init_train_state_sharded,
    make_optimizer,
    make_sft_step,
    train_state_shardings,
)
from sandbox.tasks.domains import is_multi_turn_task
from train.data import (
    agent_env_config,
    is_episode,
    load_task_splits,
    phase_data,
    sft_train_examples,
)
from train.models import (
    config_model,
    has_dsa,
    has_indexer,
    qat_model,
    warmup_model,
)
from train.phase import (
    end_phase,
    is_primary,
    next_global_batch,
    progress_bar,
    resume_state,
    start_phase,
)
from train.run_config import RunConfig
from train.state import optim_config, optim_numerics
from train.weights import checkpoint_variables


def sft_rows(tokenizer, seq_len):
    """(prompt, completion, ok) -> dict(tokens [L], loss_mask [L]) with the completion + EOS as
    targets; a multi-turn episode (is_episode) is rendered by rl.agent.encode_episode (the
    assistant's tokens are targets, observations not)."""
    from rl.agent import encode_episode

    def encode(ex):
        prompt, completion = ex[0], ex[1]
        if is_episode(ex):
            ids, target = encode_episode(tokenizer, prompt, completion)
        else:
            p = tokenizer.encode(tokenizer.chat_prompt(prompt), bos=True)
            c = tokenizer.encode(completion, eos=True)
            ids, target = p + c, [False] * len(p) + [True] * len(c)
        if len(ids) > seq_len:
            field = "episode_seq_len" if is_episode(ex) else "seq_len"
            raise ValueError(f"SFT example of {len(ids)} tokens exceeds sft.{field}="
                             f"{seq_len}: raise sft.{field}. Prompt: {prompt[:60]!r}")
        tok = np.full(seq_len, tokenizer.pad_id, np.int32)
        mask = np.zeros(seq_len, bool)
        tok[: len(ids)] = ids
        mask[: len(ids)] = target
        return {"tokens": tok, "loss_mask": mask}
    return encode


def sft_buckets(examples, s) -> list[dict]:
    """SFT examples split by row width (sft section `s`): one-shot rows padded to sft.seq_len,
    multi-turn episodes (a list of turns as the completion) to sft.episode_seq_len, each bucket
    with its batch size (sft.batch_size, sft.episode_batch_size) and its share of the steps
    (sft.episode_share for the episodes; None: proportional to the bucket's batches per epoch,
    so every example is seen equally often). A batch holds one bucket's rows only, so each
    width is one compiled step and a one-shot row never pays for an episode's width.
    -> [{"examples", "width", "batch_size", "weight"}] (one or two buckets)."""
    one = [ex for ex in examples if not is_episode(ex)]
    eps = [ex for ex in examples if is_episode(ex)]
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


def sft_stream(examples, tok, s, seed, *, mesh=None, rules=None):
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
        rows = list(map(sft_rows(tok, b["width"]), b["examples"]))
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
    `it` yields this process's rows of each global batch (sft_stream with the mesh); a stream
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
        state, rng = resume_state(ckpt, state, state_sh, rng, it, name)
    start = int(state.step)
    first_n, first_step = first if first is not None and start < first[0] else (0, None)
    for compiling in step.compiling + (first_step.compiling if first_step else []):
        compiling.result()  # this phase's programs, compiled ahead
    writer = MetricsWriter(workdir, config=config) if is_primary() else None
    bar = progress_bar(steps, name, start) if progress and is_primary() else None
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
    end_phase(ckpt, bar, writer)
    return state


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
    model, tok = config_model(config), load_tokenizer(config.tokenizer)
    qat_steps = s.qat_steps
    qmodel = qat_model(model.cfg) if qat_steps else None  # rejected before SFT runs
    mesh, rules = shd.mesh_from_config(config)
    it = sft_stream(examples, tok, s, config.seed, mesh=mesh, rules=rules)

    opt = make_optimizer(optim_config(s.lr, s.warmup_steps, s.steps, s.weight_decay,
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
        wopt = make_optimizer(optim_config(s.indexer_warmup_lr, max(warm_steps // 10, 1), warm_steps,
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
            sft_stream(examples, tok, s, config.seed + 1, mesh=mesh, rules=rules),
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
    qopt = make_optimizer(optim_config(s.qat_lr, max(qat_steps // 10, 1), qat_steps, s.weight_decay,
                                 optim_numerics(config)))
    return _supervised_phase(
        "sft_qat", qmodel, qopt, state.variables,
        sft_stream(examples, tok, s, config.seed + 2, mesh=mesh, rules=rules),
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
