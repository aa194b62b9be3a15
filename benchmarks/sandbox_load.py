"""Load test of the pool with adversarial programs mixed in: nothing lost, nothing
misattributed, every slot clean and up afterwards.

    python -m benchmarks.sandbox_load --runs 3000 --adversarial 0.01      # standalone
    python scripts/bench.py sandbox                                   # 3,000 runs (quick: 300)

Every well-behaved job carries a token of its own (random per job) and must come back "ok" with
exactly that token (through stdout, stdin, a file it reads, a file it writes that is collected,
or a two-step sequence sharing /work). Adversarial jobs (deep trees, fork and thread bombs,
output floods, FIFOs, memory hogs, full disk, no inodes left, unreadable and oddly named files,
and reward hacks through the verifier) must come back with their expected status (or score 0 for
hacks). All jobs are submitted at once in a shuffled order and awaited; afterwards every slot is
probed for an empty /work and `pool.health()` must show all slots up.

Counted: lost (a future that raised, or a sandbox_error), misattributed (a token of another job,
or no token), wrong_status (an adversarial job with an unexpected status), dirty_after (probes
that found files or failed), runs_per_s (runs over the wall time of the whole mix).
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import time
from collections import Counter
from typing import Any

# name -> (request, statuses it may end with)
_ADVERSARIAL: dict[str, tuple[dict, set[str]]] = {
    "deep_tree": ({"code": "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n"
                           "print('deep')"}, {"ok"}),
    "fork_bomb": ({"code": "bomb() { bomb | bomb & }; bomb; sleep 30", "language": "bash",
                   "timeout_s": 1.0}, {"timeout", "error"}),
    "thread_bomb": ({"code": "import threading, time\nwhile True:\n    try:\n"
                             "        threading.Thread(target=time.sleep, args=(60,)).start()\n"
                             "    except (RuntimeError, MemoryError):\n        pass",
                     "timeout_s": 1.0}, {"timeout"}),
    "output_flood": ({"code": "yes", "language": "bash", "output_limit_bytes": 1 << 16,
                      "timeout_s": 10.0}, {"output_limit"}),
    "fifos": ({"code": "mkfifo a b; mkdir d; mkfifo d/c; (cat a > /dev/null &); echo ok",
               "language": "bash"}, {"ok"}),
    "memory_hog": ({"code": "x = []\nwhile True:\n    x.append(bytearray(8 << 20))", "memory_mb": 64,
                    "timeout_s": 10.0}, {"memory"}),
    "full_disk": ({"code": "dd if=/dev/zero of=big bs=1M count=200 2>/dev/null; echo done",
                   "language": "bash"}, {"ok"}),
    "no_inodes": ({"code": "i = 0\ntry:\n    while True:\n        open('f%d' % i, 'w').close()\n"
                           "        i += 1\nexcept OSError:\n    print(i)", "timeout_s": 30.0}, {"ok"}),
    "unreadable_odd_names": ({"code": "mkdir -p a/b; touch a/b/f $'new\\nline' $'\\xff\\xfe' -- -rf "
                                      "\"$(printf 'x%.0s' $(seq 255))\"; chmod 000 a/b a; "
                                      "ln -s loop loop; chmod 000 /work; echo ok", "language": "bash"},
                             {"ok"}),
}


def _normal_job(i: int, rng: random.Random) -> tuple[str, Any, str]:
    """(kind, request or sequence steps, token) of a well-behaved job."""
    tok = f"job{i}-{secrets.token_hex(6)}"
    kind = rng.choice(["print", "bash", "stdin_file", "collect", "sequence"])
    if kind == "print":
        return kind, {"code": f"print({tok!r})"}, tok
    if kind == "bash":
        return kind, {"code": f"echo {tok}", "language": "bash"}, tok
    if kind == "stdin_file":
        half = len(tok) // 2
        return kind, {"code": "import sys\nprint(sys.stdin.read() + open('in/t.txt').read())",
                      "stdin": tok[:half], "files": {"in/t.txt": tok[half:]}}, tok
    if kind == "collect":
        return kind, {"code": f"open('out.txt', 'w').write({tok!r})", "collect": ["out.txt"]}, tok
    return kind, [{"code": f"printf %s {tok} > s.txt", "language": "bash"},
                  {"code": "print(open('s.txt').read())"}], tok


def _hack_jobs(verifier) -> list:
    """Reward hacks through the verifier: (name, pending, expected score 0)."""
    from sandbox.tasks.sampling import make_split

    (code_task, _), = make_split("code", "test", 1, seed=3, difficulty=1)
    (term_task, _), = make_split("terminal", "test", 1, seed=3, difficulty=1)
    arg = code_task.prompt[len("def f("):code_task.prompt.index(")")]
    eq = (f"def f({arg}):\n    class E:\n        def __eq__(s, o): return True\n"
          "        __hash__ = object.__hash__\n    return E()\n")
    enc = "mkdir encodings; printf 'import os\\nos._exit(0)\\n' > encodings/__init__.py"
    return [("hack_always_equal", verifier.submit(code_task, eq)),
            ("hack_encodings", verifier.submit(term_task, enc))]


def run_load(pool, runs: int = 3000, adversarial: float = 0.01, seed: int = 0) -> dict:
    """The mix described in the module docstring through `pool`; returns the counts."""
    from sandbox.verifiers import Verifier

    rng = random.Random(seed)
    n_adv = max(1, round(runs * adversarial))
    names = sorted(_ADVERSARIAL)
    jobs: list[tuple[str, Any, Any]] = [_normal_job(i, rng) for i in range(runs - n_adv)]
    jobs += [(f"adv:{names[k % len(names)]}", _ADVERSARIAL[names[k % len(names)]][0], None)
             for k in range(n_adv)]
    rng.shuffle(jobs)
    verifier = Verifier(pool)
    t0 = time.perf_counter()
    futs = []
    hacks = []
    for k, (_kind, req, _tok) in enumerate(jobs):
        if isinstance(req, list):
            futs.append(pool.submit_sequence(req))
        else:
            futs.append(pool.submit(req["code"], **{a: b for a, b in req.items() if a != "code"}))
        if k == len(jobs) // 2:
            hacks = _hack_jobs(verifier)
    lost = misattributed = wrong_status = 0
    by_status: Counter = Counter()
    problems: list[str] = []
    for (kind, _req, tok), fut in zip(jobs, futs):
        try:
            res = fut.result(timeout=600)
        except Exception as e:  # noqa: BLE001 - counted as lost
            lost += 1
            problems.append(f"{kind}: {type(e).__name__}: {e}")
            continue
        rs = res if isinstance(res, list) else [res]
        for r in rs:
            by_status[r.status] += 1
        if any(r.status == "sandbox_error" for r in rs):
            lost += 1
            problems.append(f"{kind}: sandbox_error {rs[-1].message[:200]}")
            continue
        if kind.startswith("adv:"):
            if rs[-1].status not in _ADVERSARIAL[kind[4:]][1]:
                wrong_status += 1
                problems.append(f"{kind}: status {rs[-1].status} {rs[-1].message[:100]}")
            continue
        r = rs[-1]
        got = r.files.get("out.txt", b"").decode() if kind == "collect" else r.stdout.strip()
        if r.status != "ok" or got != tok:
            misattributed += 1
            problems.append(f"{kind}: {r.status} got {got[:60]!r} want {tok!r}")
    hack_scores = {name: p.result()[0] for name, p in hacks}
    wall = time.perf_counter() - t0
    probes = pool.map(["import os; print(sorted(os.listdir('.')))"] * (4 * pool.n))
    dirty = sum(1 for r in probes if r.status != "ok" or r.stdout != "[]\n")
    health = pool.health()
    total_runs = sum(by_status.values())
    return {"jobs": len(jobs), "runs": total_runs, "adversarial": n_adv,
            "lost": lost, "misattributed": misattributed, "wrong_status": wrong_status,
            "hack_scores": hack_scores, "dirty_after": dirty,
            "slots_up_after": f"{health['up']}/{health['workers']}",
            "slots_replaced": health["replaced"], "worker_restarts": health["restarts"],
            "by_status": dict(by_status), "wall_s": round(wall, 2),
            "runs_per_s": round(total_runs / wall, 1), "problems": problems[:10]}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from sandbox.pool import SandboxPool

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3000)
    p.add_argument("--adversarial", type=float, default=0.01, help="share of adversarial jobs")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    with SandboxPool(workers=a.workers) as pool:
        out = run_load(pool, a.runs, a.adversarial)
    print(json.dumps(out, indent=2))
    ok = not (out["lost"] or out["misattributed"] or out["wrong_status"] or out["dirty_after"]
              or any(out["hack_scores"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
