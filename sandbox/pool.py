"""`SandboxPool`: N isolated worker slots behind a futures API.

Each worker is a separate process (`sandbox.worker`) owning one `Slot` (its own uid, cgroups and
working directory); a manager thread per worker feeds it from one shared queue (the supervision
is sandbox/workers.py's, shared with the math verifier; the caller-facing methods are
sandbox/backend.py's `Executor`, shared with the HTTP client). Results come back
as futures; `map`/`run_batch` return them in submission order. A worker that dies (killed, crashed,
hung past its task's deadline) is replaced and the task it was running is reported as
`sandbox_error`, never lost. A slot that cannot guarantee a clean next run (its working directory
could not be reset, a process survived) answers its current task and is replaced by a fresh one
(new process, uid, mount and cgroup), never reused. `health()` reports slots up, down and
replaced (the HTTP server's /health reads it).

Typical use (the RL side):

    with SandboxPool(workers=8) as pool:
        results = pool.run_batch([{"code": c, "timeout_s": 5} for c in programs])
        print(pool.stats())

Sessions (sandbox/session.py): `pool.session(files=..., limits=...)` opens one episode's private
working directory kept across commands; its commands go through the same queue and workers as
every other run (any worker runs them with the session's uid, tmpfs and cgroup), at most
`max_sessions` open at once.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from typing import Any

from .backend import Executor
from .config import IsolationUnavailable, SandboxConfig, UnisolatedWarning
from .result import ExecutionResult, InvalidRequest, normalize_request
from .workers import WorkerPool, WorkerProcess


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


class _Stats:
    def __init__(self, window: int = 20000) -> None:
        self.lock = threading.Lock()
        self.t_created = time.monotonic()
        self.submitted = 0
        self.completed = 0
        self.by_status: collections.Counter = collections.Counter()
        self.latency = collections.deque(maxlen=window)  # submit -> done
        self.exec = collections.deque(maxlen=window)  # sandbox wall time
        self.queue = collections.deque(maxlen=window)  # submit -> start
        self.first_submit: float | None = None
        self.last_done: float | None = None

    def submit(self, n: int = 1) -> float:
        now = time.monotonic()
        with self.lock:
            self.submitted += n
            if self.first_submit is None:
                self.first_submit = now
        return now

    def done(self, t_sub: float, t_start: float, results: list[ExecutionResult]) -> None:
        now = time.monotonic()
        with self.lock:
            self.completed += len(results)
            for r in results:
                self.by_status[r.status] += 1
                self.exec.append(r.wall_s)
            self.latency.append(now - t_sub)
            self.queue.append(t_start - t_sub)
            self.last_done = now

    def reset(self) -> None:
        with self.lock:
            self.submitted = self.completed = 0
            self.by_status.clear()
            self.latency.clear()
            self.exec.clear()
            self.queue.clear()
            self.first_submit = self.last_done = None

    def snapshot(self, in_flight: int, restarts: int, replaced: int) -> dict[str, Any]:
        with self.lock:
            lat, ex, qu = list(self.latency), list(self.exec), list(self.queue)
            span = (self.last_done - self.first_submit) if self.first_submit and self.last_done else 0.0

            def ms(xs):
                return {k: (round(v * 1000, 2) if v is not None else None) for k, v in
                        (("p50", _pct(xs, 50)), ("p90", _pct(xs, 90)), ("p99", _pct(xs, 99)),
                         ("max", max(xs) if xs else None),
                         ("mean", sum(xs) / len(xs) if xs else None))}

            return {
                "submitted": self.submitted,
                "completed": self.completed,
                "in_flight": in_flight,
                "by_status": dict(self.by_status),
                "worker_restarts": restarts,
                "slots_replaced": replaced,
                "runs_per_s": round(self.completed / span, 2) if span > 0 else None,
                "latency_ms": ms(lat),
                "exec_ms": ms(ex),
                "queue_ms": ms(qu),
                "uptime_s": round(time.monotonic() - self.t_created, 3),
            }


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool(WorkerPool, Executor):
    """A pool of isolated sandbox workers with futures, ordered batches and statistics.

    workers: number of worker slots (default: CPU count). Machine-level settings come from
    `config` (a SandboxConfig) or keyword overrides of its fields (e.g. `work_mb=128`,
    `isolation="none"` for trusted local debugging, which warns). Per-call limits (timeout_s,
    memory_mb, output_limit_bytes, ...) are arguments of `submit`/`run`.

    max_sessions: hard cap on sessions open at once (`session()`; see sandbox/session.py).

    The caller-facing methods (submit, run, map, run_batch, submit_sequence, run_sequence,
    session) are sandbox/backend.py's `Executor`; the worker supervision is sandbox/workers.py's
    `WorkerPool`. Raises IsolationUnavailable at construction when bubblewrap isolation cannot be
    set up.
    """

    max_steps = 64
    _down_message = "no sandbox slot is up"

    def __init__(self, workers: int | None = None, *, config: SandboxConfig | None = None,
                 hang_grace_s: float = 60.0, max_sessions: int = 64, **overrides: Any) -> None:
        if config is None:
            config = SandboxConfig(**overrides)
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        self.config = config
        if config.isolation == "none":
            warnings.warn("SandboxPool(isolation='none'): code runs UNISOLATED on this host "
                          "(trusted local debugging only)", UnisolatedWarning, stacklevel=2)
        super().__init__(int(workers or os.cpu_count() or 1), thread_name="sandbox-worker")
        # cgroups are laid out once, here, before any worker exists (cgroup v2 may need to move
        # this process into a leaf of its own cgroup to nest the slots there).
        self._layout = None
        if config.isolation == "bwrap" and os.geteuid() == 0:
            from .cgroups import CgroupLayout

            self._layout = CgroupLayout()
        self.hang_grace_s = hang_grace_s
        if type(max_sessions) is not int or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self._sessions = None  # SessionManager, made by the first session
        self._sessions_lock = threading.Lock()
        self._stats = _Stats()
        self._start(wait_ready=True)
        _live_pools.add(self)

    # ---- the workers (sandbox/workers.py supervises them) -------------------------------------
    def _spawn(self, i: int, first: bool) -> WorkerProcess:
        w = WorkerProcess("sandbox.worker:main", index=i, start_timeout_s=120.0,
                          hello={"config": self.config, "sweep": i == 0 if first else True,
                                 "layout": self._layout})
        reply = w.hello
        if not reply.get("ok"):
            w.kill()
            if reply.get("kind") == "isolation":
                raise IsolationUnavailable(reply["error"])
            raise RuntimeError(f"sandbox worker failed to start: {reply.get('error')}")
        w.info = reply["info"]
        if self._sessions is not None and w.info.get("uid") is not None:
            self._sessions.reaper.add(w.info["uid"])  # swept if this process dies
        return w

    def _retired(self, old: WorkerProcess) -> None:
        if self._sessions is not None and old.info.get("uid") is not None:
            self._sessions.reaper.remove(old.info["uid"])

    def _serve(self, i: int, w: WorkerProcess, item: tuple) -> Any:
        _fut, msg, n_results, t_sub, budget, on_reply = item
        t_start = time.monotonic()
        broken = None
        try:
            w.busy_since = t_start
            reply = w.call(msg, timeout=budget + self.hang_grace_s)
            results = reply["results"]
            broken = reply.get("broken")
            w.runs += 1
            if on_reply is not None:
                on_reply(reply)
        except Exception as e:  # noqa: BLE001 - WorkerDied, a broken pipe, a malformed reply
            results = [ExecutionResult.sandbox_error(f"sandbox worker crashed: {e}",
                                                     wall_s=time.monotonic() - t_start)
                       for _ in range(n_results)]
            self._replace(i, f"worker crashed: {e}", crashed=True)
        finally:
            if self._workers[i] is not None:
                self._workers[i].busy_since = None
        if broken:
            self._replace(i, f"slot broken: {broken}", crashed=False)
        for r in results:
            r.worker = i
        self._stats.done(t_sub, t_start, results)
        return results if msg["op"] == "seq" else results[0]

    def _failed(self, item: tuple, message: str) -> Any:
        _fut, msg, n_results, t_sub, _, _ = item
        now = time.monotonic()
        results = [ExecutionResult.sandbox_error(message) for _ in range(n_results)]
        self._stats.done(t_sub, now, results)
        return results if msg["op"] == "seq" else results[0]

    def health(self) -> dict[str, Any]:
        """Slot health (the HTTP server's /health reads it):

        {"workers": N, "up": k, "down": [indices of slots that are down], "busy": b,
         "restarts": workers that crashed or hung, "replaced": slots retired because they could
         not guarantee a clean next run (reset failure, surviving process), "spawn_failures":
         failed (re)starts, "last_replacement": reason or None,
         "slots": [{"index", "state": "idle" | "busy" | "down", "pid", "uid", "runs",
                    "down_reason"}]}

        A slot is down while it has no live worker process (it died, or its restart failed: it is
        retried with backoff while the other slots take the work); all are down once the pool is
        closed. "up" == "workers" means every slot can take work.
        """
        slots = []
        for i, w in enumerate(self._workers):
            alive = not self._closed and w is not None and w.alive()
            state = "down" if not alive else ("busy" if w.busy_since is not None else "idle")
            slots.append({"index": i, "state": state, "pid": w.pid if w is not None else None,
                          "uid": w.info.get("uid") if w is not None else None,
                          "runs": w.runs if w is not None else 0,
                          "down_reason": None if alive else (self._down_reason[i] or
                                                              ("closed" if self._closed else None))})
        down = [s["index"] for s in slots if s["state"] == "down"]
        with self._count_lock:
            return {"workers": self.n, "up": self.n - len(down), "down": down,
                    "busy": sum(s["state"] == "busy" for s in slots),
                    "restarts": self.restarts, "replaced": self.replaced,
                    "spawn_failures": self.spawn_failures,
                    "last_replacement": self.last_replacement, "slots": slots}

    # ---- the executor interface (sandbox/backend.py) ------------------------------------------
    def _check(self, req: dict) -> dict:
        """Caller mistakes against this pool's machine settings raise InvalidRequest (files that
        cannot fit the working directory would otherwise fail inside the worker)."""
        files = req["files"]
        total = sum(len(v) for v in files.values())
        if total > self.config.work_mb << 20:
            raise InvalidRequest(f"files total {total} bytes; the working directory holds "
                                 f"{self.config.work_mb} MiB (SandboxConfig.work_mb)")
        dirs = {"/".join(p.split("/")[:k]) for p in files for k in range(1, p.count("/") + 1)}
        if len(files) + len(dirs) > self.config.work_inodes - 16:
            raise InvalidRequest(f"{len(files)} files in {len(dirs)} directories: the working "
                                 f"directory has {self.config.work_inodes} inodes "
                                 "(SandboxConfig.work_inodes)")
        return req

    def _enqueue(self, msg: dict, n_results: int, budget: float, on_reply=None) -> Future:
        return self._put(lambda: (Future(), msg, n_results, self._stats.submit(n_results), budget,
                                  on_reply))

    def _submit_request(self, req: dict) -> Future:
        return self._enqueue({"op": "run", "req": req}, 1, req["timeout_s"])

    def _submit_steps(self, reqs: list[dict]) -> Future:
        return self._enqueue({"op": "seq", "reqs": reqs}, len(reqs),
                             sum(r["timeout_s"] for r in reqs))

    def _enqueue_session(self, desc: dict, req: dict, on_reply) -> Future:
        """One command of a session (sandbox/session.py): any worker runs it with the session's
        uid, directories and cgroup. `on_reply(reply)` sees the worker's whole reply."""
        return self._enqueue({"op": "session", "session": desc, "req": req}, 1, req["timeout_s"],
                             on_reply)

    # ---- sessions -------------------------------------------------------------------------
    @property
    def sessions(self):
        """The SessionManager of this pool (created on first use: it starts the reaper)."""
        with self._sessions_lock:
            if self._sessions is None:
                if self._closed:
                    raise RuntimeError("SandboxPool is closed")
                from .session import SessionManager

                self._sessions = SessionManager(self, self.max_sessions)
            return self._sessions

    def open_session(self, *, files: dict | None = None, limits=None, workspace=None):
        """The backend of a `Session` (sandbox/session.py); use `session()`."""
        return self.sessions.open(files=files, limits=limits, workspace=workspace)

    # ---- reports and shutdown -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = self._stats.snapshot(self.in_flight(), self.restarts, self.replaced)
        s["workers"] = self.n
        if self._sessions is not None:
            s["sessions"] = self._sessions.stats()
        return s

    def reset_stats(self) -> None:
        self._stats.reset()

    def worker_pids(self) -> list[int | None]:
        return [w.pid if w is not None else None for w in self._workers]

    def worker_uids(self) -> list[int | None]:
        return [w.info.get("uid") if w is not None else None for w in self._workers]

    def isolation_report(self) -> dict:
        w = next((w for w in self._workers if w is not None), None)
        return dict(w.info) if w is not None else {}

    def close(self, cancel_pending: bool = False) -> None:
        """Stops the workers after the queued tasks finish (or cancels them); closes every
        session first."""
        if self._sessions is not None and not self._closed:
            self._sessions.shutdown()
        WorkerPool.close(self, cancel_pending)

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close(cancel_pending=True)
        except Exception:  # noqa: BLE001
            pass


# ---- module-level default pool used by sandbox.run() ------------------------------------------

_default_lock = threading.Lock()
_default_pool: SandboxPool | None = None


def default_pool() -> SandboxPool:
    """A process-wide pool (CPU-count workers), created on first use and closed at exit."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            _default_pool = SandboxPool()
        return _default_pool


@atexit.register
def _close_all() -> None:
    for p in list(_live_pools):
        try:
            p.close(cancel_pending=True)
        except Exception:  # noqa: BLE001
            pass


def run(code: str, *, language: str = "python", stdin: str | bytes | None = None,
        files: dict[str, str | bytes] | None = None, timeout_s: float = 10.0,
        memory_mb: int = 512, output_limit_bytes: int = 1 << 20, isolation: str = "bwrap",
        **kw: Any) -> ExecutionResult:
    """Runs untrusted `code` (python or bash) in an isolated sandbox and returns its result.

    Uses the process-wide default pool. `files` (relative path -> str/bytes) are placed in the
    private working directory /work (absolute paths and '..' are rejected with InvalidRequest).
    Extra keywords: collect=[paths] to read files back (result.files), max_procs, ...
    `isolation="none"` runs the code UNISOLATED on this host (trusted debugging only; warns).
    Raises IsolationUnavailable (with what is missing and how to install it) if bubblewrap
    isolation cannot be set up; it never silently falls back to running unisolated.
    """
    args = dict(language=language, stdin=stdin, files=files, timeout_s=timeout_s,
                memory_mb=memory_mb, output_limit_bytes=output_limit_bytes, **kw)
    if isolation == "none":
        from .executor import Slot

        req = normalize_request(code, **args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnisolatedWarning)
            slot = Slot(SandboxConfig(isolation="none"))
        warnings.warn("sandbox.run(isolation='none'): code runs UNISOLATED on this host "
                      "(trusted local debugging only)", UnisolatedWarning, stacklevel=2)
        try:
            return slot.run(req)
        finally:
            slot.close()
    if isolation != "bwrap":
        raise ValueError(f"isolation must be 'bwrap' or 'none', got {isolation!r}")
    return default_pool().run(code, **args)

