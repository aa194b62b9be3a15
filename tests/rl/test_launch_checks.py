"""The launch checks (`--dry_run`, `--check_devices`; scripts/_common.py:launch_check) stop what
would fail at start-up before anything runs, each with the reason and exit code 2: an expert
axis that does not divide the experts, packed MXFP4 experts in a training phase, rollout rows
that split a GRPO group over processes, a train state that cannot be laid out on the mesh,
memory over the device (the planner's numbers). No device is touched and nothing compiles; the
subprocess tests take ~5 s each, the in-process ones under a second or two.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from configs import rl as rl_configs
from model import sharding as shd

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script(*args, timeout=300):
    return subprocess.run([sys.executable, "scripts/train_rl.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_check_devices_with_an_expert_axis_that_does_not_divide_is_a_message():
    r = _script("--config=configs/rl.py:reference",
                "--config.sharding.mesh=fsdp=8,expert=16,tensor=8", "--check_devices=1024")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "OK" not in r.stdout
    assert "num_experts=1000 is not divisible by the expert axis (16)" in r.stderr
    assert "use an expert axis in [2, 4, 5, 8, 10" in r.stderr


def test_dry_run_rejects_packed_experts_in_training():
    r = _script("--config=configs/rl.py:smoke_8dev", "--config.model.moe.expert_format=mxfp4",
                "--check_devices=8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "expert_format='mxfp4'" in r.stderr and "model.moe.qat=True" in r.stderr
    assert "OK" not in r.stdout


def test_rows_per_process_must_hold_whole_groups():
    from train.launch import check_groups, check_run_config

    c = rl_configs.get_config("smoke_8dev")  # 4 prompts x 2 = 8 rows over 8 row blocks
    shape = shd.mesh_shape(c.sharding.mesh, 8)
    assert "rollout rows per process: 4 (whole groups of 2: 2;" in check_groups(c, shape, 2)
    c.rl.update(dict(prompts_per_batch=2, group_size=4))  # 8 rows, 4 processes: 2 rows each
    with pytest.raises(ValueError, match=r"give each of the 4 processes 2 rows .* splits a "
                                         r"group of 4: make the rollout rows a multiple of 16"):
        check_groups(c, shape, 4)
    with pytest.raises(ValueError, match="splits a group"):
        check_run_config(c, 8, processes=4, state=False)
    assert "whole groups of 4: 2" in check_groups(c, shape, 1)  # one process holds all rows
    # the documented GPU pod: 128 processes on 128 row blocks, 512 rows -> one group each
    ref = rl_configs.get_config("reference")
    gpu = shd.mesh_shape("fsdp=16,expert=8,tensor=8")
    assert "rollout rows per process: 4 (whole groups of 4: 1;" in check_groups(ref, gpu, 128)
    ref.rl.prompts_per_batch = 64  # the rows the config had before: 2 per process
    with pytest.raises(ValueError, match="multiple of 512"):
        check_groups(ref, gpu, 128)


def test_train_state_is_built_for_the_real_mesh_with_bf16_params_and_a_master_copy():
    """The abstract train state (jax.eval_shape, AbstractMesh: a 64-device mesh on this host)
    with bf16 parameters and the default f32 master copy: its optimizer-state shardings follow
    the parameters', and the per-device bytes are the planner's for params + master + moments."""
    from rl.train_step import MasterCopyState
    from train.launch import abstract_train_state, check_run_config, state_bytes_per_device

    c = rl_configs.get_config("smoke_8dev")
    c.model.param_dtype = c.model.dtype = "bfloat16"
    shape = shd.mesh_shape("data=4,fsdp=4,expert=4")
    st = abstract_train_state(c, shape, "rl")
    assert isinstance(st.opt_state, MasterCopyState)
    w = st.params["layer_0"]["ffn"]["w_gate"]
    m = st.opt_state.master["layer_0"]["ffn"]["w_gate"]
    assert str(w.dtype) == "bfloat16" and str(m.dtype) == "float32"
    assert w.sharding.spec == m.sharding.spec and w.sharding.mesh.shape == shape
    assert state_bytes_per_device(st) > 0
    c.sharding.mesh = "data=4,fsdp=4,expert=4"
    assert "rl train state built for this mesh (abstract)" in check_run_config(c, 64,
                                                                               processes=8)


def test_memory_over_the_device_is_a_message():
    sys.path.insert(0, str(ROOT / "scripts"))
    import _common

    c = rl_configs.get_config("smoke_8dev")
    shape = shd.mesh_shape(c.sharding.mesh, 8)
    line = _common.memory_check(c, "rl", shape, "tpu-v6e")
    assert "rl memory on tpu-v6e (planner" in line and "rollouts next to" in line
    assert "NOT CHECKED" in _common.memory_check(c, "rl", shape, None)
    c.rl.max_new_tokens = 1 << 20  # a million generated tokens per row: nothing fits
    with pytest.raises(ValueError, match=r"rl does not fit on tpu-v6e .* training needs .* GB "
                                         r"per device, 28.8 GB usable"):
        _common.memory_check(c, "rl", shape, "tpu-v6e")


def test_scaling_doc_memory_tables_are_the_planners():
    """docs/scaling.md section 4: the per-device block and the launch table are what the planner
    computes now for configs/rl.py:reference (scripts/plan.py launch_plans; ~30-60 s: the
    planner traces the reference model's blocks)."""
    from model.plan import format_per_device
    from scripts.plan import format_launch_table, launch_plans

    docs = (ROOT / "docs" / "scaling.md").read_text()
    plans = launch_plans()
    block = format_per_device(plans[0]["plan"]).split("\n  assumptions:")[0]
    assert "```\n" + block + "\n```" in docs, "regenerate section 4's block:\n" + block
    table = format_launch_table(plans)
    assert table in docs, "regenerate with python scripts/plan.py --launch_table:\n" + table
    gpu, tpu, small = (p["plan"] for p in plans)
    for p in (gpu, tpu):  # the page's verdicts: the documented launches fit, training and rollouts
        assert p["rollout"]["fits"] and p["train"]["fits"], p["mesh"]
    assert not small["train"]["fits"] and not small["rollout"]["fits"]
    assert all(p["rows_per_process"] % p["group_size"] == 0 for p in plans)


# docs/scaling.md commands checked elsewhere: the pod lines (tests/rl/test_scale_config.py,
# --check_devices), the launch table (above, in-process), the benchmarks and the two-process
# check (their own runs: python scripts/multihost_check.py)
ELSEWHERE = ("configs/rl.py:reference --config.sharding.mesh", "--launch_table",
             "scripts/bench.py", "scripts/multihost_check.py")


def test_scaling_doc_commands_run_or_stop_with_a_reason():
    """Every command docs/scaling.md shows (tests/test_docs_commands.py's extraction) passes its
    launch check (--dry_run) or stops with the reason on stderr, exit code 2 and no traceback;
    none prints OK and then fails. ~5-10 s per command on 2 cores."""
    import os
    import shlex

    from tests.test_docs_commands import extract_commands

    cmds = extract_commands((ROOT / "docs" / "scaling.md").read_text(), "docs/scaling.md")
    ran = []
    for cmd in cmds:
        if any(x in cmd for x in ELSEWHERE):
            continue
        tokens = shlex.split(cmd)
        env = dict(os.environ)
        while "=" in tokens[0] and not tokens[0].startswith("-"):
            k, v = tokens.pop(0).split("=", 1)
            env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
        r = subprocess.run([sys.executable, *tokens[1:], "--dry_run"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        assert "Traceback" not in r.stderr, (cmd, r.stderr[-3000:])
        if r.returncode == 0:
            assert "error: " not in r.stderr, (cmd, r.stderr[-2000:])
        else:
            assert r.returncode == 2 and "error: " in r.stderr and "OK" not in r.stdout, \
                (cmd, r.returncode, r.stderr[-2000:])
        ran.append(cmd)
    assert any("smoke_8dev" in c and "train_rl.py" in c for c in ran)
    assert any("small_8dev" in c for c in ran) and len(ran) >= 4, ran
