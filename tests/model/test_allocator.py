"""The scripts' allocator (runtime/xla_env.py:use_jemalloc): when a script's process re-executes
itself on jemalloc and when it does not, that its children do not inherit the preload, and that
the computed numbers do not depend on the allocator."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from runtime import xla_env as xe

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
SCRIPT = pathlib.Path(__file__).resolve()  # any existing file stands for "a script"


def _plan(environ=None, argv=(str(SCRIPT),), orig_argv=("python", str(SCRIPT)), modules=(),
          interactive=False, loaded=False, library=LIB):
    return xe.jemalloc_reexec_plan(dict(environ or {}), list(argv), list(orig_argv),
                                   dict.fromkeys(modules), interactive, loaded, library)


def test_reexec_plan():
    action, env = _plan({"LD_PRELOAD": "/opt/mine.so", "PATH": "/bin"})
    assert action == "exec"
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/mine.so"  # a user's own preload is kept, after
    assert env["MALLOC_CONF"] == xe.JEMALLOC_CONF and env["PATH"] == "/bin"
    assert env[xe._REEXEC_MARK] == LIB
    assert _plan({"MALLOC_CONF": "narenas:2"})[1]["MALLOC_CONF"] == "narenas:2"  # user's wins
    assert _plan(loaded=True) == ("clean", None)
    skips = {
        "KIMI_MALLOC=system": _plan({xe.JEMALLOC_ENV: "system"}),
        "re-executed once": _plan({xe._REEXEC_MARK: LIB}),  # the preload failed: no loop
        "interactive": _plan(interactive=True),
        "notebook": _plan(modules=("ipykernel",)),
        "pytest": _plan(modules=("pytest",)),
        "python -c": _plan(argv=("-c",)),
        "stdin": _plan(argv=("-",)),
        "missing file": _plan(argv=("/nonexistent/x.py",)),
        "no library": _plan(library=None),
    }
    for case, (action, reason) in skips.items():
        assert action == "skip" and reason, case
    assert "scripts/setup.sh" in skips["no library"][1]


_CHILD = r"""
import hashlib, json, os, subprocess, sys
print("started", flush=True)
from runtime.xla_env import configure_xla_env, jemalloc_loaded
configure_xla_env()
import jax, jax.numpy as jnp
x = jnp.arange(64 * 96, dtype=jnp.float32).reshape(64, 96) / 1000.0
g = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2)))(jnp.ones((96, 48)) * 0.01)
child = subprocess.run(["sh", "-c", "echo \"$LD_PRELOAD|$MALLOC_CONF\""], capture_output=True,
                       text=True).stdout.strip()
print(json.dumps({"loaded": jemalloc_loaded(), "preload": os.environ.get("LD_PRELOAD"),
                  "child_env": child,
                  "digest": hashlib.sha256(bytes(jax.device_get(g))).hexdigest()}))
"""


@pytest.fixture(scope="module")
def child_runs(tmp_path_factory):
    script = tmp_path_factory.mktemp("alloc") / "child.py"
    script.write_text(_CHILD)
    root = pathlib.Path(__file__).resolve().parents[2]
    out = {}
    for mode in ("jemalloc", "system"):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
        env.update(PYTHONPATH=str(root), KIMI_MALLOC=mode)
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        out[mode] = {"started": lines.count("started"), **json.loads(lines[-1])}
    return out


def test_scripts_run_on_jemalloc_and_children_start_clean(child_runs):
    assert xe.find_jemalloc(), "libjemalloc.so.2 is missing: run bash scripts/setup.sh"
    je, system = child_runs["jemalloc"], child_runs["system"]
    assert je["loaded"] and je["started"] == 2  # re-executed exactly once, then on jemalloc
    assert je["preload"] is None and je["child_env"] == "|"  # children inherit no preload
    assert not system["loaded"] and system["started"] == 1  # KIMI_MALLOC=system: no re-exec
    assert je["digest"] == system["digest"]  # the same numbers on either allocator


def test_the_suite_runs_on_jemalloc():
    """tests/conftest.py re-executes pytest on jemalloc and keeps the preload, so this worker
    (an xdist worker, or the pytest process itself) runs on it; KIMI_MALLOC=system opts out."""
    if os.environ.get(xe.JEMALLOC_ENV) == "system":
        assert not xe.jemalloc_loaded()
        return
    assert xe.jemalloc_loaded(), "the suite is not on jemalloc: run bash scripts/setup.sh"
    assert _plan(loaded=True) == ("clean", None)
    assert xe.jemalloc_reexec_plan({}, [str(SCRIPT)], ["python", str(SCRIPT)], {"pytest": None},
                                   False, True, LIB, test_suite=True) == ("keep", None)
    assert xe._REEXEC_MARK not in os.environ  # kept: the preload; dropped: the one-time mark
    assert xe.jemalloc_reexec_plan({}, [str(SCRIPT)], ["python", str(SCRIPT)], {"pytest": None},
                                   False, False, LIB, test_suite=True)[0] == "exec"
