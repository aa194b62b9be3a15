"""The `sharding` node of the run configs: presets, overrides from the command line, meshes built
from it, the static launch check (`--check_devices`) and the launch lines of docs/scaling.md.

In-process and cheap (no model is compiled); what runs on a mesh is tested in
tests/rl/test_sharded_rl.py (8 fake devices) and tests/rl/test_multihost.py (two processes).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from configs import rl as rl_configs
from model import sharding as shd

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = (ROOT / "docs" / "scaling.md").read_text()


def test_every_variant_has_a_valid_sharding_node():
    for name in rl_configs.VARIANTS:
        c = rl_configs.get_config(name)
        assert c.sharding.preset in shd.SHARDING_PRESETS, name
        assert c.sharding.mesh == shd.SHARDING_PRESETS[c.sharding.preset]
        rules = shd.rules_from_config(c)
        assert rules["batch"] == ("data", "fsdp", "expert") and rules["heads"] == ("tensor",)
    assert rl_configs.get_config("demo").sharding.preset == "one_device"
    assert rl_configs.get_config("smoke_8dev").sharding.preset == "eight_devices"
    assert rl_configs.get_config("small_8dev").model.name == "small"
    # preset meshes for their device counts
    assert shd.mesh_shape(shd.SHARDING_PRESETS["eight_devices"], 8) == \
        {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    assert shd.mesh_shape(shd.SHARDING_PRESETS["multihost_slice"], 1024)["fsdp"] == 16
    assert shd.mesh_shape(shd.SHARDING_PRESETS["all_devices"], 8)["data"] == 8
    with pytest.raises(ValueError, match="unknown sharding preset"):
        shd.sharding_config("pod")


def test_mesh_from_config_on_this_process():
    c = rl_configs.get_config("smoke")
    mesh, rules = shd.mesh_from_config(c)
    assert mesh.devices.size == 1 and rules == shd.make_rules()
    c.sharding.rules.heads = "none"  # a rule override reaches the rules
    assert shd.mesh_from_config(c)[1]["heads"] == ()
    c.sharding.mesh = "data=2"  # more devices than this process has: a clear error
    with pytest.raises(ValueError, match="2 devices, but 1 are available"):
        shd.mesh_from_config(c)
    c.sharding.mesh = "pipeline=2"
    with pytest.raises(ValueError, match="unknown mesh axis"):
        shd.mesh_from_config(c)


def test_check_run_config_catches_what_cannot_run():
    from train.launch import check_run_config

    c = rl_configs.get_config("reference")
    c.sharding.mesh = "fsdp=16,expert=8,tensor=4"
    report = check_run_config(c, 512, state=False)
    assert "mesh data=1,fsdp=16,expert=8,tensor=4 (512 devices, 128 processes)" in report
    assert "split 128 ways over fsdp, expert" in report and "warning" not in report
    c.sharding.mesh = "fsdp=8,expert=16,tensor=4"  # 1000 experts do not split 16 ways
    with pytest.raises(ValueError, match="not divisible by the expert axis"):
        check_run_config(c, 512, state=False)
    c.sharding.mesh = "fsdp=16,expert=8,tensor=4"
    with pytest.raises(ValueError, match="devices"):
        check_run_config(c, 256, state=False)  # the mesh needs 512
    c = rl_configs.get_config("smoke_8dev")
    c.rl.prompts_per_batch = 3  # 6 rows do not split 8 ways
    assert "warning: rollout rows" in check_run_config(c, 8, processes=1, state=False)


# The launch lines of docs/scaling.md that name a mesh larger than this machine: each must be
# in the page verbatim; here the same line is checked for its device count and process count
# (--check_devices, --processes: the train state of the 2.8T model built for the mesh, groups
# per process; 40-70 s each on 2 busy cores). Their memory on --device is the planner's launch table, compared with the
# page by tests/rl/test_launch_checks.py.
POD_LINES = [
    ("JAX_DISTRIBUTED_AUTO=1 python scripts/train_rl.py --config=configs/rl.py:reference \\\n"
     "      --config.sharding.mesh=fsdp=64,expert=8,tensor=4 --config.rl.prompts_per_batch=512 \\\n"
     "      --config.rl.max_new_tokens=1024", 2048, 512),
    ("python scripts/train_rl.py \\\n    --config=configs/rl.py:reference "
     "--config.sharding.mesh=fsdp=16,expert=8,tensor=8", 1024, 128),
]


@pytest.mark.parametrize("line,devices,processes", POD_LINES, ids=["tpu_slice", "gpu_nodes"])
def test_pod_launch_lines_in_docs_validate(line, devices, processes):
    assert line in DOCS, f"docs/scaling.md no longer has the launch line:\n{line}"
    args = line.split("python ", 1)[1].replace("\\\n", " ").split()
    r = subprocess.run([sys.executable, *args, f"--check_devices={devices}",
                        f"--processes={processes}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({devices} devices, {processes} processes)" in r.stdout
    assert "rollout rows per process: 4 (whole groups of 4: 1;" in r.stdout
    assert r.stdout.rstrip().endswith("OK: nothing above would stop this run at start-up")


def test_sandbox_client_concurrency_sizing_rule():
    from train.rollouts import client_concurrency

    c = rl_configs.get_config("smoke")
    assert client_concurrency(c) == 16  # nothing known about the fleet
    c.sandbox.fleet_slots = 40
    assert client_concurrency(c) == 40  # one process fills every slot
    c.sandbox.client_concurrency = 7  # an explicit value wins
    assert client_concurrency(c) == 7
