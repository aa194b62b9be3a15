"""The launch check's memory source (train/aot.py:launch_memory; the packages' layering is
tests/test_import_layering.py's).

train.aot.launch_memory without libtpu (the suite's environment): the planner, saying why it did
not compile; source="compiled" refuses with the reason (no libtpu; SFT has no compiled programs).
"""

import importlib.util

import pytest


def test_launch_memory_without_libtpu_is_the_planners(monkeypatch):
    from configs import rl as rl_configs
    from model import sharding as shd
    from train import aot

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    c = rl_configs.get_config("smoke_8dev")
    shape = shd.mesh_shape(c.sharding.mesh, 8)
    m = aot.launch_memory(c, "rl", shape, "tpu-v5p")
    assert m["source"].startswith("planner; not compiled: libtpu is not installed")
    assert m["train"] == m["plan"]["train"]["total"] and m["rollout"] > 0
    with pytest.raises(ValueError, match="libtpu is not installed"):
        aot.launch_memory(c, "rl", shape, "tpu-v5p", source="compiled")
    with pytest.raises(ValueError, match="no compiled programs"):
        aot.launch_memory(c, "sft", shape, "tpu-v5p", source="compiled")
    with pytest.raises(ValueError, match="memory source must be one of"):
        aot.launch_memory(c, "rl", shape, "tpu-v5p", source="xla")
