"""The ahead-of-time compile modules keep their layers, and the launch check's memory source.

model/aot.py and model/plan.py import nothing from rl/ or configs/ (at any depth: a
function-level import is still a dependency); pallas_kernels/tpu_compile.py and
pallas_kernels/check.py import nothing from model/, configs/ or rl/. The pod programs, which
need the RL train step and sampler, are compiled by rl/aot.py. Static (ast), well under a second.

rl.aot.launch_memory without libtpu (the suite's environment): the planner, saying why it did
not compile; source="compiled" refuses with the reason (no libtpu; SFT has no compiled programs).
"""

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "model/aot.py": ("rl", "configs", "scripts"),
    "model/plan.py": ("rl", "configs", "scripts"),
    "pallas_kernels/tpu_compile.py": ("model", "rl", "configs", "scripts"),
    "pallas_kernels/check.py": ("model", "rl", "configs", "scripts"),
}


def _imported(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("rel", sorted(FORBIDDEN))
def test_aot_modules_import_nothing_from_above(rel):
    bad = sorted(m for m in _imported(ROOT / rel)
                 if m.split(".")[0] in FORBIDDEN[rel])
    assert not bad, f"{rel} imports {bad}"


def test_launch_memory_without_libtpu_is_the_planners(monkeypatch):
    from configs import rl as rl_configs
    from model import sharding as shd
    from rl import aot

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
