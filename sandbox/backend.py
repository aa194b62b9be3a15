"""The executor interface: what runs sandbox requests, locally (SandboxPool) or remotely
(SandboxClient), and what a third backend would implement.

`Executor` writes every caller-facing method once (submit, run, map, run_batch, submit_sequence,
run_sequence, session) in terms of two primitives:

    _submit_request(req) -> Future[ExecutionResult]         one normalised request
    _submit_steps(reqs)  -> Future[list[ExecutionResult]]   normalised steps sharing one /work

and optional hooks: `_check(req)` (the backend's own limits on a normalised request: raise
InvalidRequest), `max_steps` (steps per sequence, None: the backend's far end decides),
`open_session` (the backend of a sandbox.Session; default: none), `stats`, `close`.
Requests are normalised and checked (result.normalize_request / normalize_step, then `_check`)
before anything is submitted; a batch or a sequence is checked whole first, so a bad request in
it raises InvalidRequest and submits nothing.

tests/sandbox/test_backend.py builds a third one in a few lines: one Slot run in the caller's thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from .result import ExecutionResult, InvalidRequest, normalize_request, normalize_step


class Executor(ABC):
    """Runs sandbox requests; results always come back (a failure is a sandbox_error result)."""

    max_steps: int | None = None  # steps per sequence this backend accepts (None: no own cap)

    @abstractmethod
    def _submit_request(self, req: dict) -> Future:
        """Schedules one normalised request; Future[ExecutionResult]."""

    @abstractmethod
    def _submit_steps(self, reqs: list[dict]) -> Future:
        """Schedules normalised steps run one after the other sharing one working directory;
        Future[list[ExecutionResult]] (one result per step, in order)."""

    def _check(self, req: dict) -> dict:
        """The backend's own limits on a normalised request (raise InvalidRequest); returns it."""
        return req

    # ---- the interface ------------------------------------------------------------------------
    def submit(self, code: str, **kw: Any) -> Future:
        """Schedules one run; returns a Future[ExecutionResult]. Invalid requests raise
        InvalidRequest here (see result.normalize_request)."""
        return self._submit_request(self._check(normalize_request(code, **kw)))

    def run(self, code: str, **kw: Any) -> ExecutionResult:
        return self.submit(code, **kw).result()

    def submit_sequence(self, steps: list[dict]) -> Future:
        """Runs steps (dicts of `run` arguments, with "code") one after the other in one working
        directory; returns a Future[list[ExecutionResult]]."""
        if not isinstance(steps, (list, tuple)) or not steps:
            raise InvalidRequest("submit_sequence needs a non-empty list of steps")
        if self.max_steps is not None and len(steps) > self.max_steps:
            raise InvalidRequest(f"{len(steps)} steps: at most {self.max_steps} per sequence")
        return self._submit_steps([self._check(normalize_step(s)) for s in steps])

    def run_sequence(self, steps: list[dict]) -> list[ExecutionResult]:
        return self.submit_sequence(steps).result()

    def map(self, codes: Iterable[str], **kw: Any) -> list[ExecutionResult]:
        """Runs every program with the same arguments; results in input order."""
        futs = [self.submit(c, **kw) for c in codes]
        return [f.result() for f in futs]

    def run_batch(self, requests: Iterable[dict]) -> list[ExecutionResult]:
        """Runs request dicts ({"code": ..., plus any `run` argument}); results in input order."""
        reqs = [self._check(normalize_step(r)) for r in requests]  # all checked first
        futs = [self._submit_request(q) for q in reqs]
        return [f.result() for f in futs]

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(self, *, files: dict | None = None, limits=None, workspace=None):
        """The backend of a `Session` (sandbox/session.py); use `session()`."""
        raise NotImplementedError(f"{type(self).__name__} has no sessions")

    def session(self, *, files: dict[str, str | bytes] | None = None, limits=None,
                workspace=None):
        """Opens a Session: one episode's private working directory kept across commands, with
        its own limits (SessionLimits or a dict of its fields) and, optionally, a workspace
        (Workspace or a dict: cwd, home, persistent dirs, uid 0, PATH). See sandbox/session.py."""
        from .session import Session

        return Session(self, files=files, limits=limits, workspace=workspace)

    # ---- reports and shutdown -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:  # noqa: B027 - optional: a backend holding nothing needs none
        """Releases the backend's resources (waits for what was submitted)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
