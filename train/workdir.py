"""Whether a run config may resume what a workdir holds, and starting a phase over without losing
the old run.

Each phase directory (workdir/sft, with its indexer_warmup/ and qat/ stages, and workdir/rl)
records the resolved config that last ran it (config.json, rl.metrics.MetricsWriter). Resuming
continues the checkpoints there as if they came from the current config, so before a phase
resumes, `check_resumable` compares the two on what the phase's weights depend on and raises
ResumeConfigError naming every difference and the ways out; `set_aside` is what --noresume does
with a phase directory that holds a previous run: moves it to <dir>.replaced-<UTC time> (nothing is
deleted, and the new run's checkpoints and metrics never mix with the old ones).

What a phase depends on (`PHASES`): the whole config except the fields listed as not affecting
it: where and how a run is logged, checkpointed, evaluated, sharded and scored (workdir, name,
eval, sandbox, sharding, log/checkpoint cadence, held-out split sizes), and the phase's own
length (sft.steps, sft.dense_steps, rl.steps and optim.total_steps: lengthening a finished phase
continues it under the new schedule); a field the recorded config lacks counts as the value
train/run_config.py's ADDED_FIELDS gives it (what runs before the field behaved with), and a
recorded field renamed since (RENAMED_FIELDS) compares under its new name. SFT depends on the
task domains it reads (sft.domains, or tasks.domains when that is empty), not on those RL uses, and ignores the RL section and RL's optimizer (config.optim) except
rl.agent (it renders the demonstrations' episodes) and the optimizer's numerics fields (train.state.optim_numerics), and the model fields only sampling reads
(model.kda.recurrent_max_len: SFT never samples); RL depends on everything SFT does and on those,
since it starts from SFT's weights and samples, unless both configs have rl.init_from="scratch"
(or "hf": a released checkpoint's weights, whose model section and hf_dir RL depends on).

Each phase directory also records what its weights were trained on (data.json: a digest of
SFT's demonstrations, `train.data.sft_train_examples`, or of RL's train tasks): the same config
can draw other data when the code that draws it changed (a task generator's new draw, a
loader) or the task file's contents did, and such checkpoints do not resume either.

Covered: tests/rl/test_resume_config.py. Not covered: checkpoints written before config.json or
data.json were recorded (resumed, with a warning for config.json), a workdir edited by hand, and
other code changes under the same config and data (another objective, another model code).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil

from rl.checkpoint import latest_committed_step
from train.data import phase_data
from train.run_config import ADDED_FIELDS, migrate

log = logging.getLogger(__name__)

_EVERY_PHASE = ("name", "workdir", "eval", "sandbox", "sharding", "tasks.val_per_domain",
                "tasks.test_per_domain", "sft.log_every", "sft.checkpoint_every",
                "rl.log_every", "rl.checkpoint_every", "rl.keep_checkpoints", "rl.precompile")

# stage -> (dotted prefixes that do not affect it, prefixes kept although under an ignored one)
# (SFT reads the RL section's agent rendering and the RL optimizer's numerics fields alone)
_SFT_KEEPS = ("rl.agent", "optim.mu_dtype", "optim.master_dtype")
# model fields only cached calls (sampling) read: SFT never samples, RL's rollouts do
_SAMPLING_ONLY = ("model.kda.recurrent_max_len",)
PHASES = {
    "sft": (_EVERY_PHASE + _SAMPLING_ONLY + ("sft.steps", "sft.dense_steps", "sft.qat_steps",
                                             "sft.qat_lr", "rl", "optim"), _SFT_KEEPS),
    "sft_qat": (_EVERY_PHASE + _SAMPLING_ONLY + ("sft.qat_steps", "rl", "optim"),
                _SFT_KEEPS),  # after SFT's end
    "rl": (_EVERY_PHASE + ("rl.steps", "optim.total_steps"), ()),  # total_steps: RL's length
}
# a stage's directory under the workdir -> its entry in PHASES
STAGE_DIRS = {"sft": "sft", os.path.join("sft", "indexer_warmup"): "sft",
              os.path.join("sft", "qat"): "sft_qat", "rl": "rl"}


DATA_RECORD = "data.json"  # in each phase directory: what its weights were trained on


class ResumeConfigError(ValueError):
    """A phase directory holds checkpoints of a run whose config (or data) differs from this
    one."""


def record_data(config, phase: str, record: dict) -> None:
    """Write `record` (phase_data) to <workdir>/<phase>/data.json (process 0)."""
    import jax

    if jax.process_index() != 0:
        return
    d = os.path.join(config.workdir, phase)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, DATA_RECORD), "w") as f:
        json.dump(record, f, indent=1)


def _plain(config) -> dict:
    """A config (RunConfig, ConfigDict or dict) as the JSON config.json holds (MetricsWriter's
    encoding), renamed fields under their new names (train/run_config.py:migrate)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return migrate(json.loads(json.dumps(d, sort_keys=True, default=str)))


def config_diff(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    """[(dotted path, old value, new value)] of every leaf that differs between two configs (a
    field present in only one side differs from the missing marker "<absent>")."""
    old, new = (_plain(x) if not prefix else x for x in (old, new))
    out = []
    for k in sorted(set(old) | set(new)):
        path = prefix + k
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, path + ".")
        elif a != b:
            out.append((path, a, b))
    return out


def _under(path: str, prefixes) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def _sft_view(d: dict) -> dict:
    """A plain config with tasks.domains replaced by the domains SFT reads (the non-empty
    sft.domains, else tasks.domains; train.data.sft_domains) and sft.domains dropped."""
    sft, tasks = dict(d.get("sft", {})), dict(d.get("tasks", {}))
    own = sft.pop("domains", "")
    if own:
        tasks["domains"] = own
    return {**d, "sft": sft, "tasks": tasks}


def phase_diff(old, new, phase: str) -> list[tuple[str, object, object]]:
    """config_diff restricted to what `phase` (a key of PHASES) depends on."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase!r}")
    ignored, kept = PHASES[phase]
    if phase != "rl":  # SFT reads its own domains (sft.domains, "" = tasks.domains)
        old, new = (_sft_view(_plain(c)) for c in (old, new))
    diff = [(p, a, b) for p, a, b in config_diff(old, new)
            if not (a == "<absent>" and p in ADDED_FIELDS and b == ADDED_FIELDS[p])]
    if phase == "rl" and all(_plain(c).get("rl", {}).get("init_from") in ("scratch", "hf")
                             for c in (old, new)):
        ignored = ignored + ("sft",)
    return [d for d in diff if not _under(d[0], ignored) or _under(d[0], kept)]


def _ways_out(phase: str, flag: str) -> str:
    return (f"Use another --config.workdir, or pass {flag} to start {phase} over here (the old "
            f"run is moved to {phase}.replaced-<time> beside it, not deleted)")


def check_resumable(config, phase: str, *, flag: str = "--noresume", data=None) -> None:
    """Raise ResumeConfigError if a stage directory of `phase` ("sft": workdir/sft and its
    indexer_warmup/ and qat/ stages; "rl": workdir/rl) holds checkpoints of a run whose recorded
    config (its config.json) differs from `config` on what the stage depends on (phase_diff), or
    whose recorded data (data.json) differs from what `config` draws now (`data`: phase_data's
    record, computed when None and needed). A checkpoint without a config record resumes with a
    warning, one without a data record as it is. `flag`: how the caller starts over."""
    latest = None
    for sub, stage in STAGE_DIRS.items():
        if sub.split(os.sep)[0] != phase:
            continue
        root = os.path.join(config.workdir, sub)
        step = latest_committed_step(os.path.join(root, "checkpoints"))
        if step is None:
            continue
        latest = step if latest is None else max(latest, step)
        record = os.path.join(root, "config.json")
        if not os.path.exists(record):
            log.warning("%s holds checkpoints (step %d) but no config.json recording the config "
                        "that wrote them; resuming them as this config's", root, step)
            continue
        with open(record) as f:
            old = json.load(f)
        diff = phase_diff(old, config, stage)
        if diff:
            lines = "\n".join(f"  {p}: {a!r} -> {b!r}" for p, a, b in diff[:20])
            more = f"\n  ... and {len(diff) - 20} more" if len(diff) > 20 else ""
            raise ResumeConfigError(
                f"{root} holds checkpoints (latest step {step}) of a run whose config differs "
                f"from this one in what that stage depends on (recorded -> now):\n{lines}{more}"
                f"\nResuming would continue (or, finished, reuse) those weights as this "
                f"config's. {_ways_out(phase, flag)}, or set the recorded values back.")
    record = os.path.join(config.workdir, phase, DATA_RECORD)
    if latest is None or not os.path.exists(record):
        return
    with open(record) as f:
        old = json.load(f)
    now = phase_data(config, phase) if data is None else data
    if old.get("sha256") != now["sha256"]:
        root = os.path.join(config.workdir, phase)
        raise ResumeConfigError(
            f"{root} holds checkpoints (latest step {latest}) trained on other data than this "
            f"config draws now: {now['data']} {old.get('count')} items, sha256 "
            f"{str(old.get('sha256'))[:12]} (recorded) -> {now['count']} items, "
            f"{now['sha256'][:12]} (now). The config is the same, so the code that draws the "
            f"data (a task generator, a loader) or the task file changed since. "
            f"{_ways_out(phase, flag)}.")


def set_aside(phase_dir: str) -> str | None:
    """Move a non-empty phase_dir to <phase_dir>.replaced-<UTC time> (what --noresume does: the
    new run starts from an empty directory, the old one is kept); returns the new path, or None
    when there was nothing to move. Process 0 moves; every process waits for it."""
    import jax

    moved = None
    if jax.process_index() == 0 and os.path.isdir(phase_dir) and os.listdir(phase_dir):
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        moved = f"{phase_dir.rstrip(os.sep)}.replaced-{stamp}"
        n = 1
        while os.path.exists(moved):
            moved = f"{phase_dir.rstrip(os.sep)}.replaced-{stamp}-{n}"
            n += 1
        shutil.move(phase_dir, moved)
        log.warning("starting over: the previous run in %s was moved to %s", phase_dir, moved)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"set_aside:{phase_dir}")
    return moved
