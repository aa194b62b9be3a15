"""Math answer checking with the math-verify library, isolated in worker processes.

math-verify parses model output with latex2sympy and sympy (whose `parse_expr` evaluates text), and
some inputs make sympy run for minutes. So checks run in separate worker processes that:
  - import math-verify and warm it up (so later lazy imports are rare), then, when started as root,
  - move into a private network namespace, take rlimits (address space, no new processes, CPU),
    drop to an unprivileged uid of the sandbox range (no supplementary groups), set
    no-new-privileges and install the sandbox's seccomp deny-list;
  - answer one request at a time; a request that exceeds its wall-clock timeout gets the worker
    killed and replaced (score 0, status "timeout").

    mv = MathVerifier(workers=1)
    ok, details = mv.verify(r"The answer is \\boxed{\\frac{1}{2}}", "0.5")   # True
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import wire
from .workers import WorkerDied, WorkerPool, WorkerProcess

_WARMUP = [
    (r"$\frac{1}{2}$", "0.5"), (r"\boxed{\sqrt{2}}", r"$\sqrt{2}$"), ("x^2+2x+1", "(x+1)^2"),
    (r"$\{1,2\}$", r"$\{2,1\}$"), (r"$[0, 1)$", r"$[0,1)$"), (r"$\begin{pmatrix}1\\2\end{pmatrix}$", "(1,2)"),
    (r"$x = 3$", "3"), (r"$10\%$", "0.1"), (r"$\pi/2$", "1.5707963"), (r"$\infty$", "oo"),
    (r"$2\times 10^{3}$", "2000"), (r"$\dfrac{3}{4}$", "0.75"), ("$-5$", "-5"), ("$a+b$", "$b+a$"),
    (r"$\sin(x)^2+\cos(x)^2$", "1"), (r"$\log_2 8$", "3"), (r"$e^{i\pi}$", "-1"),
    (r"\text{(A)}", "A"), (r"$1,000$", "1000"), (r"$\le 3$", "3"),
]


def _check(math_verify, completion: str, answer: str, timeout_s: int) -> dict:
    parse, verify = math_verify.parse, math_verify.verify
    gold = parse(f"${answer}$", parsing_timeout=timeout_s) if "$" not in answer and "\\boxed" not in answer else []
    if not gold:
        gold = parse(answer, parsing_timeout=timeout_s)
    pred = parse(completion, parsing_timeout=timeout_s)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout_s)
    return {"correct": bool(ok), "gold": [str(g) for g in gold][:2], "pred": [str(p) for p in pred][:2],
            "status": "ok" if pred else "no_answer"}


def _drop_privileges() -> dict:
    """Network namespace, rlimits, unprivileged uid, no_new_privs, seccomp. Returns what applied."""
    import ctypes
    import resource

    from . import seccomp
    from .config import SandboxConfig
    from .host import _ensure_state_dir, _try_lock

    applied: dict[str, Any] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0:
        applied["netns"] = libc.unshare(0x40000000) == 0  # CLONE_NEWNET
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        cfg = SandboxConfig()
        _ensure_state_dir(cfg)
        uid = fd = None
        for i in range(cfg.uid_count - 1, -1, -1):  # from the top of the range: away from slots
            fd = _try_lock(cfg, cfg.uid_base + i)
            if fd is not None:
                uid = cfg.uid_base + i
                break
        if uid is not None:
            applied["lock_fd"] = fd  # held for the worker's lifetime
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            applied["uid"] = uid
    try:
        seccomp.install_current_process()
        applied["seccomp"] = True
    except (OSError, seccomp.UnsupportedArch):
        applied["seccomp"] = False
    return applied


def worker_main() -> int:
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    import logging

    import math_verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs every timeout with the input

    from .host import set_parent_death_signal

    set_parent_death_signal()
    for a, b in _WARMUP:
        try:
            _check(math_verify, a, b, 5)
        except Exception:  # noqa: BLE001 - warm-up only
            pass
    isolate = os.environ.get("KIMI_MATHVERIFY_ISOLATE", "1") == "1"
    applied = _drop_privileges() if isolate else {}
    applied.pop("lock_fd", None)
    wire.write_msg(wfd, {"ok": True, "isolation": applied, "pid": os.getpid()})
    while True:
        msg = wire.read_msg(rfd)
        if msg is None or msg.get("op") == "close":
            return 0
        try:
            res = _check(math_verify, msg["completion"], msg["answer"], int(msg.get("timeout_s", 5)))
        except Exception as e:  # noqa: BLE001
            res = {"correct": False, "status": "error", "error": f"{type(e).__name__}: {e}"}
        wire.write_msg(wfd, res)


class MathVerifier(WorkerPool):
    """math-verify in isolated worker processes, with a wall-clock timeout per check.

    The workers are supervised by sandbox/workers.py (the same pool as SandboxPool's): they start
    in the background; a check past its wall-clock limit, or whose worker dies on it, is answered
    with status "timeout" and the worker is killed and replaced; a worker that cannot start
    answers "sandbox_error" (retried with backoff).
    """

    _down_message = "math-verify worker is not up"

    def __init__(self, workers: int = 1, *, timeout_s: float = 10.0, isolate: bool = True) -> None:
        super().__init__(workers, thread_name="math-verify")
        self.timeout_s = timeout_s
        self.isolate = isolate
        self._start(wait_ready=False)

    def _spawn(self, i: int, first: bool) -> WorkerProcess:
        w = WorkerProcess("sandbox.mathverify:worker_main", index=i, start_timeout_s=180.0,
                          site=True, env={"KIMI_MATHVERIFY_ISOLATE": "1" if self.isolate else "0"})
        if not w.hello.get("ok"):
            w.kill()
            raise RuntimeError("math-verify worker failed to start")
        w.info = w.hello.get("isolation", {})
        return w

    def _serve(self, i: int, w: WorkerProcess, item: tuple) -> tuple[bool, dict]:
        _fut, msg, timeout = item
        t0 = time.monotonic()
        try:
            res = w.call(msg, timeout)
        except WorkerDied as e:
            if e.kind == "timeout":
                res = {"correct": False, "status": "timeout",
                       "error": f"math-verify exceeded {timeout:g}s"}
            elif e.kind == "exited":  # died on this input (a completion's verdict, not ours)
                res = {"correct": False, "status": "timeout", "error": f"math-verify {e}"}
            else:
                res = {"correct": False, "status": "sandbox_error", "error": str(e)}
            self._retire(i, str(e), crashed=True)
        res["time_s"] = round(time.monotonic() - t0, 4)
        return bool(res.get("correct")), res

    def _failed(self, item: tuple, message: str) -> tuple[bool, dict]:
        return False, {"correct": False, "status": "sandbox_error", "error": message,
                       "time_s": 0.0}

    def submit(self, completion: str, answer: str, timeout_s: float | None = None,
               inner_timeout_s: int | None = None) -> Future:
        """Future[(correct: bool, details: dict)].

        timeout_s: wall-clock limit of the check (the worker is killed and replaced past it);
        inner_timeout_s: math-verify's own parsing/comparison timeout (default timeout_s - 1).
        """
        timeout = float(timeout_s or self.timeout_s)
        inner = int(inner_timeout_s) if inner_timeout_s else max(1, int(timeout) - 1)
        msg = {"completion": completion, "answer": str(answer), "timeout_s": inner}
        return self._put(lambda: (Future(), msg, timeout))

    def verify(self, completion: str, answer: str, timeout_s: float | None = None,
               inner_timeout_s: int | None = None) -> tuple[bool, dict]:
        return self.submit(completion, answer, timeout_s, inner_timeout_s).result()

    def isolation_report(self) -> dict:
        w = next((w for w in self._workers if w is not None), None)
        return dict(w.info) if w is not None else {}


_default_lock = threading.Lock()
_default: MathVerifier | None = None


def default_math_verifier() -> MathVerifier:
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = MathVerifier(workers=1)
        return _default
