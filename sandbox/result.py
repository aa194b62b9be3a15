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


MAX_FILES = 4096  # files per request (each also needs its directories: see SandboxPool limits)
MAX_PATH_BYTES = 1024
MAX_CODE_BYTES = 64 << 20
MAX_STDIN_BYTES = 256 << 20
MAX_COLLECT = 256


def _int_field(name: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _utf8(what: str, text: str, errors: str = "strict") -> bytes:
    try:
        return text.encode("utf-8", errors)
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{what} is not valid UTF-8: {text[e.start:e.end]!r} at position {e.start} is a lone "
            "surrogate; send bytes, or text without unpaired surrogates") from None


def check_rel_path(path: str) -> str:
    """Validates a path inside the working directory; returns it normalised.

    Rejects non-strings, absolute paths, `..` components, empty names, NUL bytes, names that are
    not valid UTF-8 (lone surrogates other than surrogateescape'd bytes), components longer than
    255 bytes and paths longer than MAX_PATH_BYTES.
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
    raw = _utf8(f"file path {path!r}", norm, "surrogateescape")
    if len(raw) > MAX_PATH_BYTES:
        raise InvalidRequest(f"file path is longer than {MAX_PATH_BYTES} bytes: {path[:60]!r}...")
    if any(len(c) > 255 for c in raw.split(b"/")):
        raise InvalidRequest(f"a component of {path[:80]!r} is longer than 255 bytes")
    return norm


def _check_file_tree(paths: list[str]) -> None:
    """Two names for one file, or a file that another path needs as a directory."""
    files = set()
    for p in paths:
        if p in files:
            raise InvalidRequest(f"file path {p!r} is given twice (after normalisation)")
        files.add(p)
    for p in paths:
        parts = p.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in files:
                raise InvalidRequest(f"files {d!r} and {p!r} conflict: {d!r} would have to be "
                                     "both a file and a directory")


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
    isolated: bool = False,
    **unknown: Any,
) -> dict[str, Any]:
    """Validates one run request and returns it as a plain dict (picklable, JSON-able but bytes).

    Every caller mistake raises InvalidRequest saying what is wrong: unknown fields, wrong types,
    limits out of range, bad or conflicting file paths, too many files, text that is not valid
    UTF-8 (lone surrogates), oversized code/stdin. `isolated=True` runs the interpreter so that
    nothing in /work or the environment can influence it (see sandbox/README.md); it is meant for
    check scripts that run over files a completion wrote.
    """
    if unknown:
        raise InvalidRequest(f"unknown request field(s) {sorted(unknown)}; known: code, language, "
                             "stdin, files, timeout_s, memory_mb, output_limit_bytes, collect, "
                             "collect_limit_bytes, max_procs, isolated")
    if not isinstance(code, str):
        raise InvalidRequest(f"code must be a str, got {type(code).__name__}")
    if len(_utf8("code", code, "surrogateescape")) > MAX_CODE_BYTES:
        raise InvalidRequest(f"code is larger than {MAX_CODE_BYTES} bytes")
    if language not in LANGUAGES:
        raise InvalidRequest(f"language must be one of {LANGUAGES}, got {language!r}")
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s) and 0 < timeout_s <= 3600):
        raise InvalidRequest(f"timeout_s must be a number in (0, 3600], got {timeout_s!r}")
    _int_field("memory_mb", memory_mb, 16, 1 << 20)
    _int_field("output_limit_bytes", output_limit_bytes, 1, 1 << 30)
    _int_field("collect_limit_bytes", collect_limit_bytes, 0, 1 << 30)
    if max_procs is not None:
        _int_field("max_procs", max_procs, 4, 100000)
    if type(isolated) is not bool:
        raise InvalidRequest(f"isolated must be a bool, got {isolated!r}")
    if files is None:
        files = {}
    if not isinstance(files, dict):
        raise InvalidRequest(f"files must map relative paths to str or bytes, got {type(files).__name__}")
    if len(files) > MAX_FILES:
        raise InvalidRequest(f"{len(files)} files: at most {MAX_FILES} per request")
    fs: dict[str, bytes] = {}
    for p, content in files.items():
        norm = check_rel_path(p)
        if isinstance(content, str):
            content = _utf8(f"content of {p!r}", content, "surrogateescape")
        if not isinstance(content, (bytes, bytearray)):
            raise InvalidRequest(f"content of {p!r} must be str or bytes, got {type(content).__name__}")
        if norm in fs:
            raise InvalidRequest(f"file path {p!r} is given twice (after normalisation: {norm!r})")
        fs[norm] = bytes(content)
    _check_file_tree(list(fs))
    if isinstance(stdin, str):
        stdin = _utf8("stdin", stdin, "surrogateescape")
    if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
        raise InvalidRequest(f"stdin must be str, bytes or None, got {type(stdin).__name__}")
    if stdin is not None and len(stdin) > MAX_STDIN_BYTES:
        raise InvalidRequest(f"stdin is larger than {MAX_STDIN_BYTES} bytes")
    if collect is None:
        collect = ()
    if isinstance(collect, (str, bytes)) or not isinstance(collect, (list, tuple)):
        raise InvalidRequest(f"collect must be a list of relative paths, got {collect!r}")
    if len(collect) > MAX_COLLECT:
        raise InvalidRequest(f"collect lists {len(collect)} paths: at most {MAX_COLLECT}")
    col = [check_rel_path(p) for p in collect]
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
        "isolated": isolated,
    }


def normalize_step(step: Any) -> dict[str, Any]:
    """One step of a sequence or batch: a dict with "code" and any `normalize_request` field."""
    if not isinstance(step, dict):
        raise InvalidRequest(f"a step must be a dict with 'code', got {type(step).__name__}")
    if "code" not in step:
        raise InvalidRequest(f"a step needs 'code' (got fields {sorted(step)})")
    return normalize_request(step["code"], **{k: v for k, v in step.items() if k != "code"})
