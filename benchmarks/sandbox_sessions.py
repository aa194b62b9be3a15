"""Sessions benchmark: 3-command episodes per second, through the pool and through HTTP.

    python scripts/bench.py sandbox [--quick]      # part of the sandbox benchmark ("sessions")
    python -m benchmarks.sandbox_sessions [--quick]     # this part alone

One episode is what rl.envs.SessionEnv does for a level-1 task: open a session with two files,
run 3 commands (`cat note.txt`, `cp <named file> out.txt`, `wc -c < out.txt`), the isolated check
(python), close. Measured side by side in one run, C episodes in flight (closed loop, C threads):

  pool        sessions on a local SandboxPool (W workers)
  http        the same through `python -m sandbox.server` (its own process) and SandboxClient
  sequence    the peer on matched work: the same 4 sandbox runs as one `run_sequence` (one slot's
              /work shared, no session kept between runs: what a one-shot episode costs)

Reported: episodes/s, episode latency p50/p99, per-phase means (open, command, check, close),
failures (an episode whose check did not pass). With W workers, W * (1000 / sandbox run ms) / 4
bounds episodes/s; `cpu_ms` in the sandbox benchmark converts a busy machine's numbers.
Not covered: long-lived sessions under memory pressure, several servers.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks.loadgen import closed_loop

FILES = {"note.txt": "k7qa.txt\n", "k7qa.txt": "payload line\n", "decoy.txt": "nothing\n"}
COMMANDS = ("cat note.txt", "cp k7qa.txt out.txt", "wc -c < out.txt")
CHECK = ("import sys\nsys.exit(0 if open('out.txt', encoding='utf-8').read() == 'payload line\\n' "
         "else 1)\n")


def _episode(executor, phases: dict[str, list[float]], lock: threading.Lock) -> bool:
    t0 = time.perf_counter()
    s = executor.session(files=FILES, limits={"max_commands": 8, "max_task_runs": 2})
    t1 = time.perf_counter()
    ok = True
    try:
        for c in COMMANDS:
            ok = s.run(c, timeout_s=5, memory_mb=256).ok and ok
        t2 = time.perf_counter()
        ok = s.check(CHECK, language="python", timeout_s=5, memory_mb=256).ok and ok
        t3 = time.perf_counter()
    finally:
        s.close()
    t4 = time.perf_counter()
    with lock:
        phases["open"].append(t1 - t0)
        phases["command"].append((t2 - t1) / len(COMMANDS))
        phases["check"].append(t3 - t2)
        phases["close"].append(t4 - t3)
    return ok


def _sequence_episode(executor) -> bool:
    steps = [{"code": c, "language": "bash", "timeout_s": 5, "memory_mb": 256} for c in COMMANDS]
    steps[0]["files"] = FILES
    steps.append({"code": CHECK, "language": "python", "isolated": True, "timeout_s": 5,
                  "memory_mb": 256})
    return all(r.ok for r in executor.run_sequence(steps))


def _closed_loop(fn, n: int, threads: int) -> dict[str, Any]:
    return closed_loop(fn, n, threads, unit="episodes")


def _sessions(executor, n: int, threads: int) -> dict[str, Any]:
    phases: dict[str, list[float]] = {"open": [], "command": [], "check": [], "close": []}
    lock = threading.Lock()
    out = _closed_loop(lambda: _episode(executor, phases, lock), n, threads)
    out["phase_mean_ms"] = {k: round(statistics.mean(v) * 1000, 2) for k, v in phases.items() if v}
    return out


def run_sessions(quick: bool = False, workers: int | None = None, pool=None) -> dict[str, Any]:
    from benchmarks.sandbox_http import start_server, stop_server
    from sandbox.client import SandboxClient
    from sandbox.pool import SandboxPool

    w = workers or os.cpu_count() or 1
    n, c = (40, 8) if quick else (300, 16)
    out: dict[str, Any] = {"workers": w, "episode": "open + 3 commands + isolated check + close"}
    own = pool is None
    pool = pool or SandboxPool(workers=w)
    try:
        _sessions(pool, 2 * c, c)  # warm: uids, cgroups, page cache
        out["pool"] = _sessions(pool, n, c)
        out["sequence"] = _closed_loop(lambda: _sequence_episode(pool), n, c)
    finally:
        if own:
            pool.close()
    proc, url = start_server(w, extra_args=("--max-sessions", str(max(64, 2 * c))))
    try:
        with SandboxClient(url, max_concurrency=2 * c) as client:
            _sessions(client, c, c)
            out["http"] = _sessions(client, n, c)
    finally:
        stop_server(proc)
    out["summary"] = {
        "pool_episodes_per_s": out["pool"]["episodes_per_s"],
        "http_episodes_per_s": out["http"]["episodes_per_s"],
        "sequence_episodes_per_s": out["sequence"]["episodes_per_s"],
        "pool_over_sequence": round(out["pool"]["episodes_per_s"] / out["sequence"]["episodes_per_s"], 2),
        "http_over_pool": round(out["http"]["episodes_per_s"] / out["pool"]["episodes_per_s"], 2),
        "pool_p99_ms": out["pool"]["p99_ms"], "http_p99_ms": out["http"]["p99_ms"],
        "failed": out["pool"]["failed"] + out["http"]["failed"] + out["sequence"]["failed"],
    }
    return out


if __name__ == "__main__":
    import json

    res = run_sessions(quick="--quick" in sys.argv)
    print(json.dumps(res, indent=2, default=str))
