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


def _train_cmd(workdir):
    return [sys.executable, os.path.join(ROOT, "scripts", "train_rl.py"),
            "--config", os.path.join(ROOT, "configs", "rl.py") + ":smoke",
            f"--config.workdir={workdir}", "--config.rl.init_from=scratch",
            "--config.rl.overlap_scoring=False", "--config.eval.every=0",
            "--config.rl.steps=4", "--config.rl.checkpoint_every=1",
            "--config.rl.keep_checkpoints=5", "--config.optim.total_steps=4"]


def _final(workdir):
    from configs import rl as rl_configs
    from rl.loop import load_rl_variables
    config = rl_configs.get_config("smoke")
    config.workdir = str(workdir)
    model = Model(ModelConfig.from_dict(config.model))
    return load_rl_variables(config, model)


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted_run(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    a, b = tmp_path / "a", tmp_path / "b"
    subprocess.run(_train_cmd(a), check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    proc = subprocess.Popen(_train_cmd(b), env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckdir = b / "rl" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ckdir / "2").exists():
        assert proc.poll() is None, "training ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = sorted(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
    assert 2 <= max(steps) < 4, steps  # killed mid-run
    subprocess.run(_train_cmd(b), check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    va, vb = _final(a), _final(b)
    for x, y in zip(jax.tree.leaves(va), jax.tree.leaves(vb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # same data position: the grain state files of the last checkpoints are identical
    da = sorted((a / "rl" / "checkpoints" / "4").rglob("process_*.json"))
    db = sorted((b / "rl" / "checkpoints" / "4").rglob("process_*.json"))
    assert da and [p.read_text() for p in da] == [p.read_text() for p in db]
