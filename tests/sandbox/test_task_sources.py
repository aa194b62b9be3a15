"""Task sources written by others, read offline: AgentBench's OS tasks from the installed
inspect-evals package and Terminal-Bench 2 task folders (what becomes of each, what is refused
and why). Playing them in sandbox sessions: tests/sandbox/test_task_source_episodes.py."""

import os
import shutil

import pytest

from rl.envs import final_answer
from sandbox.tasks import agentbench
from sandbox.tasks.agentbench import load_agentbench_os
from sandbox.tasks.schema import TaskFormatError
from sandbox.tasks.terminal_bench import NotRunnable, load_tb2_dir, load_tb2_task

TB2 = os.path.join(os.path.dirname(agentbench.__file__), "data", "terminal_bench2")


@pytest.fixture(scope="module")
def ab():
    return load_agentbench_os("all")


def test_agentbench_counts_and_reasons(ab):
    assert len(ab.tasks) + len(ab.skipped) == 145
    assert len(ab.tasks) == 120, ab.summary()
    reasons = dict(ab.skipped)
    assert "init/stock-log.sh" in reasons["agentbench-os/test/0"]
    assert "single uid" in reasons["agentbench-os/test/30"]       # useradd + runuser
    assert "apt" in reasons["agentbench-os/test/33"]
    assert "pid namespace" in reasons["agentbench-os/test/37"]    # counts `sleep infinity &`s
    assert "120 of 145 tasks runnable" in ab.summary()
    assert {t.split("/")[1] for t, _ in ab.skipped} == {"dev", "test"}
    assert load_agentbench_os("dev").tasks[0].id.startswith("agentbench-os/dev/")
    with pytest.raises(ValueError, match="split must be one of"):
        load_agentbench_os("train")


def test_agentbench_task_shapes(ab):
    by_id = {t.id: t for t in ab.tasks}
    for t in ab.tasks:
        assert t.family == "terminal" and t.meta["agent"] and t.check
        assert t.meta["workspace"]["cwd"] == "/home/agent" and t.meta["workspace"]["as_root"]
        if t.meta.get("answer_task"):
            assert t.check_language == "python" and (t.answer or t.meta.get("reference"))
    # a background writer is a start command, its answer a match (no example in the record)
    t = by_id["agentbench-os/dev/0"]
    assert "while True" in t.meta["start"] and t.answer == "1" and "reference" not in t.meta
    # where a record has a match and an example, the example computes the expected value here
    t = by_id["agentbench-os/dev/13"]                      # nproc: "4" in the package's image
    assert t.meta["reference"] == "nproc" and t.answer == ""
    # state tasks: the package's check script, the example as the solution
    t = by_id["agentbench-os/test/18"]
    assert t.meta.get("answer_task") is None and "calc" in t.check and t.meta["solution"]
    # the SUID task gets the image's copy of find; init_at_start inits are start commands
    assert "cp /usr/bin/find /home/agent/bin/find" in by_id["agentbench-os/test/31"].setup
    assert "tmpdir" in by_id["agentbench-os/test/27"].meta["start"]
    # the per-label breakdown
    assert by_id["agentbench-os/dev/0"].meta["template"] == "file/process/background"


def test_agentbench_package_missing(monkeypatch):
    monkeypatch.setattr(agentbench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(agentbench.PackageMissing, match="pip install --no-deps inspect-evals"):
        load_agentbench_os("dev")


def test_final_answer():
    assert final_answer("act: answer(3)") == "3"
    assert final_answer("  log \n") == "log"
    assert final_answer("answer(a(b))") == "a(b)"
    assert final_answer("I think answer(3) is wrong, so 4") == "I think answer(3) is wrong, so 4"


def test_tb2_examples_load():
    found = load_tb2_dir(TB2)
    assert [t.id for t in found.tasks] == ["terminal-bench-2/count-errors",
                                           "terminal-bench-2/fix-script",
                                           "terminal-bench-2/merge-config"]
    assert found.skipped == []
    merge = found.tasks[2]
    assert merge.meta["workspace"]["cwd"] == "/app" and "/opt" in merge.meta["workspace"]["dirs"]
    assert "/opt/defaults/app.ini" in merge.setup and merge.meta["solution"]
    fix = found.tasks[1]
    assert fix.memory_mb == 512 and fix.meta["disk_mb"] == 64 and fix.timeout_s == 30.0
    assert "printf" in fix.setup                      # the RUN step, replayed as setup
    assert "/logs/verifier/reward.txt" in fix.check and "rm -rf /tests/*" in fix.check


def _copy(tmp_path, name="count-errors"):
    d = tmp_path / name
    shutil.copytree(os.path.join(TB2, name), d)
    return d


@pytest.mark.parametrize("dockerfile, why", [
    ("FROM python:3.12\nRUN apt-get update && apt-get install -y jq\n", "needs the network"),
    ("FROM python:3.12\nRUN pip install numpy\n", "needs the network"),
    ("FROM python:3.12\nADD https://example.org/x.tar.gz /app/\n", "URL needs the network"),
    ("FROM python:3.12\nENV API_KEY=1\n", "ENV API_KEY"),
    ("FROM python:3.12\nUSER app\n", "single uid"),
    ("FROM python:3.12\nCMD [\"python3\", \"-m\", \"http.server\"]\n", "starts a service"),
    ("FROM python:3.12\nCOPY logs/ /etc/logs/\n", "system directory"),
])
def test_tb2_not_runnable_dockerfiles(tmp_path, dockerfile, why):
    d = _copy(tmp_path)
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    with pytest.raises(NotRunnable, match=why):
        load_tb2_task(d)


def test_tb2_not_runnable_other(tmp_path):
    d = _copy(tmp_path)
    (d / "environment" / "Dockerfile").unlink()
    with pytest.raises(NotRunnable, match="prebuilt image"):
        load_tb2_task(d)
    d = _copy(tmp_path, "fix-script")
    (d / "tests" / "test.sh").write_text("curl -LsSf https://astral.sh/uv/install.sh | sh\n")
    with pytest.raises(NotRunnable, match="tests/test.sh fetches with the network"):
        load_tb2_task(d)
    d = _copy(tmp_path, "merge-config")
    (d / "task.toml").write_text('version = "1.0"\n[environment]\nallow_internet = true\n')
    with pytest.raises(NotRunnable, match="allow_internet"):
        load_tb2_task(d)
    found = load_tb2_dir(tmp_path)
    assert len(found.skipped) == 3 and not found.tasks and "not runnable here" in found.summary()


@pytest.mark.parametrize("breakage, names", [
    (lambda d: (d / "instruction.md").unlink(), "instruction.md"),
    (lambda d: (d / "task.toml").unlink(), "task.toml is missing"),
    (lambda d: (d / "task.toml").write_text("[agent\ntimeout_sec = 3"), "task.toml: not valid TOML"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout = 3\n"), "unknown key 'timeout'"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = 'x'\n"), "wrong type"),
    (lambda d: (d / "task.toml").write_text("[runner]\n"), "unknown section"),
    (lambda d: (d / "tests" / "test.sh").unlink(), "tests/test.sh is missing"),
    (lambda d: (d / "environment" / "Dockerfile").write_text("FROM x\nCOPY nope.txt /app/\n"),
     "Dockerfile: line 2: nope.txt is not in environment/"),
    (lambda d: (d / "environment" / "Dockerfile").write_text("FROM x\nFROBNICATE y\n"),
     "unknown instruction FROBNICATE"),
    (lambda d: (d / "environment" / "Dockerfile").write_text("WORKDIR /app\n"), "no FROM line"),
    (lambda d: (d / "task.toml").write_text("[environment]\nmemory = 'lots'\n"), "is not a size"),
])
def test_tb2_malformed_folders_name_the_file(tmp_path, breakage, names):
    d = _copy(tmp_path)
    breakage(d)
    with pytest.raises(TaskFormatError, match=names):
        load_tb2_task(d)
