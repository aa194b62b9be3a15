"""Fixtures shared by the RL tests."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

from configs import models
from model.config import ModelConfig
from model.transformer import Model


@pytest.fixture(scope="session")
def small_lm():
    """(model, variables): the test preset cut to one KDA layer (d_model 32, dense SwiGLU FFN,
    no MoE, no MTP), for tests whose subject is the sampler or the train step rather than the
    architecture; its programs compile in about half the test preset's time."""
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.d_model = 1, "K", 32
    c.moe.num_experts, c.moe.dense_dim, c.mtp.depth = 0, 32, 0
    model = Model(ModelConfig.from_dict(c))
    return model, model.init(jax.random.key(0))


@pytest.fixture(scope="session")
def cut_sft_config():
    """make(workdir, **sft) -> the smoke RL config on a cut test model (one DSA layer and its
    MoE, d_model 32, no MTP: the SFT programs compile in a fraction of the full test model's
    time), 8 train tasks per family, no indexer warm-up, logging every step, with the given
    sft fields on top; for tests whose subject is an SFT phase's driving (train/sft.py:run_sft)."""
    from configs import rl as rl_configs

    def make(workdir, **sft):
        c = rl_configs.get_config("smoke")
        c.workdir = str(workdir)
        c.model.num_layers, c.model.layer_pattern, c.model.d_model = 1, "D", 32
        c.model.moe.expert_dim, c.model.moe.dense_dim, c.model.mtp.depth = 32, 32, 0
        c.tasks.update(dict(train_per_domain=8, val_per_domain=2, test_per_domain=2))
        c.sft.update(dict(batch_size=4, indexer_warmup_steps=0, log_every=1, **sft))
        return c
    return make


class TwoProcesses:
    """Two local processes running `script` (a test file's __main__) joined by jax.distributed:
    a free coordinator port, `devices` fake CPU devices each, the repository on PYTHONPATH."""

    root = pathlib.Path(__file__).resolve().parents[2]

    def start(self, script, *args, devices: int) -> list:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for pid in range(2):
            env = dict(os.environ)
            flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count",
                                                     "--_x")
            env.update(
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
                JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
                PYTHONPATH=str(self.root) + os.pathsep + env.get("PYTHONPATH", ""))
            procs.append(subprocess.Popen(
                [sys.executable, str(pathlib.Path(script).resolve()), *map(str, args)], env=env,
                cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs

    @staticmethod
    def finish(procs, timeout: float = 600) -> list:
        """[(stdout, stderr)] of each process once all have exited (killed past `timeout`);
        fails the test with a process's output when its exit status is not 0."""
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=timeout))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (so, se) in zip(procs, outs):
            assert p.returncode == 0, f"process failed:\n{so[-3000:]}\n{se[-6000:]}"
        return outs


@pytest.fixture(scope="session")
def two_processes():
    """TwoProcesses: start(script, *args, devices=N) then finish(procs)."""
    return TwoProcesses()
