"""Sandbox benchmark: `python scripts/bench.py sandbox [--quick]`.

Side by side in one run, with the same concurrency (W = CPU count):
  plain      trivial Python (`python3 -S -B -c pass`) as a plain, unsandboxed subprocess
  sandbox    the same program through SandboxPool (fully isolated: bwrap, uid, seccomp, cgroups)
  http       the HTTP server as its own process (benchmarks/sandbox_http.py): p50/p99 at 16 clients
             next to the pool directly at 16, a 1,000-request burst at 200 clients (lost, 429s
             retried, wall), and how many abandoned requests still executed
  sequential one isolated run at a time (latency without queueing)
  humaneval  the 164 HumanEval canonical solutions (quick: 40) checked by the python_tests
             verifier (solution run + isolated verdict run per task) vs the same verifier over
             unisolated slots (isolation="none")
  generated  every demonstration of the generated families (arithmetic, code, terminal) scores 1
  load       3,000 runs (quick: 300) with 1% adversarial programs and two reward hacks mixed in
             (benchmarks/sandbox_load.py): lost, misattributed, clean and up afterwards
  sessions   3-command episodes (open a session, 3 commands, isolated check, close) per second
             through the pool and through the HTTP server, next to the same runs as one
             run_sequence (benchmarks/sandbox_sessions.py)
Closed loop: W client threads each submit a run and wait for it, so latency excludes queueing;
runs/s is completed runs over wall time. `cpu_ms_per_run` is the CPU time (all processes of a
run, user + system, from rusage of a reaped run) so numbers taken on a busy machine can be read as
capacity: cores * 1000 / cpu_ms_per_run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.loadgen import closed_loop as _closed_loop

PLAIN_PY = "/usr/bin/python3"


def _cpu_per_sandbox_run(n: int) -> dict:
    """CPU of one isolated trivial run (all its processes), measured in a child process that is
    the subreaper of its sandboxes, and the same for a plain subprocess."""
    code = r"""
import os, resource, sys, subprocess
from sandbox.executor import Slot, set_child_subreaper
from sandbox.result import normalize_request
set_child_subreaper()
n = int(sys.argv[1])
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
s = Slot()
req = normalize_request("pass")
for _ in range(3):
    s.run(req)
c0, s0 = cpu(resource.RUSAGE_CHILDREN), cpu(resource.RUSAGE_SELF)
for _ in range(n):
    s.run(req)
c1, s1 = cpu(resource.RUSAGE_CHILDREN), cpu(resource.RUSAGE_SELF)
s.close()
p0 = cpu(resource.RUSAGE_CHILDREN)
for _ in range(n):
    subprocess.run([sys.argv[2], "-S", "-B", "-c", "pass"])
p1 = cpu(resource.RUSAGE_CHILDREN)
print((c1 - c0 + s1 - s0) / n * 1000, (p1 - p0) / n * 1000)
"""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(n), PLAIN_PY], capture_output=True,
                         text=True, env=env, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-500:]}
    sb, plain = (float(x) for x in out.stdout.split())
    cores = os.cpu_count() or 1
    return {"sandbox_cpu_ms_per_run": round(sb, 2), "plain_cpu_ms_per_run": round(plain, 2),
            "sandbox_capacity_runs_per_s": round(cores * 1000 / sb, 1),
            "plain_capacity_runs_per_s": round(cores * 1000 / plain, 1)}


def _verify_timed(executor, tasks, completions) -> tuple[float, list]:
    from sandbox import python_tests
    from sandbox.verifiers import Verifier

    python_tests.COLLECT_CACHE.clear()  # cold: collect runs included
    t0 = time.perf_counter()
    res = Verifier(executor).verify_batch(tasks, completions)
    return time.perf_counter() - t0, res


def _humaneval(pool, quick: bool) -> dict:
    """The HumanEval canonical solutions through the python_tests verifier (a solution run and an
    isolated verdict run per task, plus a collect run for the 6 tasks whose arguments cannot be
    read statically), isolated vs the same verifier over unisolated slots (isolation="none": the
    same programs and runs as plain subprocesses), W slots each."""
    import warnings

    import sandbox.tasks
    from sandbox.executor import UnisolatedWarning
    from sandbox.pool import SandboxPool
    from sandbox.tasks.loaders import load_humaneval

    path = os.path.join(os.path.dirname(sandbox.tasks.__file__), "data", "HumanEval.jsonl.gz")
    tasks = load_humaneval(path)
    if quick:
        tasks = tasks[:40]
    comps = [t.canonical_solution for t in tasks]
    iso, res = _verify_timed(pool, tasks, comps)
    runs = sum(len(d.get("runs", ())) for _, d in res)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnisolatedWarning)
        with SandboxPool(workers=pool.n, isolation="none") as plain_pool:
            plain_s, plain_res = _verify_timed(plain_pool, tasks, comps)
    return {"programs": len(tasks), "passed": sum(s for s, _ in res),
            "passed_unisolated": sum(s for s, _ in plain_res), "sandbox_runs": runs,
            "runs_per_task": round(runs / len(tasks), 2), "isolated_s": round(iso, 2),
            "plain_subprocess_s": round(plain_s, 2), "ratio": round(iso / plain_s, 2),
            "failed": [t.id for t, (s, _) in zip(tasks, res) if s != 1.0][:10]}


def _generated_demos(pool, quick: bool) -> dict:
    """Every demonstration of the generated task families (all three difficulty levels, train
    and test splits) must score 1.0: no false negatives from the hardened checks."""
    from sandbox.tasks.domains import DOMAINS
    from sandbox.tasks.sampling import make_split

    n = 30 if quick else 200
    out = {}
    for fam in sorted(f for f, d in DOMAINS.items() if d.generated and not d.multi_turn):
        pairs = make_split(fam, "train", n, seed=0) + make_split(fam, "test", n // 4, seed=0)
        t, res = _verify_timed(pool, [p[0] for p in pairs], [p[1] for p in pairs])
        out[fam] = {"tasks": len(pairs), "passed": sum(s for s, _ in res), "s": round(t, 2)}
    return out


def run(quick: bool = False) -> dict:
    from benchmarks.sandbox_http import run_http
    from benchmarks.sandbox_load import run_load
    from benchmarks.sandbox_sessions import run_sessions
    from sandbox.pool import SandboxPool

    n = 60 if quick else 400
    w = os.cpu_count() or 1
    out: dict[str, Any] = {"cpus": w, "loadavg_start": os.getloadavg()}

    def plain_once():
        return subprocess.run([PLAIN_PY, "-S", "-B", "-c", "pass"]).returncode == 0

    with SandboxPool(workers=w) as pool:
        out["isolation"] = {k: v for k, v in pool.isolation_report().items() if k != "seccomp"}
        pool.map(["pass"] * (2 * w))  # warm
        out["plain"] = _closed_loop(plain_once, n, w)
        out["sandbox"] = _closed_loop(lambda: pool.run("pass").ok, n, w)
        out["sequential"] = _closed_loop(lambda: pool.run("pass").ok, max(20, n // 4), 1)
        t0 = time.perf_counter()
        rs = pool.map(["pass"] * n)
        out["sandbox_batch"] = {"runs": n, "runs_per_s": round(n / (time.perf_counter() - t0), 1),
                                "all_ok": all(r.ok for r in rs)}
        out["http"] = run_http(quick, workers=w, pool=pool)
        out["pool_stats"] = pool.stats()
        out["humaneval"] = _humaneval(pool, quick)
        out["generated_demos"] = _generated_demos(pool, quick)
        out["load"] = run_load(pool, runs=300 if quick else 3000, adversarial=0.01)
        out["sessions"] = run_sessions(quick, workers=w, pool=pool)
    out["cpu"] = _cpu_per_sandbox_run(20 if quick else 60)
    out["loadavg_end"] = os.getloadavg()
    s, p, h = out["sandbox"], out["plain"], out["http"]
    b = h["burst"]
    out["summary"] = {
        "isolated_runs_per_s": s["runs_per_s"], "isolated_p50_ms": s["p50_ms"], "isolated_p99_ms": s["p99_ms"],
        "plain_runs_per_s": p["runs_per_s"], "plain_p50_ms": p["p50_ms"], "plain_p99_ms": p["p99_ms"],
        "pool16_p50_ms": h["pool16"]["p50_ms"], "pool16_p99_ms": h["pool16"]["p99_ms"],
        "http16_p50_ms": h["http16"]["p50_ms"], "http16_p99_ms": h["http16"]["p99_ms"],
        "http16_runs_per_s": h["http16"]["runs_per_s"],
        "http_burst": f"{b['requests']} at {b['clients']} clients: lost {b['lost']}, "
                      f"429s retried {b['busy_retries']}, wall {b['wall_s']}s",
        "http_raw_burst_dropped": h["raw_burst"]["dropped"],
        "http_abandoned_executed": f"{h['abandoned']['executed_anyway']} of {h['abandoned']['abandoned_requests']}",
        "http_retry_storm_executions": f"{h['retry_storm']['executions']} for {h['retry_storm']['requests']} requests",
        "isolated_over_plain_throughput": round(s["runs_per_s"] / p["runs_per_s"], 2),
        "humaneval_isolated_s": out["humaneval"]["isolated_s"],
        "humaneval_plain_s": out["humaneval"]["plain_subprocess_s"],
        "humaneval_passed": f"{out['humaneval']['passed']:g}/{out['humaneval']['programs']} "
                            f"({out['humaneval']['runs_per_task']} sandbox runs per task)",
        "generated_demos_passed": ", ".join(f"{k} {v['passed']:g}/{v['tasks']}"
                                            for k, v in out["generated_demos"].items()),
        "load": f"{out['load']['runs']} runs ({out['load']['adversarial']} adversarial): lost "
                f"{out['load']['lost']}, misattributed {out['load']['misattributed']}, wrong status "
                f"{out['load']['wrong_status']}, dirty after {out['load']['dirty_after']}, "
                f"{out['load']['runs_per_s']} runs/s",
        "session_episodes_per_s": f"pool {out['sessions']['summary']['pool_episodes_per_s']}, "
                                  f"http {out['sessions']['summary']['http_episodes_per_s']}, "
                                  f"as one run_sequence {out['sessions']['summary']['sequence_episodes_per_s']} "
                                  f"(failed {out['sessions']['summary']['failed']})",
        "sandbox_cpu_ms_per_run": out["cpu"].get("sandbox_cpu_ms_per_run"),
        "plain_cpu_ms_per_run": out["cpu"].get("plain_cpu_ms_per_run"),
    }
    print(f"sandbox benchmark (W={w}, load {out['loadavg_start'][0]:.1f} -> {out['loadavg_end'][0]:.1f})")
    for k, v in out["summary"].items():
        print(f"  {k:34s} {v}")
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2, default=str))
