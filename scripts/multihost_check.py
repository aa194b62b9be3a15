"""Two processes joined by jax.distributed run RL through scripts/train_rl.py; compared with one.

    python scripts/multihost_check.py                  # 1 device per process: bit-identical
    python scripts/multihost_check.py --devices 4      # 4 per process: the largest difference
    python scripts/multihost_check.py --steps 3 --workdir /tmp/mh

Run time (3 steps, 2 CPU cores shared with other jobs): 3 to 4.5 minutes with --devices 1,
6 with --devices 4 (docs/scaling.md, section 3).

What it runs (CPU, fake devices; configs/rl.py:smoke_8dev from scratch: the test model with
expert-parallel MoE, GRPO with KL and DAPO's dynamic sampling filter, sandbox rewards, held-out
evaluation of the demo's domains, multi-step episodes included, before the first step and after
the last). The RL prompts are a task file (tasks.task_file, written to the workdir by
`check_tasks`): answer_check tasks that a random policy solves for some of its answers (the
sandbox checks the parity of the answer's first byte; 1 to 5 of a step's 8 here), so groups'
rewards differ at every step and the advantages, hence the policy gradient and its sync over
processes, are not zero.

1. two processes (--devices CPU devices each, gloo collectives, JAX_COORDINATOR_ADDRESS /
   JAX_NUM_PROCESSES / JAX_PROCESS_ID) run `scripts/train_rl.py` for --steps RL steps, saving
   every step; each scores its own rollouts in its own sandbox pool and evaluates its share;
2. one process with twice --devices CPU devices runs the same command on the same global
   batches;
3. one process with one device restores both runs' checkpoints (load_rl_variables) and
   compares them step by step (parameters and Adam moments).

The mesh (MESHES) with --devices 1 is expert=2: the batch and the experts split over the two
processes (data parallelism and the MoE all_to_all across them), and every cross-device sum
has two participants, whose sum is the same in any order. With --devices 4 it is smoke_8dev's
(data 2, fsdp 2, expert 2): sums over 4 or 8 participants run as gloo's ring on two processes
(each chunk summed starting from another participant) and in device order on one, so the
float results differ in their last bits from the first step's advantages on.

It prints the runs' parameter digests (scripts/train_rl.py's last lines), the largest parameter
difference, per step the two runs' parameter and Adam-moment differences, the RL metrics of
both runs (reward mean; keep_frac: the fraction of groups whose rewards differ, hence with
non-zero advantages; the global gradient norm) and the evaluations. Exit status 0 when every
step trained groups with non-zero advantages, the two processes agree bit for bit, the
checkpoint restores on one device with their digest, and, with --devices 1, the one-process
run is bit-identical to them.
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


def check_tasks(path: pathlib.Path, n_parity: int = 16) -> pathlib.Path:
    """Writes the check's RL task file: n_parity answer_check tasks solved when the answer's
    first byte is even (a random policy's answers often are: groups' rewards differ from
    scratch). The multi-step episodes stay in the evaluations, played in lockstep across the
    processes; as RL prompts a from-scratch policy never solves them (rewards all 0)."""
    from sandbox.tasks import Task, save_tasks

    parity = [Task(id=f"parity-{i}", family="answer_check", timeout_s=5.0,
                   prompt=f"Task {i}: answer with any text that starts with an even byte.",
                   check=PARITY_CHECK, check_language="python",
                   meta={"domain": "parity"}) for i in range(n_parity)]
    save_tasks(parity, path)
    return path


def _cmd(workdir: pathlib.Path, steps: int, tasks: pathlib.Path, mesh: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train_rl.py"), "--config", CONFIG,
            f"--config.workdir={workdir}", "--config.rl.init_from=scratch",
            f"--config.tasks.task_file={tasks}", f"--config.sharding.mesh={mesh}",
            f"--config.rl.steps={steps}", "--config.rl.checkpoint_every=1",
            f"--config.rl.keep_checkpoints={steps}",
            "--config.rl.algo.dynamic_sampling=True", f"--config.eval.every={steps}",
            "--config.eval.val_tasks=16", "--noresume"]


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
from rl.algorithms import algo_from_config
from rl.checkpoint import Checkpointer, tree_digest
from train.state import rl_state_shapes
from train.weights import load_rl_variables
c = rl.get_config("smoke_8dev")
model = Model(ModelConfig.from_dict(c.model))
out = []
for wd in {workdirs!r}:
    c.workdir = wd
    v = load_rl_variables(c, model)
    assert jax.device_count() == 1 and all(len(x.devices()) == 1 for x in jax.tree.leaves(v))
    out.append(v)
print("digest", tree_digest(out[0]["params"]))


def maxdiff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


print("maxdiff", maxdiff(out[0], out[1]))
# every saved step of both runs: the first step whose parameters or Adam moments differ
abstract = rl_state_shapes(c, model, algo_from_config(c.rl.algo))
ckpts = [Checkpointer(wd + "/rl/checkpoints", keep=None) for wd in {workdirs!r}]
for step in sorted(set(ckpts[0].all_steps()) & set(ckpts[1].all_steps())):
    a, b = (k.restore(step, abstract).state for k in ckpts)
    print(f"step {{step}}: largest difference {{maxdiff(a.params, b.params):.3g}} in parameters, "
          f"{{maxdiff(a.opt_state, b.opt_state):.3g}} in Adam moments")
for k in ckpts:
    k.close()
"""


# the mesh of each layout (devices per process); with one device per process every collective
# has two participants, one on each process, whose sum is the same in any order
MESHES = {1: "expert=2", 2: "fsdp=2,expert=2", 4: "data=2,fsdp=2,expert=2"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--devices", type=int, default=1, choices=sorted(MESHES),
                    help="fake CPU devices per process (the one-process run has twice as many)")
    ap.add_argument("--workdir", default="runs/multihost_check")
    ap.add_argument("--timeout", type=float, default=1500)
    a = ap.parse_args()
    mesh = MESHES[a.devices]
    base = (ROOT / a.workdir).resolve() / f"devices{a.devices}"
    base.mkdir(parents=True, exist_ok=True)
    two, one = base / "two_processes", base / "one_process"
    tasks = check_tasks(base / "tasks.jsonl")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"mesh {mesh}: two processes x {a.devices} device(s) against one process x "
          f"{2 * a.devices}, {a.steps} RL steps", flush=True)

    t0 = time.time()
    outs = _run([(_cmd(two, a.steps, tasks, mesh),
                  _env(a.devices, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                   "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}))
                 for i in range(2)], base, "two", a.timeout)
    t_two = time.time() - t0
    d_two = [(_digest(o) or ["missing"])[-1] for o in outs]
    t0 = time.time()
    d_one = (_digest(_run([(_cmd(one, a.steps, tasks, mesh), _env(2 * a.devices))], base, "one",
                          a.timeout)[0]) or ["missing"])[-1]
    t_one = time.time() - t0
    r = subprocess.run([sys.executable, "-c", RESTORE.format(workdirs=[
        str(two), str(one)])], env=_env(1), cwd=ROOT, capture_output=True, text=True,
        timeout=a.timeout)
    if r.returncode != 0:
        raise SystemExit(f"restoring on one process failed:\n{r.stderr[-6000:]}")
    d_restored = re.search(r"digest (\w+)", r.stdout).group(1)
    maxdiff = float(re.search(r"maxdiff (\S+)", r.stdout).group(1))

    m_two, m_one = _metrics(two), _metrics(one)
    keys = ("rl/reward_mean", "rl/keep_frac", "rl/rows_trained",
            "rl/adv_abs_mean", "rl/loss", "rl/kl_ref", "rl/grad_norm")
    print(f"two processes x {a.devices} device(s): {t_two:.0f} s; one process x "
          f"{2 * a.devices} devices: {t_one:.0f} s")
    print(f"params digest, process 0: {d_two[0]}")
    print(f"params digest, process 1: {d_two[1]}")
    print(f"params digest, one process: {d_one}")
    print(f"params digest, two-process checkpoint restored on one device: {d_restored}")
    print(f"largest |two-process - one-process| parameter difference: {maxdiff:.3g}")
    print("per step, the two-process checkpoint against the one-process one:")
    for line in re.findall(r"^step .*$", r.stdout, re.M):
        print("  " + line)
    for name, ms in (("two processes", m_two), ("one process", m_one)):
        for m in ms:
            row = {k: m[k] for k in keys if k in m}
            row.update({k: v for k, v in m.items() if k.startswith("val/")})
            if row:
                print(f"  {name} step {m['step']}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in row.items()))
    ok_two = d_two[0] == d_two[1] != "missing"
    # keep_frac (dynamic sampling): the share of rows in groups whose rewards differ
    informative = [m["rl/keep_frac"] for m in m_two if "rl/keep_frac" in m]
    ok_adv = len(informative) == a.steps and min(informative) > 0
    ok_restore = d_restored == d_two[0]
    print(f"every step trained groups with non-zero advantages: {ok_adv}; processes agree bit "
          f"for bit: {ok_two}; checkpoint restores on one process: {ok_restore}; equal to the "
          f"one-process run bit for bit: {d_one == d_two[0]}"
          + ("" if a.devices > 1 else " (required with one device per process)"))
    same = a.devices > 1 or d_one == d_two[0]
    return 0 if ok_adv and ok_two and ok_restore and same else 1


if __name__ == "__main__":
    sys.exit(main())
