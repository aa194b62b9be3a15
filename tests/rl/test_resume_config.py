"""Resuming a workdir only with the config that wrote it, and --noresume keeping the old run
(train/workdir.py, train/phase.py:start_phase).

Covered: which config changes each stage depends on (a model field, an SFT hyper-parameter, the
agent's rendering for SFT; the RL objective and the sampling-only KDA prefill form for RL only; log cadence, eval and a phase's own
length for neither); a real SFT run refuses to resume under a changed config (naming the field
and the ways out, its checkpoints untouched), resumes under a changed cadence and a longer
schedule, and with resume=False moves the old run aside and trains a new one whose final weights
are the ones loaded afterwards (before the fix the old final step was "already saved" and the
new run's final weights were dropped); RL refuses to start from SFT weights of another config
and to resume RL checkpoints of another objective; SFT reads its own domains (sft.domains:
the agent variant's SFT is the demo's, one-shot rows and episodes, and a copy of it resumes).
Not covered: multi-process set-aside (process 0 moves, all wait: the barrier is jax's).
"""

import functools
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import train.data
import train.models
import train.rl
import train.sft
import train.weights
from configs import rl as rl_configs
from rl.checkpoint import Checkpointer
from rl.metrics import MetricsWriter
from train.workdir import (
    ResumeConfigError,
    check_resumable,
    phase_data,
    phase_diff,
    record_data,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _paths(diff):
    return [p for p, _, _ in diff]


def test_each_stage_depends_on_what_changes_its_weights():
    base = rl_configs.get_config("demo")

    def changed_config(**fields):
        c = rl_configs.get_config("demo")
        for path, v in fields.items():
            *head, last = path.split("__")
            node = c
            for h in head:
                node = node[h]
            node[last] = v
        return c

    def changed(**fields):
        c = changed_config(**fields)
        return {stage: _paths(phase_diff(base, c, stage)) for stage in ("sft", "sft_qat", "rl")}

    assert changed(model__d_model=128) == {s: ["model.d_model"] for s in ("sft", "sft_qat", "rl")}
    assert changed(sft__lr=2e-3) == {s: ["sft.lr"] for s in ("sft", "sft_qat", "rl")}
    assert changed(rl__agent__max_turns=3)["sft"] == ["rl.agent.max_turns"]  # SFT's episodes
    assert changed(rl__algo__kl_coef=0.1) == {"sft": [], "sft_qat": [],
                                              "rl": ["rl.algo.kl_coef"]}
    # a longer SFT is SFT's own continuation, but RL (and QAT) started from the shorter one's end
    assert changed(sft__steps=1500) == {"sft": [], "sft_qat": ["sft.dense_steps", "sft.steps"],
                                        "rl": ["sft.dense_steps", "sft.steps"]}
    assert changed(rl__steps=500) == {"sft": [], "sft_qat": [], "rl": []}  # optim.total_steps too
    assert changed(optim__lr=1e-3)["sft"] == [] and changed(optim__mu_dtype="bfloat16")["sft"] == [
        "optim.mu_dtype"]
    assert changed(sft__log_every=1, rl__checkpoint_every=5, eval__val_tasks=8,
                   workdir="elsewhere", tasks__test_per_domain=50) == {
        "sft": [], "sft_qat": [], "rl": []}
    assert changed(seed=3) == {s: ["seed"] for s in ("sft", "sft_qat", "rl")}
    # the agent variant's SFT is the demo's (its own domains): a copy of the demo's sft/ resumes
    demo, agent = rl_configs.get_config("demo"), rl_configs.get_config("agent")
    assert phase_diff(demo, agent, "sft") == []
    assert {"tasks.domains", "sft.domains"} <= set(_paths(phase_diff(demo, agent, "rl")))
    assert train.data.sft_domains(agent) == train.data.task_domains(demo) != train.data.task_domains(agent)
    for c in (demo, agent):
        c.tasks.train_per_domain = 6
    kinds = lambda c: sorted({train.data.is_episode(ex) for ex in train.data.sft_train_examples(c)})
    assert kinds(demo) == kinds(agent) == [False, True]  # one-shot rows and episodes
    agent.sft.domains = "multistep"  # SFT on the episodes alone: another SFT
    assert kinds(agent) == [True]
    assert _paths(phase_diff(demo, agent, "sft")) == ["tasks.domains"]
    # RL from scratch on both sides does not depend on SFT's settings
    a, b = rl_configs.get_config("demo"), rl_configs.get_config("demo")
    a.rl.init_from = b.rl.init_from = "scratch"
    b.sft.lr = 5e-3
    assert phase_diff(a, b, "rl") == []
    b.rl.init_from = "sft"
    assert _paths(phase_diff(a, b, "rl")) == ["rl.init_from", "sft.lr"]
    # a record from before rl.oversample existed resumes under its default, not under another
    old = base.to_dict()
    del old["rl"]["oversample"]
    assert phase_diff(old, base, "rl") == []
    assert changed(rl__oversample=2)["rl"] == ["rl.oversample"]
    assert phase_diff(old, changed_config(rl__oversample=2), "rl") == [
        ("rl.oversample", "<absent>", 2)]
    # a record from before the task-domain fields were renamed (tasks.families, ...) compares
    # under the new names (train/run_config.py:RENAMED_FIELDS)
    old = base.to_dict()
    old["tasks"]["families"] = old["tasks"].pop("domains")
    old["tasks"]["val_per_family"] = old["tasks"].pop("val_per_domain")
    old["sft"]["families"] = old["sft"].pop("domains")
    assert phase_diff(old, base, "sft") == phase_diff(old, base, "rl") == []
    assert _paths(phase_diff(old, changed_config(sft__domains="code"), "sft")) == ["tasks.domains"]
    # the KDA prefill form: only sampling reads it, so SFT resumes across it and RL does not (a
    # record from before the field ran the chunked form, 0)
    assert changed(model__kda__recurrent_max_len=0) == {
        "sft": [], "sft_qat": [], "rl": ["model.kda.recurrent_max_len"]}
    old = base.to_dict()
    del old["model"]["kda"]["recurrent_max_len"]
    assert phase_diff(old, base, "sft") == []
    assert phase_diff(old, base, "rl") == [("model.kda.recurrent_max_len", "<absent>", 128)]
    assert phase_diff(old, changed_config(model__kda__recurrent_max_len=0), "rl") == []
    # the RL prompt draw (rl.template_power): RL's data order, so RL only; absent reads as 1.0
    assert changed(rl__template_power=0.0) == {"sft": [], "sft_qat": [],
                                               "rl": ["rl.template_power"]}
    old = base.to_dict()
    del old["rl"]["template_power"]
    assert phase_diff(old, base, "rl") == []
    assert phase_diff(old, changed_config(rl__template_power=0.0), "rl") == [
        ("rl.template_power", "<absent>", 0.0)]
    # RL's own seed: RL only (SFT's weights do not depend on it); absent reads as unset
    assert changed(rl__seed=1) == {"sft": [], "sft_qat": [], "rl": ["rl.seed"]}
    old = base.to_dict()
    del old["rl"]["seed"]
    assert phase_diff(old, base, "rl") == []


def _steps(d):
    return sorted(int(p.name) for p in (d / "checkpoints").iterdir() if p.name.isdigit())


def _params(state):
    return jax.tree.leaves(jax.device_get(state.variables["params"]))


@pytest.mark.slow
def test_sft_resumes_only_its_own_config_and_noresume_keeps_the_old_run(tmp_path, cut_sft_config):
    _config = functools.partial(cut_sft_config, steps=3, checkpoint_every=1, dense_steps=0)
    a = _config(tmp_path)
    first = train.sft.run_sft(a, progress=False)
    sft = tmp_path / "sft"
    assert _steps(sft) == [2, 3]

    b = _config(tmp_path)
    b.sft.lr = a.sft.lr * 3
    with pytest.raises(ResumeConfigError) as e:
        train.sft.run_sft(b, progress=False)
    msg = str(e.value)
    assert "sft.lr: 0.003 -> 0.009" in msg.replace("0.0030000000000000005", "0.003"), msg
    assert "--noresume" in msg and "--config.workdir" in msg and "latest step 3" in msg
    assert _steps(sft) == [2, 3]  # nothing touched
    assert json.loads((sft / "config.json").read_text())["sft"]["lr"] == a.sft.lr
    assert json.loads((sft / "data.json").read_text()) == phase_data(a, "sft")  # what it read

    longer = _config(tmp_path)  # another cadence and a longer schedule: the same run, continued
    longer.sft.update(dict(steps=4, log_every=2, checkpoint_every=2))
    cont = train.sft.run_sft(longer, progress=False)
    assert int(cont.step) == 4 and _steps(sft) == [3, 4]
    assert len((sft / "metrics.jsonl").read_text().splitlines()) == 4  # 3 + 1, none again

    fresh = train.sft.run_sft(b, resume=False, progress=False)  # starts over; the old run is kept
    old = [p for p in tmp_path.iterdir() if p.name.startswith("sft.replaced-")]
    assert len(old) == 1 and _steps(old[0]) == [3, 4]
    assert json.loads((old[0] / "config.json").read_text())["sft"]["steps"] == 4
    assert int(fresh.step) == 3 and _steps(sft) == [2, 3]
    assert len((sft / "metrics.jsonl").read_text().splitlines()) == 3  # the new run's alone
    model = train.models.config_model(b)
    loaded = jax.tree.leaves(train.weights.load_sft_variables(b, model)["params"])
    for x, y in zip(loaded, _params(fresh)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(not np.array_equal(y, z) for y, z in zip(_params(fresh), _params(first)))

    # RL refuses to start from this workdir's SFT weights under another SFT config ...
    c = _config(tmp_path)
    c.sft.lr = a.sft.lr * 3
    c.sft.weight_decay = 0.5
    with pytest.raises(ResumeConfigError, match=r"(?s)sft holds checkpoints.*sft.weight_decay"):
        train.rl.run_rl(c, progress=False)
    # ... and to resume RL checkpoints written under another objective
    rl = tmp_path / "rl"
    MetricsWriter(str(rl), tensorboard=False, config=b).close()
    ck = Checkpointer(str(rl / "checkpoints"), keep=1)
    ck.save(1, fresh, rng=jax.random.key(0), force=True)
    ck.wait()
    ck.close()
    d = _config(tmp_path)
    d.sft.lr = b.sft.lr
    d.rl.algo.kl_coef = 0.5
    with pytest.raises(ResumeConfigError, match=r"(?s)rl holds checkpoints.*rl.algo.kl_coef"):
        train.rl.run_rl(d, progress=False)
    check_resumable(b, "rl")  # the config that wrote them resumes


def test_scripts_stop_with_the_message_not_a_traceback(tmp_path):
    """scripts/sft.py on a workdir holding another config's SFT checkpoint: exit code 2, the
    differing field and the ways out on stderr, no traceback, nothing trained or moved."""
    smoke = rl_configs.get_config("smoke")
    smoke.workdir = str(tmp_path)
    MetricsWriter(str(tmp_path / "sft"), tensorboard=False, config=smoke).close()
    ck = Checkpointer(str(tmp_path / "sft" / "checkpoints"), keep=1)
    ck.save(30, {"w": np.zeros(3, np.float32)}, rng=None, force=True)
    ck.wait()
    ck.close()
    r = subprocess.run([sys.executable, "scripts/sft.py", "--config", "configs/rl.py:smoke",
                        f"--config.workdir={tmp_path}", "--config.sft.lr=0.5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "sft.lr: 0.003 -> 0.5" in r.stderr and "--noresume" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]
    assert _steps(tmp_path / "sft") == [30]



def _dry_run_rejected(script: str, flag: str):
    """scripts/<script>.py --dry_run with one bad --config flag on the smoke config: exit code 2
    (the message on stderr is the caller's to check)."""
    r = subprocess.run([sys.executable, f"scripts/{script}.py", "--config", "configs/rl.py:smoke",
                        "--dry_run", flag], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    return r


def test_scripts_reject_a_bad_config_before_anything_runs(tmp_path):
    """A field the run config's schema rejects (train/run_config.py; here rl.oversample=0; with
    --dry_run rl.template_power=2, and sandbox.reuse_verdicts=-1 for evaluate.py) or does not
    have (rl.nonsense): exit code 2, the message on stderr, no traceback, nothing written to
    the workdir."""
    r = subprocess.run([sys.executable, "scripts/train_rl.py", "--config", "configs/rl.py:smoke",
                        f"--config.workdir={tmp_path / 'w'}", "--config.rl.oversample=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rl.oversample must be an int >= 1" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "w").exists()
    # --dry_run, the command meant to check a launch line, rejects it the same way
    r = _dry_run_rejected("train_rl", "--config.rl.template_power=2")
    assert "rl.template_power must be a number in [0, 1]" in r.stderr
    assert "Traceback" not in r.stderr
    r = _dry_run_rejected("evaluate", "--config.sandbox.reuse_verdicts=-1")
    assert "sandbox.reuse_verdicts must be an int >= 0" in r.stderr
    r = _dry_run_rejected("train_rl", "--config.rl.nonsense=1")
    assert "rl.nonsense: unknown field (--config.rl.nonsense); valid fields of rl: [" in r.stderr
    assert "Traceback" not in r.stderr
    r = _dry_run_rejected("train_rl", "--config.tasks.families=code")
    assert "tasks.families: renamed tasks.domains" in r.stderr and "--config.tasks.domains" in (
        r.stderr)


def test_a_run_trained_on_other_data_does_not_resume(tmp_path):
    """The same config drawing other data (here: the task file's contents changed; likewise a
    task generator's new draw after a code change): RL checkpoints trained on the old tasks are
    refused, naming the data and both digests; a run without a data record resumes."""
    from sandbox.tasks.loaders import save_tasks
    from sandbox.tasks.schema import Task

    def tasks(word):
        return [Task(id=f"{word}{i}", family="answer_check", prompt=f"say {word} {i}",
                     check="import sys\nsys.exit(0)\n", check_language="python", timeout_s=5)
                for i in range(8)]

    c = rl_configs.get_config("smoke")
    c.workdir, c.rl.init_from = str(tmp_path / "w"), "scratch"
    c.tasks.task_file = str(tmp_path / "tasks.jsonl")
    save_tasks(tasks("yes"), c.tasks.task_file)
    rl = tmp_path / "w" / "rl"
    MetricsWriter(str(rl), tensorboard=False, config=c).close()
    ck = Checkpointer(str(rl / "checkpoints"), keep=1)
    ck.save(5, {"w": np.zeros(3, np.float32)}, rng=None, force=True)
    ck.wait()
    ck.close()
    check_resumable(c, "rl")  # no data record (a run from before them): resumes
    recorded = phase_data(c, "rl")
    assert recorded["count"] == len(train.data.load_task_splits(c)["train"]) > 0
    record_data(c, "rl", recorded)
    check_resumable(c, "rl")  # the same tasks: resumes
    save_tasks(tasks("no"), c.tasks.task_file)  # same path and config, other contents
    with pytest.raises(ResumeConfigError, match=r"(?s)latest step 5\) trained on other data.*"
                       r"RL train tasks.*--noresume") as e:
        check_resumable(c, "rl")
    assert recorded["sha256"][:12] in str(e.value)
    assert phase_data(c, "rl")["sha256"][:12] in str(e.value)
