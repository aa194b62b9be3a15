"""Limits that judge programs fairly: memory is the memory cgroup's call (no
address-space limit behind it, so threads and pools of ordinary size run at the default 512 MB),
a CPU quota per sandbox, a memory peak that is the run's own, and caller mistakes that raise
InvalidRequest at submit time instead of coming back as sandbox_error.

Before the fix: RLIMIT_AS was 2 x memory_mb, so 20 threads or ThreadPoolExecutor(32) died with
"can't start new thread"; there was no CPU quota; memory_peak_mb included earlier runs' cached
pages; too many files, conflicting names, lone surrogates or a bad collect_limit_bytes came back
as sandbox_error."""

import os

import pytest

from sandbox import InvalidRequest, SandboxConfig
from sandbox.executor import Slot
from sandbox.result import normalize_request


def test_threads_and_pools_of_ordinary_size_run(pool, clean_next):
    threads = ("import threading, time\nts = [threading.Thread(target=time.sleep, args=(0.3,)) "
               "for _ in range(20)]\n[t.start() for t in ts]\n[t.join() for t in ts]\nprint(len(ts))")
    executor = ("from concurrent.futures import ThreadPoolExecutor\nimport time\n"
                "with ThreadPoolExecutor(32) as ex:\n"
                "    print(sum(ex.map(lambda i: time.sleep(0.05) or i, range(64))))")
    bash_jobs = "for i in $(seq 20); do sleep 0.2 & done; wait; echo done"
    rs = [pool.submit(threads), pool.submit(executor), pool.submit(bash_jobs, language="bash")]
    rs = [f.result() for f in rs]
    assert [r.status for r in rs] == ["ok", "ok", "ok"], [r.stderr[-300:] for r in rs]
    assert [r.stdout for r in rs] == ["20\n", "2016\n", "done\n"]
    assert pool.isolation_report()["address_space_limit"] == "off (memory cgroup)"
    # memory itself is still enforced, by the cgroup
    r = pool.run("x = bytearray(300 << 20); x[::4096] = b'y' * len(x[::4096])", memory_mb=128)
    assert r.status == "memory", r
    clean_next(pool)


def test_cpu_quota_per_sandbox(pool):
    rep = pool.isolation_report()
    assert rep["cgroups"]["cpu_quota"] is True, rep["cgroups"]  # root on Linux: cpu controller
    assert rep["cpu_quota"] == 1.0
    slot = Slot(SandboxConfig(cpu_quota=0.1))
    try:
        busy = "import time\nt = time.time()\nwhile time.time() - t < 0.5:\n    pass"
        r = slot.run(normalize_request(busy))
        assert r.status == "ok"
        assert slot.cg.cpu_quota_written() == pytest.approx(0.1)
        d = slot.cg.dirs["cpu"] if slot.cg.version == "v1" else slot.cg.dirs["unified"]
        stat = dict(line.split() for line in open(os.path.join(d, "cpu.stat")))
        assert int(stat["nr_throttled"]) > 0, stat  # the quota held the busy loop back
    finally:
        slot.close()
    with pytest.raises(ValueError):
        SandboxConfig(cpu_quota=0)


def test_memory_peak_is_the_runs_own(pool, clean_next):
    rs = pool.run_sequence([{"code": "dd if=/dev/zero of=f bs=1M count=40 2>/dev/null", "language": "bash"}])
    assert rs[0].memory_peak_mb >= 35, rs[0]  # tmpfs pages count while they exist
    for _ in range(2):  # whichever slot took it, a trivial run after it is small
        small = pool.map(["pass"] * (2 * pool.n))
        assert max(r.memory_peak_mb for r in small) < 20, [r.memory_peak_mb for r in small]
    big = pool.run("x = bytearray(100 << 20); x[::4096] = b'y' * len(x[::4096])")
    assert 100 <= big.memory_peak_mb < 140, big
    clean_next(pool)


@pytest.mark.parametrize("kw,match", [
    ({"files": {"a": "x", "a/b": "y"}}, "conflict"),
    ({"files": {"a/b": "x", "a/./b": "y"}}, "twice"),
    ({"files": {f"f{i}": "" for i in range(5000)}}, "at most"),
    ({"files": {"x" * 256: ""}}, "255 bytes"),
    ({"files": {"bad\ud800name": ""}}, "surrogate"),
    ({"files": {"a": "bad\ud800text"}}, "surrogate"),
    ({"files": {"a": 3}}, "str or bytes"),
    ({"files": ["a"]}, "map relative paths"),
    ({"stdin": "x\udfff"}, "surrogate"),
    ({"collect_limit_bytes": -1}, "collect_limit_bytes"),
    ({"collect_limit_bytes": "1"}, "collect_limit_bytes"),
    ({"collect_limit_bytes": 1.5}, "collect_limit_bytes"),
    ({"memory_mb": True}, "memory_mb"),
    ({"timeout_s": True}, "timeout_s"),
    ({"collect": "out.txt"}, "list"),
    ({"collect": ["/etc/passwd"]}, "absolute"),
    ({"isolated": "yes"}, "bool"),
    ({"timeout": 5}, "unknown request field"),
])
def test_caller_mistakes_raise_invalid_request(pool, kw, match):
    with pytest.raises(InvalidRequest, match=match):
        pool.submit("pass", **kw)


def test_caller_mistakes_in_code_sequences_and_pool_limits(pool, clean_next):
    with pytest.raises(InvalidRequest, match="surrogate"):
        pool.submit("print('\ud800')")
    with pytest.raises(InvalidRequest, match="non-empty list"):
        pool.submit_sequence([])
    with pytest.raises(InvalidRequest, match="needs 'code'"):
        pool.submit_sequence([{"language": "bash"}])
    with pytest.raises(InvalidRequest, match="dict"):
        pool.run_batch(["print(1)"])
    with pytest.raises(InvalidRequest, match="work_mb"):  # more than the working directory holds
        pool.submit("pass", files={"big": b"\0" * ((pool.config.work_mb << 20) + 1)})
    with pytest.raises(InvalidRequest, match="inodes"):
        pool.submit("pass", files={f"d{i}/e/f": "" for i in range(3000)})  # 3000 files, 6000 dirs
    # what stays valid: bytes smuggled in a str (surrogateescape), odd but legal names
    r = pool.run("import os; print(sorted(os.listdir('.')))",
                 files={"\udcff.bin": "\udcfe", " -rf": b"", "a b/c\nd": "x"})
    assert r.status == "ok" and r.stdout == "[' -rf', 'a b', '\\udcff.bin']\n", r
    clean_next(pool)
