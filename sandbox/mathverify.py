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

import collections
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import worker as _wire

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    from .executor import SandboxConfig, _ensure_state_dir, _try_lock

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

    from .executor import set_parent_death_signal

    set_parent_death_signal()
    for a, b in _WARMUP:
        try:
            _check(math_verify, a, b, 5)
        except Exception:  # noqa: BLE001 - warm-up only
            pass
    isolate = os.environ.get("KIMI_MATHVERIFY_ISOLATE", "1") == "1"
    applied = _drop_privileges() if isolate else {}
    applied.pop("lock_fd", None)
    _wire.write_msg(wfd, {"ok": True, "isolation": applied, "pid": os.getpid()})
    while True:
        msg = _wire.read_msg(rfd)
        if msg is None:
            return 0
        try:
            res = _check(math_verify, msg["completion"], msg["answer"], int(msg.get("timeout_s", 5)))
        except Exception as e:  # noqa: BLE001
            res = {"correct": False, "status": "error", "error": f"{type(e).__name__}: {e}"}
        _wire.write_msg(wfd, res)


class _MathWorker:
    def __init__(self, isolate: bool) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["KIMI_MATHVERIFY_ISOLATE"] = "1" if isolate else "0"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from sandbox.mathverify import worker_main; sys.exit(worker_main())"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=_PKG_PARENT, close_fds=True)
        self._r, self._w = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        hello = self._recv(180.0)
        if hello is None or not hello.get("ok"):
            self.kill()
            raise RuntimeError("math-verify worker failed to start")
        self.isolation = hello.get("isolation", {})

    def _recv(self, timeout: float):
        r, _, _ = select.select([self._r], [], [], timeout)
        if not r:
            return None
        return _wire.read_msg(self._r)

    def call(self, msg: dict, timeout: float):
        _wire.write_msg(self._w, msg)
        return self._recv(timeout)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class MathVerifier:
    """math-verify in isolated worker processes, with a wall-clock timeout per check."""

    def __init__(self, workers: int = 1, *, timeout_s: float = 10.0, isolate: bool = True) -> None:
        self.timeout_s = timeout_s
        self.isolate = isolate
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.restarts = 0
        self._workers: list[_MathWorker | None] = [None] * workers
        self._threads = [threading.Thread(target=self._manage, args=(i,), daemon=True,
                                          name=f"math-verify-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def _manage(self, i: int) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    break
                fut, msg, timeout = self._q.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.monotonic()
            try:
                if self._workers[i] is None:
                    self._workers[i] = _MathWorker(self.isolate)
                res = self._workers[i].call(msg, timeout)
            except (OSError, RuntimeError, EOFError) as e:
                res = {"correct": False, "status": "sandbox_error", "error": str(e)}
                self._kill(i)
            else:
                if res is None:
                    res = {"correct": False, "status": "timeout",
                           "error": f"math-verify exceeded {timeout:g}s"}
                    self._kill(i)
            res["time_s"] = round(time.monotonic() - t0, 4)
            fut.set_result((bool(res.get("correct")), res))
        if self._workers[i] is not None:
            self._workers[i].kill()
            self._workers[i] = None

    def _kill(self, i: int) -> None:
        if self._workers[i] is not None:
            self._workers[i].kill()
            self._workers[i] = None
            self.restarts += 1

    def submit(self, completion: str, answer: str, timeout_s: float | None = None,
               inner_timeout_s: int | None = None) -> Future:
        """Future[(correct: bool, details: dict)].

        timeout_s: wall-clock limit of the check (the worker is killed and replaced past it);
        inner_timeout_s: math-verify's own parsing/comparison timeout (default timeout_s - 1).
        """
        timeout = float(timeout_s or self.timeout_s)
        fut: Future = Future()
        inner = int(inner_timeout_s) if inner_timeout_s else max(1, int(timeout) - 1)
        with self._cv:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            self._q.append((fut, {"completion": completion, "answer": str(answer),
                                  "timeout_s": inner}, timeout))
            self._cv.notify()
        return fut

    def verify(self, completion: str, answer: str, timeout_s: float | None = None,
               inner_timeout_s: int | None = None) -> tuple[bool, dict]:
        return self.submit(completion, answer, timeout_s, inner_timeout_s).result()

    def isolation_report(self) -> dict:
        w = next((w for w in self._workers if w is not None), None)
        return dict(w.isolation) if w is not None else {}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default_lock = threading.Lock()
_default: MathVerifier | None = None


def default_math_verifier() -> MathVerifier:
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = MathVerifier(workers=1)
        return _default
