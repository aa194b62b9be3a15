"""SandboxPool: ordering, per-call limits, crash replacement, sequences, statistics."""

import os
import signal
import time

import pytest

from sandbox import ExecutionResult, SandboxPool


def test_results_come_back_in_order(pool):
    # later submissions finish first; results still follow submission order
    codes = [f"import time; time.sleep({0.05 * (6 - i)}); print({i})" for i in range(6)]
    rs = pool.map(codes)
    assert [r.stdout for r in rs] == [f"{i}\n" for i in range(6)]
    rs = pool.run_batch([{"code": "print('a')"}, {"code": "echo b", "language": "bash"},
                         {"code": "import sys; sys.exit(2)"}, {"code": "while True: pass", "timeout_s": 1}])
    assert [r.status for r in rs] == ["ok", "ok", "error", "timeout"]
    assert [r.stdout for r in rs[:2]] == ["a\n", "b\n"]


def test_per_call_limits(pool):
    futs = [pool.submit("x = bytearray(200 << 20); print('ok')", memory_mb=m) for m in (64, 512)]
    a, b = (f.result() for f in futs)
    assert a.status == "memory" and b.status == "ok"
    r = pool.run("import time; time.sleep(0.5); print('done')", timeout_s=5)
    assert r.status == "ok"
    r = pool.run("print('x' * 5000)", output_limit_bytes=100)
    assert r.status == "output_limit" and len(r.stdout) == 100


def test_futures_and_workers(pool):
    futs = [pool.submit("import os; print(os.getuid())") for _ in range(8)]
    rs = [f.result(timeout=120) for f in futs]
    assert all(r.ok for r in rs)
    assert {int(r.stdout) for r in rs} <= set(pool.worker_uids())
    assert {r.worker for r in rs} <= {0, 1}
    assert len(set(pool.worker_uids())) == 2  # one uid per slot


def test_sequence_shares_the_working_directory(pool):
    rs = pool.run_sequence([
        {"code": "echo 1 > a.txt; sleep 100 &", "language": "bash", "files": {"in.txt": "x"}},
        {"code": "import os; print(sorted(os.listdir('.'))); print(open('a.txt').read().strip())"},
        {"code": "pgrep sleep || echo none; ls", "language": "bash"},
    ])
    assert [r.status for r in rs] == ["ok", "ok", "ok"]
    assert rs[1].stdout == "['a.txt', 'in.txt']\n1\n"
    assert rs[2].stdout.startswith("none\n")  # no process survives from one step to the next
    # and nothing survives the sequence
    assert pool.run("import os; print(os.listdir('.'))").stdout == "[]\n"


def test_stats(pool):
    pool.map(["pass"] * 4)
    s = pool.stats()
    assert s["workers"] == 2 and s["completed"] >= 4 and s["in_flight"] == 0
    assert s["by_status"].get("ok", 0) >= 4
    for key in ("latency_ms", "exec_ms", "queue_ms"):
        assert set(s[key]) == {"p50", "p90", "p99", "max", "mean"} and s[key]["p50"] > 0
    assert s["runs_per_s"] > 0 and s["submitted"] >= s["completed"]


def test_crashed_worker_is_replaced_and_task_reported():
    with SandboxPool(workers=1) as p:
        pid0 = p.worker_pids()[0]
        uid0 = p.worker_uids()[0]
        fut = p.submit("import time; print('started', flush=True); time.sleep(60)", timeout_s=120)
        queued = p.submit("print('after crash')")
        # wait until the sandbox process of the slot exists, then kill the worker process
        from sandbox.host import pids_of_uid

        deadline = time.monotonic() + 60
        while not pids_of_uid(uid0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pids_of_uid(uid0)
        os.kill(pid0, signal.SIGKILL)
        r = fut.result(timeout=120)
        assert isinstance(r, ExecutionResult) and r.status == "sandbox_error"
        assert "crash" in r.message
        after = queued.result(timeout=120)
        assert after.status == "ok" and after.stdout == "after crash\n"
        assert p.worker_pids()[0] != pid0
        assert p.stats()["worker_restarts"] == 1
        # the dead worker's sandbox died with it (bwrap --die-with-parent, parent-death signals)
        deadline = time.monotonic() + 30
        while pids_of_uid(uid0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pids_of_uid(uid0)


def test_close_cancels_or_drains():
    p = SandboxPool(workers=1)
    futs = [p.submit("import time; time.sleep(0.2)") for _ in range(3)]
    p.close()  # drains
    assert all(f.result().ok for f in futs)
    with pytest.raises(RuntimeError):
        p.submit("pass")
    p2 = SandboxPool(workers=1)
    first = p2.submit("import time; time.sleep(0.5)")
    rest = [p2.submit("pass") for _ in range(5)]
    time.sleep(0.2)
    p2.close(cancel_pending=True)
    assert first.result().ok
    assert any(f.cancelled() for f in rest)


def test_stale_slots_are_swept():
    """A slot whose owner died (SIGKILL: no cleanup) leaves a mount, cgroups and a directory;
    the next start sweeps them."""
    import subprocess
    import sys

    from sandbox.cgroups import CgroupLayout
    from sandbox.config import SandboxConfig
    from sandbox.host import _mountpoints, _slot_dir, sweep_stale

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import time\nfrom sandbox.executor import Slot\ns = Slot()\n"
            "print(s.uid, *s.cg.dirs.values() if s.cg else [], flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                            env=dict(os.environ, PYTHONPATH=root))
    line = proc.stdout.readline().split()
    uid, cg_dirs = int(line[0]), line[1:]
    proc.kill()
    proc.wait()
    cfg = SandboxConfig()
    work = os.path.join(_slot_dir(cfg, uid), "work")
    assert work in _mountpoints() and all(os.path.isdir(d) for d in cg_dirs)
    swept = sweep_stale(cfg, CgroupLayout())
    assert uid in swept
    assert work not in _mountpoints()
    assert not os.path.exists(_slot_dir(cfg, uid))
    assert not any(os.path.isdir(d) for d in cg_dirs)
