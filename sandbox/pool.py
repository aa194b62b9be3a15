"""`SandboxPool`: N isolated worker slots behind a futures API.

Each worker is a separate process (`sandbox.worker`) owning one `Slot` (its own uid, cgroups and
working directory); a manager thread per worker feeds it from one shared queue. Results come back
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
import select
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from . import worker as _wire
from .executor import IsolationUnavailable, SandboxConfig, UnisolatedWarning
from .result import ExecutionResult, InvalidRequest, normalize_request, normalize_step

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUN_KEYS = ("language", "stdin", "files", "timeout_s", "memory_mb", "output_limit_bytes",
             "collect", "collect_limit_bytes", "max_procs")


class WorkerDied(RuntimeError):
    pass


class _Worker:
    """Main-process handle of one worker process."""

    def __init__(self, index: int, cfg: SandboxConfig, sweep: bool, layout=None) -> None:
        self.index = index
        self.cfg = cfg
        self.layout = layout
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.busy_since: float | None = None
        self.runs = 0
        self._start(sweep)

    def _start(self, sweep: bool) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-S", "-c",
                                      "import sys; from sandbox.worker import main; sys.exit(main())"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=_PKG_PARENT, close_fds=True)
        self._w = self.proc.stdin.fileno()
        self._r = self.proc.stdout.fileno()
        _wire.write_msg(self._w, {"config": self.cfg, "sweep": sweep, "layout": self.layout})
        reply = self._recv(timeout=120.0)
        if not reply.get("ok"):
            self.kill()
            if reply.get("kind") == "isolation":
                raise IsolationUnavailable(reply["error"])
            raise RuntimeError(f"sandbox worker failed to start: {reply.get('error')}")
        self.info = reply["info"]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _recv(self, timeout: float | None):
        if timeout is not None:
            r, _, _ = select.select([self._r], [], [], timeout)
            if not r:
                raise WorkerDied(f"worker {self.index} did not answer within {timeout:.0f}s")
        try:
            msg = _wire.read_msg(self._r)
        except (OSError, EOFError, ValueError) as e:
            raise WorkerDied(f"worker {self.index} channel broken: {e}") from e
        if msg is None:
            rc = self.proc.poll() if self.proc else None
            raise WorkerDied(f"worker {self.index} died (exit {rc})")
        return msg

    def call(self, msg: dict, timeout: float) -> dict:
        try:
            _wire.write_msg(self._w, msg)
        except OSError as e:
            raise WorkerDied(f"worker {self.index} is gone: {e}") from e
        return self._recv(timeout)

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        try:
            _wire.write_msg(self._w, {"op": "close"})
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        self.kill()
        self.proc = None


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
        self.restarts = 0  # workers that crashed or hung
        self.replaced = 0  # slots retired because they could not guarantee a clean next run
        self.spawn_failures = 0

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

    def snapshot(self, in_flight: int) -> dict[str, Any]:
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
                "worker_restarts": self.restarts,
                "slots_replaced": self.replaced,
                "runs_per_s": round(self.completed / span, 2) if span > 0 else None,
                "latency_ms": ms(lat),
                "exec_ms": ms(ex),
                "queue_ms": ms(qu),
                "uptime_s": round(time.monotonic() - self.t_created, 3),
            }


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    """A pool of isolated sandbox workers with futures, ordered batches and statistics.

    workers: number of worker slots (default: CPU count). Machine-level settings come from
    `config` (a SandboxConfig) or keyword overrides of its fields (e.g. `work_mb=128`,
    `isolation="none"` for trusted local debugging, which warns). Per-call limits (timeout_s,
    memory_mb, output_limit_bytes, ...) are arguments of `submit`/`run`.

    max_sessions: hard cap on sessions open at once (`session()`; see sandbox/session.py).

    Raises IsolationUnavailable at construction when bubblewrap isolation cannot be set up.
    """

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
        self.n = int(workers or os.cpu_count() or 1)
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
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._stats = _Stats()
        self._in_flight = 0
        self._closed = False
        self._workers: list[_Worker | None] = [None] * self.n
        self._down_reason: list[str | None] = [None] * self.n
        self._down_since: list[float | None] = [None] * self.n
        self._last_replacement: str | None = None
        self._threads: list[threading.Thread] = []
        ready = [threading.Event() for _ in range(self.n)]
        errors: list[BaseException | None] = [None] * self.n
        for i in range(self.n):
            t = threading.Thread(target=self._manage, args=(i, ready[i], errors), daemon=True,
                                 name=f"sandbox-worker-{i}")
            t.start()
            self._threads.append(t)
        for e in ready:
            e.wait()
        err = next((e for e in errors if e is not None), None)
        if err is not None:
            self.close()
            raise err
        _live_pools.add(self)

    # ---- worker management (one thread per worker: it spawns, feeds and replaces it) ---------
    def _spawn(self, i: int, sweep: bool) -> _Worker:
        w = _Worker(i, self.config, sweep=sweep, layout=self._layout)
        if self._sessions is not None and w.info.get("uid") is not None:
            self._sessions.reaper.add(w.info["uid"])  # swept if this process dies
        return w

    def _manage(self, i: int, ready: threading.Event, errors: list) -> None:
        try:
            self._workers[i] = self._spawn(i, sweep=(i == 0))
        except BaseException as e:  # noqa: BLE001
            errors[i] = e
            ready.set()
            return
        ready.set()
        while True:
            if self._workers[i] is None and not self._respawn(i):
                # down: leave the queue to slots that are up; take a task only when none is up,
                # so that callers get a sandbox_error instead of waiting for ever
                with self._cv:
                    if self._closed and not self._q:
                        break
                    if not self._q or any(w is not None for w in self._workers):
                        self._cv.wait(timeout=self._respawn_wait(i))
                        continue
                    item = self._q.popleft()
                self._fail(item, f"no sandbox slot is up: {self._down_reason[i]}")
                continue
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    break
                item = self._q.popleft()
            self._run_item(i, item)
        w = self._workers[i]
        if w is not None:
            w.close()
            self._workers[i] = None

    def _run_item(self, i: int, item: tuple) -> None:
        fut, msg, n_results, t_sub, budget, on_reply = item
        w = self._workers[i]
        if w.proc is None or w.proc.poll() is not None:  # died while idle: replace it first
            self._replace(i, f"worker died while idle (exit {w.proc.poll() if w.proc else None})",
                          crashed=True)
            w = self._workers[i]
            if w is None:  # could not restart: hand the task back to the queue
                with self._cv:
                    self._q.appendleft(item)
                    self._cv.notify_all()
                return
        if not fut.set_running_or_notify_cancel():
            with self._cv:
                self._in_flight -= 1
            return
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
        with self._cv:
            self._in_flight -= 1
        fut.set_result(results if msg["op"] == "seq" else results[0])

    def _fail(self, item: tuple, message: str) -> None:
        fut, msg, n_results, t_sub, _, _ = item
        if not fut.set_running_or_notify_cancel():
            with self._cv:
                self._in_flight -= 1
            return
        now = time.monotonic()
        results = [ExecutionResult.sandbox_error(message) for _ in range(n_results)]
        self._stats.done(t_sub, now, results)
        with self._cv:
            self._in_flight -= 1
        fut.set_result(results if msg["op"] == "seq" else results[0])

    def _replace(self, i: int, reason: str, crashed: bool) -> None:
        """Retires worker i (killed if still running) and starts a fresh one in its place."""
        old = self._workers[i]
        self._workers[i] = None
        if old is not None:
            if crashed:
                old.kill()
            else:
                old.close(timeout=30.0)  # a broken slot exits on its own after answering
            if self._sessions is not None and old.info.get("uid") is not None:
                self._sessions.reaper.remove(old.info["uid"])
        with self._stats.lock:
            if crashed:
                self._stats.restarts += 1
            else:
                self._stats.replaced += 1
            self._last_replacement = reason
        self._respawn(i)

    def _respawn(self, i: int) -> bool:
        try:
            self._workers[i] = self._spawn(i, sweep=True)
            self._down_reason[i] = None
            self._down_since[i] = None
            return True
        except BaseException as e:  # noqa: BLE001 - the slot stays down; retried with backoff
            self._workers[i] = None
            self._down_reason[i] = f"{type(e).__name__}: {e}"
            self._down_since[i] = self._down_since[i] or time.monotonic()
            with self._stats.lock:
                self._stats.spawn_failures += 1
            return False

    def _respawn_wait(self, i: int) -> float:
        down_for = time.monotonic() - (self._down_since[i] or time.monotonic())
        return min(30.0, 1.0 + down_for / 4)

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
            alive = (not self._closed and w is not None and w.proc is not None
                     and w.proc.poll() is None)
            state = "down" if not alive else ("busy" if w.busy_since is not None else "idle")
            slots.append({"index": i, "state": state, "pid": w.pid if w is not None else None,
                          "uid": w.info.get("uid") if w is not None else None,
                          "runs": w.runs if w is not None else 0,
                          "down_reason": None if alive else (self._down_reason[i] or
                                                              ("closed" if self._closed else None))})
        down = [s["index"] for s in slots if s["state"] == "down"]
        with self._stats.lock:
            return {"workers": self.n, "up": self.n - len(down), "down": down,
                    "busy": sum(s["state"] == "busy" for s in slots),
                    "restarts": self._stats.restarts, "replaced": self._stats.replaced,
                    "spawn_failures": self._stats.spawn_failures,
                    "last_replacement": self._last_replacement, "slots": slots}

    def _check_fits(self, req: dict) -> dict:
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

    # ---- API --------------------------------------------------------------------------------
    def _enqueue(self, msg: dict, n_results: int, budget: float, on_reply=None) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("SandboxPool is closed")
            t_sub = self._stats.submit(n_results)
            self._in_flight += 1
            self._q.append((fut, msg, n_results, t_sub, budget, on_reply))
            self._cv.notify()
        return fut

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

    def open_session(self, *, files: dict | None = None, limits=None):
        """The backend of a `Session` (sandbox/session.py); use `session()`."""
        return self.sessions.open(files=files, limits=limits)

    def session(self, *, files: dict[str, str | bytes] | None = None, limits=None):
        """Opens a Session: one episode's private working directory kept across commands, with
        its own limits (SessionLimits or a dict of its fields). See sandbox/session.py."""
        from .session import Session

        return Session(self, files=files, limits=limits)

    def submit(self, code: str, **kw: Any) -> Future:
        """Schedules one run; returns a Future[ExecutionResult]. Invalid requests raise
        InvalidRequest here (see result.normalize_request)."""
        req = self._check_fits(normalize_request(code, **kw))
        return self._enqueue({"op": "run", "req": req}, 1, req["timeout_s"])

    def run(self, code: str, **kw: Any) -> ExecutionResult:
        return self.submit(code, **kw).result()

    def submit_sequence(self, steps: list[dict]) -> Future:
        """Runs steps (dicts of `run` arguments, with "code") one after the other in one slot,
        sharing the working directory; returns a Future[list[ExecutionResult]]."""
        if not isinstance(steps, (list, tuple)) or not steps:
            raise InvalidRequest("submit_sequence needs a non-empty list of steps")
        if len(steps) > 64:
            raise InvalidRequest(f"{len(steps)} steps: at most 64 per sequence")
        reqs = [self._check_fits(normalize_step(s)) for s in steps]
        return self._enqueue({"op": "seq", "reqs": reqs}, len(reqs),
                             sum(r["timeout_s"] for r in reqs))

    def run_sequence(self, steps: list[dict]) -> list[ExecutionResult]:
        return self.submit_sequence(steps).result()

    def map(self, codes: Iterable[str], **kw: Any) -> list[ExecutionResult]:
        """Runs every program with the same arguments; results in input order."""
        futs = [self.submit(c, **kw) for c in codes]
        return [f.result() for f in futs]

    def run_batch(self, requests: Iterable[dict]) -> list[ExecutionResult]:
        """Runs request dicts ({"code": ..., plus any `run` argument}); results in input order."""
        reqs = [self._check_fits(normalize_step(r)) for r in requests]  # all checked first
        futs = [self._enqueue({"op": "run", "req": q}, 1, q["timeout_s"]) for q in reqs]
        return [f.result() for f in futs]

    def stats(self) -> dict[str, Any]:
        with self._cv:
            inflight = self._in_flight
        s = self._stats.snapshot(inflight)
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
        with self._cv:
            if self._closed:
                return
            self._closed = True
            if cancel_pending:
                while self._q:
                    item = self._q.popleft()
                    item[0].cancel()
                    self._in_flight -= 1
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for i, w in enumerate(self._workers):
            if w is not None:
                w.close()
                self._workers[i] = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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

