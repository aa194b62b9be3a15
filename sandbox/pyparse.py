"""`parse`: `ast.parse` serialized by one process-wide lock.

CPython 3.11/3.12 keep the AST-to-object conversion's recursion counter in interpreter state, so
two threads parsing at once can fail with "SystemError: AST constructor recursion depth
mismatch" (CPython gh-106905). The verifiers parse prompts, tests and answers on the scoring
threads (the rollout pipeline's and the HTTP server's), so every parse of theirs goes through
here. Parsing is microseconds for these sources; the lock costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse(source, mode=mode) under the lock (raises what ast.parse raises)."""
    with _LOCK:
        return ast.parse(source, mode=mode)
