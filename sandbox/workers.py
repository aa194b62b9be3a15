"""One supervised pool of worker processes: spawn, talk, replace, close.

Both process pools of this package are a `WorkerPool`: `SandboxPool` (sandbox/pool.py: each
worker a `sandbox.worker` process owning one isolated Slot) and `MathVerifier`
(sandbox/mathverify.py: each worker a math-verify process with dropped privileges). What they
share lives here:
  - `WorkerProcess`: a package entry point started as `python [-S] -c "from <module> import <fn>
    ..."` (this package on PYTHONPATH) with a pipe on stdin and one on stdout framed by
    sandbox/wire.py; it must say hello within a start timeout; `call` sends one message and waits
    for the answer with a timeout; `kill`, or `close` (asks it to leave, then kills);
  - `WorkerPool`: one manager thread per slot feeds its worker from one shared queue. A worker
    found dead while idle is replaced before it gets a task. A slot whose (re)start fails is down
    and retried with backoff while the other slots take the work; when no slot is up, queued tasks
    fail at once (never wait for ever). `_replace` retires a worker (killed if it crashed or hung,
    asked to leave if it only cannot be reused) and starts a fresh one. Counters: restarts
    (crashed or hung), replaced (retired for another reason), spawn failures, the last reason.
    `close` lets the queue drain (or cancels it), then stops every worker.
What a pool does with one task (the message, how a reply or a crash becomes the Future's value)
is its own: `_spawn`, `_serve` and `_failed`. Queue items are tuples whose first element is the
task's Future. Not covered: several machines (sandbox/client.py), priorities, task retries (a task
whose worker crashed is answered, never run twice).
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from . import wire

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WorkerDied(RuntimeError):
    """A worker did not answer. kind: "timeout" (no answer in time), "exited" (it closed its
    pipe: died), "broken" (unreadable answer) or "gone" (the request could not be sent)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class WorkerProcess:
    """Main-process handle of one worker process.

    entry: "package.module:function" (the function returns the exit code); site: False starts
    python with -S (no site import: faster, and nothing from site-packages); env: variables added
    to this process's environment. hello: a first message to send (None: none); `self.hello` is
    the worker's first answer, awaited for start_timeout_s (WorkerDied past it; the process is
    killed). `info`, `busy_since` and `runs` are for the owning pool's reports.
    """

    def __init__(self, entry: str, *, index: int, start_timeout_s: float, hello: Any = None,
                 site: bool = False, env: dict[str, str] | None = None) -> None:
        module, func = entry.split(":")
        self.index = index
        self.info: dict = {}
        self.busy_since: float | None = None
        self.runs = 0
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = PKG_PARENT + (os.pathsep + full_env["PYTHONPATH"]
                                               if full_env.get("PYTHONPATH") else "")
        full_env.update(env or {})
        argv = [sys.executable, *([] if site else ["-S"]), "-c",
                f"import sys; from {module} import {func}; sys.exit({func}())"]
        self.proc: subprocess.Popen | None = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=full_env, cwd=PKG_PARENT,
            close_fds=True)
        self._w = self.proc.stdin.fileno()
        self._r = self.proc.stdout.fileno()
        try:
            if hello is not None:
                self._send(hello)
            self.hello = self.recv(start_timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _send(self, msg: Any) -> None:
        try:
            wire.write_msg(self._w, msg)
        except OSError as e:
            raise WorkerDied(f"worker {self.index} is gone: {e}", "gone") from e

    def recv(self, timeout: float | None) -> Any:
        if timeout is not None:
            r, _, _ = select.select([self._r], [], [], timeout)
            if not r:
                raise WorkerDied(f"worker {self.index} did not answer within {timeout:.0f}s",
                                 "timeout")
        try:
            msg = wire.read_msg(self._r)
        except (OSError, EOFError, ValueError) as e:
            raise WorkerDied(f"worker {self.index} channel broken: {e}", "broken") from e
        if msg is None:
            rc = self.proc.poll() if self.proc else None
            raise WorkerDied(f"worker {self.index} died (exit {rc})", "exited")
        return msg

    def call(self, msg: Any, timeout: float) -> Any:
        """Sends `msg` and returns the answer; WorkerDied if there is none within `timeout`."""
        self._send(msg)
        return self.recv(timeout)

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
        """Asks the worker to leave ({"op": "close"}, then EOF), waits, then kills what is left."""
        if self.proc is None:
            return
        try:
            wire.write_msg(self._w, {"op": "close"})
            self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        self.kill()
        self.proc = None


class WorkerPool:
    """N supervised worker slots fed from one queue (see the module docstring).

    Subclasses implement `_spawn(i, first)` (a started WorkerProcess, or raise), `_serve(i, w,
    item)` (run one task on worker w, return the Future's value; call `_replace` or `_retire`
    when the worker must not be used again) and `_failed(item, message)` (the Future's value for a task no worker
    could take), then call `_start(wait_ready)` at the end of their __init__: wait_ready=True
    waits for every first spawn and raises the first error (the pool is unusable); False lets
    slots start in the background (a slot that fails is down and retried).
    """

    def __init__(self, n: int, *, thread_name: str) -> None:
        if type(n) is not int or n < 1:
            raise ValueError(f"a worker pool needs an int >= 1 workers, got {n!r}")
        self.n = n
        self._thread_name = thread_name
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._workers: list[WorkerProcess | None] = [None] * n
        self._down_reason: list[str | None] = [None] * n
        self._down_since: list[float | None] = [None] * n
        self._count_lock = threading.Lock()
        self.restarts = 0  # workers that crashed or hung
        self.replaced = 0  # workers retired because they could not be reused
        self.spawn_failures = 0
        self.last_replacement: str | None = None
        self._threads: list[threading.Thread] = []

    # ---- what a subclass provides -------------------------------------------------------------
    _down_message = "no worker is up"  # a task failed because every slot is down: this + why

    def _spawn(self, i: int, first: bool) -> WorkerProcess:
        raise NotImplementedError

    def _serve(self, i: int, w: WorkerProcess, item: tuple) -> Any:
        raise NotImplementedError

    def _failed(self, item: tuple, message: str) -> Any:
        raise NotImplementedError

    def _retired(self, old: WorkerProcess) -> None:
        """Called with each worker taken out of service (after it was stopped)."""

    # ---- start and supervision (one thread per slot: it spawns, feeds and replaces it) --------
    def _start(self, wait_ready: bool) -> None:
        ready = [threading.Event() for _ in range(self.n)]
        errors: list[BaseException | None] = [None] * self.n
        for i in range(self.n):
            t = threading.Thread(target=self._manage, args=(i, ready[i], errors, wait_ready),
                                 daemon=True, name=f"{self._thread_name}-{i}")
            t.start()
            self._threads.append(t)
        if not wait_ready:
            return
        for e in ready:
            e.wait()
        err = next((e for e in errors if e is not None), None)
        if err is not None:
            self.close()
            raise err

    def _manage(self, i: int, ready: threading.Event, errors: list, first_must_work: bool) -> None:
        if first_must_work:
            try:
                self._workers[i] = self._spawn(i, first=True)
            except BaseException as e:  # noqa: BLE001 - raised by _start
                errors[i] = e
                ready.set()
                return
        ready.set()
        while True:
            if self._workers[i] is None and not self._respawn(i):
                # down: leave the queue to slots that are up; take a task only when none is up,
                # so that callers get an error instead of waiting for ever
                with self._cv:
                    if self._closed and not self._q:
                        break
                    if not self._q or any(w is not None for w in self._workers):
                        self._cv.wait(timeout=self._respawn_wait(i))
                        continue
                    item = self._q.popleft()
                self._fail(item, f"{self._down_message}: {self._down_reason[i]}")
                continue
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    break
                item = self._q.popleft()
            self._take(i, item)
        w = self._workers[i]
        if w is not None:
            w.close()
            self._workers[i] = None

    def _take(self, i: int, item: tuple) -> None:
        w = self._workers[i]
        if not w.alive():  # died while idle: replace it first
            self._replace(i, f"worker died while idle (exit {w.proc.poll() if w.proc else None})",
                          crashed=True)
            if self._workers[i] is None:  # could not restart: hand the task back to the queue
                with self._cv:
                    self._q.appendleft(item)
                    self._cv.notify_all()
                return
        fut: Future = item[0]
        if not fut.set_running_or_notify_cancel():
            with self._cv:
                self._in_flight -= 1
            return
        self._resolve(fut, self._serve(i, self._workers[i], item))

    def _fail(self, item: tuple, message: str) -> None:
        fut: Future = item[0]
        if not fut.set_running_or_notify_cancel():
            with self._cv:
                self._in_flight -= 1
            return
        self._resolve(fut, self._failed(item, message))

    def _resolve(self, fut: Future, value: Any) -> None:
        with self._cv:
            self._in_flight -= 1
        fut.set_result(value)

    def _replace(self, i: int, reason: str, crashed: bool) -> None:
        """Retires worker i (see `_retire`) and starts a fresh one in its place now."""
        self._retire(i, reason, crashed)
        self._respawn(i)

    def _retire(self, i: int, reason: str, crashed: bool) -> None:
        """Takes worker i out of service: killed if it crashed or hung, else asked to leave. The
        slot's manager thread starts a fresh one before it takes the next task."""
        old = self._workers[i]
        self._workers[i] = None
        if old is not None:
            if crashed:
                old.kill()
            else:
                old.close(timeout=30.0)  # a worker that cannot be reused exits after answering
            self._retired(old)
        with self._count_lock:
            if crashed:
                self.restarts += 1
            else:
                self.replaced += 1
            self.last_replacement = reason

    def _respawn(self, i: int) -> bool:
        try:
            self._workers[i] = self._spawn(i, first=False)
            self._down_reason[i] = None
            self._down_since[i] = None
            return True
        except BaseException as e:  # noqa: BLE001 - the slot stays down; retried with backoff
            self._workers[i] = None
            self._down_reason[i] = f"{type(e).__name__}: {e}"
            self._down_since[i] = self._down_since[i] or time.monotonic()
            with self._count_lock:
                self.spawn_failures += 1
            return False

    def _respawn_wait(self, i: int) -> float:
        down_for = time.monotonic() - (self._down_since[i] or time.monotonic())
        return min(30.0, 1.0 + down_for / 4)

    # ---- tasks and shutdown -------------------------------------------------------------------
    def _put(self, build: Callable[[], tuple]) -> Future:
        """Queues the item `build()` makes (called under the queue lock, once the pool is known to
        be open); returns its Future (the item's first element)."""
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            item = build()
            self._in_flight += 1
            self._q.append(item)
            self._cv.notify()
        return item[0]

    def in_flight(self) -> int:
        with self._cv:
            return self._in_flight

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, cancel_pending: bool = False) -> None:
        """Stops the workers after the queued tasks finish (or cancels the queued ones)."""
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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
