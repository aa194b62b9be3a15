"""End-to-end RL loop tests: GRPO learns a trivially learnable sandbox-scored task, and the
driver survives SIGKILL (resume ends at the same step, data position and parameters)."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from configs import models
from model.config import ModelConfig
from model.tokenizer import ByteTokenizer
from model.transformer import Model
from rl.algorithms import get_algorithm
from rl.pipeline import RolloutWorker, build_train_batch
from rl.sampler import SamplingConfig
from rl.train_step import init_train_state, make_logp_fn, make_optimizer, make_train_step
from sandbox import SandboxPool
from sandbox.tasks.schema import Task
from sandbox.verifiers import Verifier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Reward 1 when the (byte-level) answer contains a digit, judged by a script in the sandbox.
DIGIT_CHECK = "import re, sys\nsys.exit(0 if re.search('[0-9]', open('answer.txt').read()) else 1)\n"


@pytest.mark.slow
def test_grpo_raises_reward_on_sandbox_scored_task():
    cfg = ModelConfig.from_dict(models.get_config("test"))
    model = Model(cfg)
    variables = model.init(jax.random.key(0))
    tasks = [Task(id=f"digit{i}", family="answer_check", prompt="say a digit", check=DIGIT_CHECK,
                  check_language="python", timeout_s=5) for i in range(2)]
    algo = get_algorithm("grpo", kl_placement="none", kl_coef=0.0)
    opt = make_optimizer(ConfigDict(dict(lr=1e-2, warmup_steps=1, total_steps=100,
                                         final_lr_frac=1.0, weight_decay=0.0, b1=0.9, b2=0.99,
                                         eps=1e-8, clip_norm=1.0)))
    state = init_train_state(variables, opt)
    step = make_train_step(model, algo, opt)
    logp_fn = make_logp_fn(model)
    rewards = []
    with SandboxPool(workers=2) as pool:
        worker = RolloutWorker(model, ByteTokenizer(), SamplingConfig(max_new_tokens=4),
                               Verifier(executor=pool), group_size=8, max_prompt_len=24)
        rng = jax.random.key(1)
        for _ in range(12):
            rng, sub = jax.random.split(rng)
            group = worker.start(state.variables, tasks, sub).result()
            assert not group.failed.any()
            batch, met = build_train_batch(group, algo, width=28)
            jb = {k: jnp.asarray(v) for k, v in batch.items()}
            jb["old_logp"] = logp_fn(state.variables, jb["tokens"], jb["loss_mask"])
            state, _ = step(state, jb)
            rewards.append(met["reward_mean"])
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.3, rewards


# The resume property is about the driver (params, optimizer and router state, rng, data
# position), not the architecture: a one-layer KDA + MoE model without MTP keeps every piece of
# the state while tracing and compiling in a fraction of the smoke model's time.
SMALL_MODEL = {"model.num_layers": 1, "model.layer_pattern": "K", "model.mtp.depth": 0}


def _train_cmd(workdir):
    return [sys.executable, os.path.join(ROOT, "scripts", "train_rl.py"),
            "--config", os.path.join(ROOT, "configs", "rl.py") + ":smoke",
            f"--config.workdir={workdir}", "--config.rl.init_from=scratch",
            "--config.rl.overlap_scoring=False", "--config.eval.every=0",
            "--config.rl.steps=4", "--config.rl.checkpoint_every=1",
            "--config.rl.keep_checkpoints=5", "--config.optim.total_steps=4",
            *(f"--config.{k}={v}" for k, v in SMALL_MODEL.items())]


def _final(workdir):
    from configs import rl as rl_configs
    from train.weights import load_rl_variables
    config = rl_configs.get_config("smoke")
    config.workdir = str(workdir)
    for k, v in SMALL_MODEL.items():
        node, *path = config, *k.split(".")
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = v
    model = Model(ModelConfig.from_dict(config.model))
    return load_rl_variables(config, model)


def _start(workdir, log):
    return subprocess.Popen(_train_cmd(workdir), env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_for(path, proc, log_path, what):
    deadline = time.time() + 900
    while not path.exists():
        assert proc.poll() is None, f"{what} ended early:\n{log_path.read_text()[-4000:]}"
        assert time.time() < deadline, f"{what}: no {path} after 900 s"
        time.sleep(0.2)


def _wait_ok(proc, log_path, what):
    try:
        rc = proc.wait(timeout=900)
    finally:
        _kill(proc)
    assert rc == 0, f"{what} failed (rc {rc}):\n{log_path.read_text()[-4000:]}"


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    logs = {n: tmp_path / f"{n}.log" for n in ("a", "b", "b_resume")}
    # The uninterrupted run (a) and the run that gets killed (b) are independent processes with
    # their own workdirs. b starts once a has written its first checkpoint: by then a has
    # compiled every program into the shared persistent compilation cache, so b (and its resume)
    # load them instead of compiling them again, while a finishes its remaining steps.
    with open(logs["a"], "w") as log_a, open(logs["b"], "w") as log_b:
        ref = _start(a, log_a)
        proc = None
        try:
            _wait_for(a / "rl" / "checkpoints" / "1", ref, logs["a"], "uninterrupted run")
            proc = _start(b, log_b)
            ckdir = b / "rl" / "checkpoints"
            _wait_for(ckdir / "2", proc, logs["b"], "run to be killed")
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            steps = sorted(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
            assert 2 <= max(steps) < 4, steps  # killed mid-run
        except BaseException:
            _kill(ref)
            raise
        finally:
            if proc is not None:
                _kill(proc)
        _wait_ok(ref, logs["a"], "uninterrupted run")
    with open(logs["b_resume"], "w") as log:
        _wait_ok(_start(b, log), logs["b_resume"], "resumed run")
    va, vb = _final(a), _final(b)
    for x, y in zip(jax.tree.leaves(va), jax.tree.leaves(vb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # same data position: the grain state files of the last checkpoints are identical
    da = sorted((a / "rl" / "checkpoints" / "4").rglob("process_*.json"))
    db = sorted((b / "rl" / "checkpoints" / "4").rglob("process_*.json"))
    assert da and [p.read_text() for p in da] == [p.read_text() for p in db]
