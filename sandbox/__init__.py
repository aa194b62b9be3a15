"""Isolated, fast, verifiable execution of untrusted model output (see sandbox/README.md).

    from sandbox import run, SandboxPool, verify
    r = run("print(1 + 1)")                        # ExecutionResult(status="ok", stdout="2\n", ...)
    with SandboxPool(workers=4) as pool:
        results = pool.map(programs, timeout_s=5)    # in order, each with its status
        score, details = verify(task, completion, executor=pool)

Names are imported lazily, so a pool worker process (which imports sandbox.worker) stays small.
"""

from ._lazy import lazy_exports

_EXPORTS = {
    "SandboxClient": "client", "connect": "client",
    "Executor": "backend",
    "IsolationUnavailable": "config", "SandboxConfig": "config", "UnisolatedWarning": "config",
    "check_isolation": "preflight",
    "SandboxPool": "pool", "default_pool": "pool", "run": "pool",
    "STATUSES": "result", "ExecutionResult": "result", "InvalidRequest": "result",
    "Session": "session", "SessionLimits": "session", "SessionError": "session",
    "SessionClosed": "session", "SessionLimitExceeded": "session", "SessionBusy": "session",
    "SessionCapReached": "session", "Workspace": "session",
    "Task": "tasks", "TaskFormatError": "tasks", "load_humaneval": "tasks", "load_mbpp": "tasks",
    "load_tasks": "tasks", "save_tasks": "tasks",
    "Verifier": "verifiers", "normalize_output": "verifiers", "verify": "verifiers",
    "verify_batch": "verifiers",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
