"""What every phase of a run shares: starting or resuming a phase (start_phase, resume_state),
the global batch agreed over processes (next_global_batch, DataExhausted), the primary process
and its progress bar, and a phase's end (end_phase)."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

from model import sharding as shd
from rl.checkpoint import Checkpointer
from train.workdir import check_resumable, record_data, set_aside

log = logging.getLogger(__name__)


def is_primary() -> bool:
    return jax.process_index() == 0


def progress_bar(total, desc, initial=0):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True, leave=True)


class DataExhausted(RuntimeError):
    """A process's data stream ended; raised on every process at the same step
    (next_global_batch), so the job ends everywhere instead of hanging in a collective."""


def end_phase(ckpt: Checkpointer, bar=None, writer=None) -> None:
    """A phase's end: its progress bar closed, its last checkpoint written and the checkpointer
    closed, its metrics writer closed."""
    if bar is not None:
        bar.close()
    ckpt.wait()
    ckpt.close()
    if writer is not None:
        writer.close()


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


def start_phase(config, phase: str, resume: bool, data: dict) -> None:
    """Before a phase ("sft" or "rl") runs: resuming, its checkpoints must come from this config
    and from this data (`data`: train.workdir.phase_data's record of what the phase trains on;
    train.workdir.check_resumable raises naming the differences); starting over (resume=False),
    the previous run's directory is moved aside (train.workdir.set_aside), so its checkpoints are
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


def resume_state(ckpt: Checkpointer, state, shardings, rng, data_iter, name: str):
    """(state, rng) of the latest good checkpoint in `ckpt` (restored into `shardings`, the data
    iterator set to its saved position), or the given (state, rng) when there is none."""
    restored = ckpt.restore_latest(_sharded_target(state, shardings), data_iter=data_iter)
    if restored is None:
        return state, rng
    state, rng, _, _ = restored
    log.info("%s resumed at step %d", name, int(state.step))
    return state, _local_key(rng)
