"""Two processes joined by jax.distributed run RL through scripts/train_rl.py; compared with one.

    python scripts/multihost_check.py                 # run time: README
    python scripts/multihost_check.py --steps 3 --workdir /tmp/mh

What it runs (CPU, fake devices; configs/rl.py:smoke_8dev from scratch: the test model with
expert-parallel MoE on a (data 2, fsdp 2, expert 2) mesh, GRPO with KL, sandbox rewards,
held-out evaluation of the demo's domains at the last step). The RL prompts are a task file
(tasks.task_file, written to the workdir by `check_tasks`): answer_check tasks that a random
policy solves by chance (the sandbox checks the parity of the answer's first byte), so the
rewards within a group differ and the advantages, hence the policy gradient and its sync
over processes, are not zero; and the demo's multi-step terminal episodes, played in lockstep
across the processes (their rewards stay 0 from scratch).

1. two processes (4 CPU devices each, gloo collectives, JAX_COORDINATOR_ADDRESS /
   JAX_NUM_PROCESSES / JAX_PROCESS_ID) run `scripts/train_rl.py` for --steps RL steps; each
   scores its own rollouts in its own sandbox pool and evaluates its share of the tasks;
2. one process with 8 CPU devices runs the same command on the same global batches;
3. one process with one device restores the two-process checkpoint (load_rl_variables).

It checks and prints: both processes end with the same parameter digest and agreeing replicas
(scripts/train_rl.py's last lines), the single-process run's digest and the largest parameter
difference between the two runs, the evaluation and reward metrics of both runs, and that the
checkpoint restored on one process has the two-process digest. Exit status 0 when the two
processes agree bit for bit and the checkpoint restores; the comparison with one process is
reported (bit-identical, or the largest difference).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/rl.py:smoke_8dev"


def _env(devices: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count", "--_x")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    env.update(extra or {})
    return env


PARITY_CHECK = """import sys
answer = open("answer.txt", "rb").read()
sys.exit(0 if answer and answer[0] % 2 == 0 else 1)
"""


def check_tasks(path: pathlib.Path, n_parity: int = 16, n_episodes: int = 8) -> pathlib.Path:
    """Writes the check's RL task file: n_parity answer_check tasks solved when the answer's
    first byte is even (some of a random policy's answers: non-zero advantages from scratch),
    and n_episodes multi-step terminal episodes of the demo's domain (level 1)."""
    from sandbox.tasks import Task, save_tasks
    from sandbox.tasks.domains import multistep

    parity = [Task(id=f"parity-{i}", family="answer_check", timeout_s=5.0,
                   prompt=f"Task {i}: answer with any text that starts with an even byte.",
                   check=PARITY_CHECK, check_language="python",
                   meta={"family_name": "parity"}) for i in range(n_parity)]
    save_tasks(parity + multistep.make_split("train", n_episodes, seed=0, difficulty=1), path)
    return path


def _cmd(workdir: pathlib.Path, steps: int, tasks: pathlib.Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train_rl.py"), "--config", CONFIG,
            f"--config.workdir={workdir}", "--config.rl.init_from=scratch",
            f"--config.tasks.task_file={tasks}",
            f"--config.rl.steps={steps}", f"--config.rl.checkpoint_every={steps}",
            f"--config.eval.every={steps}", "--config.eval.val_tasks=16", "--noresume"]


def _digest(text: str) -> list[str]:
    return re.findall(r"params digest ([0-9a-f]{64}); all replicas agree", text)


def _metrics(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "rl" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _run(cmds: list[tuple[list[str], dict]], log_dir: pathlib.Path, name: str,
         timeout: float) -> list[str]:
    procs, logs = [], []
    for i, (cmd, env) in enumerate(cmds):
        log = open(log_dir / f"{name}.{i}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    outs = [(log_dir / f"{name}.{i}.log").read_text() for i in range(len(cmds))]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"{name}: a process failed (rc {p.returncode}):\n{out[-6000:]}")
    return outs


RESTORE = """
import jax, numpy as np
from configs import rl
from model.transformer import Model
from model.config import ModelConfig
from train.weights import load_rl_variables
from rl.checkpoint import tree_digest
out = []
for wd in {workdirs!r}:
    c = rl.get_config("smoke_8dev"); c.workdir = wd
    v = load_rl_variables(c, Model(ModelConfig.from_dict(c.model)))
    assert jax.device_count() == 1 and all(len(x.devices()) == 1 for x in jax.tree.leaves(v))
    out.append(v)
print("digest", tree_digest(out[0]["params"]))
diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
           for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])))
print("maxdiff", diff)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default="runs/multihost_check")
    ap.add_argument("--timeout", type=float, default=1500)
    a = ap.parse_args()
    base = (ROOT / a.workdir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    two, one = base / "two_processes", base / "one_process"
    tasks = check_tasks(base / "tasks.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    t0 = time.time()
    outs = _run([(_cmd(two, a.steps, tasks), _env(4, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                               "JAX_NUM_PROCESSES": "2",
                                               "JAX_PROCESS_ID": str(i)}))
                 for i in range(2)], base, "two", a.timeout)
    t_two = time.time() - t0
    d_two = [(_digest(o) or ["missing"])[-1] for o in outs]
    t0 = time.time()
    d_one = (_digest(_run([(_cmd(one, a.steps, tasks), _env(8))], base, "one", a.timeout)[0])
             or ["missing"])[-1]
    t_one = time.time() - t0
    r = subprocess.run([sys.executable, "-c", RESTORE.format(workdirs=[
        str(two), str(one)])], env=_env(1), cwd=ROOT, capture_output=True, text=True,
        timeout=a.timeout)
    if r.returncode != 0:
        raise SystemExit(f"restoring on one process failed:\n{r.stderr[-6000:]}")
    d_restored = re.search(r"digest (\w+)", r.stdout).group(1)
    maxdiff = float(re.search(r"maxdiff (\S+)", r.stdout).group(1))

    m_two, m_one = _metrics(two), _metrics(one)
    keys = ("rl/reward_mean", "rl/adv_abs_mean", "rl/loss", "rl/kl_ref", "rl/grad_norm",
            "rl/rows_trained")
    print(f"two processes x 4 devices: {t_two:.0f} s; one process x 8 devices: {t_one:.0f} s")
    print(f"params digest, process 0: {d_two[0]}")
    print(f"params digest, process 1: {d_two[1]}")
    print(f"params digest, one process: {d_one}")
    print(f"params digest, two-process checkpoint restored on one device: {d_restored}")
    print(f"largest |two-process - one-process| parameter difference: {maxdiff:.3g}")
    for name, ms in (("two processes", m_two), ("one process", m_one)):
        for m in ms:
            row = {k: m[k] for k in keys if k in m}
            row.update({k: v for k, v in m.items() if k.startswith("val/")})
            if row:
                print(f"  {name} step {m['step']}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in row.items()))
    ok_two = d_two[0] == d_two[1] != "missing"
    ok_restore = d_restored == d_two[0]
    print(f"processes agree bit for bit: {ok_two}; checkpoint restores on one process: "
          f"{ok_restore}; equal to the one-process run bit for bit: {d_one == d_two[0]}")
    return 0 if ok_two and ok_restore else 1


if __name__ == "__main__":
    sys.exit(main())
