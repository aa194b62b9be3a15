"""Execution results and requests shared by the executor, the pool, the server and the client."""

from __future__ import annotations

import base64
import dataclasses
import math
import posixpath
from typing import Any

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "sandbox_error")
LANGUAGES = ("python", "bash")


@dataclasses.dataclass
class ExecutionResult:
    """Outcome of one sandboxed run.

    status:
      ok            exit code 0
      error         the program ran and exited non-zero (or died of a signal we did not send)
      timeout       the wall-clock deadline (or the CPU-time backstop) was hit; the tree was killed
      memory        the cgroup OOM killer fired or the program died of MemoryError
      output_limit  stdout or stderr exceeded output_limit_bytes; the tree was killed
      sandbox_error the sandbox itself failed (setup, a crashed worker, a transport error)
    exit_code: the program's exit code (128+N when killed by signal N, as bash reports it), None if
      it never started. signal: N in that case.
    files: files read back from the working directory (see `collect`), path -> bytes.
    """

    status: str
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    signal: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    memory_peak_mb: float | None = None
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    message: str = ""
    worker: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["files"] = {k: base64.b64encode(v).decode() for k, v in self.files.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecutionResult:
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["files"] = {k: base64.b64decode(v) for k, v in (d.get("files") or {}).items()}
        return cls(**kw)

    @classmethod
    def sandbox_error(cls, message: str, wall_s: float = 0.0) -> ExecutionResult:
        return cls(status="sandbox_error", message=message, wall_s=wall_s)


class InvalidRequest(ValueError):
    """A request the sandbox refuses before running anything (bad path, bad limit, ...)."""


def check_rel_path(path: str) -> str:
    """Validates a path inside the working directory; returns it normalised.

    Rejects absolute paths, `..` components, empty names and NUL bytes.
    """
    if not isinstance(path, str) or not path:
        raise InvalidRequest(f"file path must be a non-empty string, got {path!r}")
    if "\x00" in path:
        raise InvalidRequest(f"file path contains a NUL byte: {path!r}")
    if path.startswith("/"):
        raise InvalidRequest(f"file path must be relative to the working directory, got absolute {path!r}")
    parts = path.split("/")
    if any(p == ".." for p in parts):
        raise InvalidRequest(f"file path must not contain '..': {path!r}")
    norm = posixpath.normpath(path)
    if norm in (".", "") or norm.startswith("../"):
        raise InvalidRequest(f"file path does not name a file: {path!r}")
    return norm


def normalize_request(
    code: str,
    *,
    language: str = "python",
    stdin: str | bytes | None = None,
    files: dict[str, str | bytes] | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    output_limit_bytes: int = 1 << 20,
    collect: list[str] | tuple[str, ...] | None = None,
    collect_limit_bytes: int = 1 << 20,
    max_procs: int | None = None,
) -> dict[str, Any]:
    """Validates one run request and returns it as a plain dict (picklable, JSON-able but bytes)."""
    if not isinstance(code, str):
        raise InvalidRequest("code must be a str")
    if language not in LANGUAGES:
        raise InvalidRequest(f"language must be one of {LANGUAGES}, got {language!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and 0 < timeout_s <= 3600):
        raise InvalidRequest(f"timeout_s must be in (0, 3600], got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and 16 <= memory_mb <= 1 << 20):
        raise InvalidRequest(f"memory_mb must be an int in [16, 1048576], got {memory_mb!r}")
    if not (isinstance(output_limit_bytes, int) and 0 < output_limit_bytes <= 1 << 30):
        raise InvalidRequest(f"output_limit_bytes must be in (0, 1 GiB], got {output_limit_bytes!r}")
    if max_procs is not None and not (isinstance(max_procs, int) and 4 <= max_procs <= 100000):
        raise InvalidRequest(f"max_procs must be an int in [4, 100000], got {max_procs!r}")
    fs: dict[str, bytes] = {}
    for p, content in (files or {}).items():
        norm = check_rel_path(p)
        if isinstance(content, str):
            content = content.encode("utf-8", "surrogateescape")
        if not isinstance(content, (bytes, bytearray)):
            raise InvalidRequest(f"content of {p!r} must be str or bytes")
        fs[norm] = bytes(content)
    if isinstance(stdin, str):
        stdin = stdin.encode("utf-8", "surrogateescape")
    if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise InvalidRequest("stdin must be str, bytes or None")
    col = [check_rel_path(p) for p in (collect or ())]
    return {
        "code": code,
        "language": language,
        "stdin": bytes(stdin) if stdin is not None else None,
        "files": fs,
        "timeout_s": float(timeout_s),
        "memory_mb": int(memory_mb),
        "output_limit_bytes": int(output_limit_bytes),
        "collect": col,
        "collect_limit_bytes": int(collect_limit_bytes),
        "max_procs": max_procs,
    }
