"""Isolated, fast, verifiable execution of untrusted model output (see sandbox/README.md).

    from sandbox import run, SandboxPool, verify
    r = run("print(1 + 1)")                        # ExecutionResult(status="ok", stdout="2\n", ...)
    with SandboxPool(workers=4) as pool:
        results = pool.map(programs, timeout_s=5)    # in order, each with its status
        score, details = verify(task, completion, executor=pool)

Names are imported lazily, so a pool worker process (which imports sandbox.worker) stays small.
"""

import importlib

_EXPORTS = {
    "SandboxClient": "client", "connect": "client",
    "Executor": "backend",
    "IsolationUnavailable": "config", "SandboxConfig": "config", "UnisolatedWarning": "config",
    "check_isolation": "preflight",
    "SandboxPool": "pool", "default_pool": "pool", "run": "pool",
    "STATUSES": "result", "ExecutionResult": "result", "InvalidRequest": "result",
    "Session": "session", "SessionLimits": "session", "SessionError": "session",
    "SessionClosed": "session", "SessionLimitExceeded": "session", "SessionBusy": "session",
    "SessionCapReached": "session",
    "Task": "tasks", "TaskFormatError": "tasks", "load_humaneval": "tasks", "load_mbpp": "tasks",
    "load_tasks": "tasks", "save_tasks": "tasks",
    "Verifier": "verifiers", "normalize_output": "verifiers", "verify": "verifiers",
    "verify_batch": "verifiers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
