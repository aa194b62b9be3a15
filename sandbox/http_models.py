"""Request models and result mapping of the HTTP service (pydantic v2); see sandbox/server.py.

`RunCodeRequest` is SandboxFusion's `POST /run_code` body (same field names, defaults and
meaning: `files` maps a path to base64 content, a null content is skipped, `compile_timeout` is
accepted and unused since python and bash are not compiled, `memory_limit_MB` <= 0 means this
sandbox's default of 512 MB) plus this project's extensions `output_limit_bytes`, `max_procs`,
`collect_limit_bytes`. `NativeRunRequest` is the body of `POST /run` and one step of
`POST /run_sequence` (the arguments of `SandboxPool.run`, files base64). `SessionCreateRequest`,
`SessionRunRequest` and `SessionFilesRequest` are the bodies of the session endpoints. Unknown fields are
refused (422 naming them) rather than ignored, so a misspelt limit never silently falls back to a
default. Limits that depend on the server are applied by `to_run_kwargs`: `output_limit_bytes` and
`collect_limit_bytes` default to the server's output cap and are lowered to it when larger (the
result then says so: `note_output_cap`); more files to fetch than the server returns is a 422.

Not covered: SandboxFusion's other languages (cpp, nodejs, ...), its pytest `args` (refused when
non-empty), Jupyter and the online-judge endpoints.
"""

from __future__ import annotations

import base64
import binascii
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .result import ExecutionResult, InvalidRequest

LANG_ALIASES = {"python": "python", "python3": "python", "py": "python", "bash": "bash", "sh": "bash"}
DEFAULT_MEMORY_MB = 512


def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
    """base64 contents -> bytes; a null content is skipped (SandboxFusion's semantics)."""
    out: dict[str, bytes] = {}
    for path, content in files.items():
        _unicode(path, f"file path {path!r}")
        if content is None:
            continue
        try:
            out[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"files[{path!r}] is not valid base64: {e}") from e
    return out


def _unicode(v: str, what: str, allow_escaped_bytes: bool = False) -> str:
    """Refuses text with lone surrogates (JSON allows them, UTF-8 cannot encode them). stdin may
    carry non-UTF-8 bytes as surrogate escapes (U+DC80..U+DCFF), as SandboxClient sends them."""
    try:
        v.encode("utf-8", "surrogateescape" if allow_escaped_bytes else "strict")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} contains a lone surrogate at index {e.start} (not valid Unicode text)") from e
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("code", check_fields=False)
    @classmethod
    def _code_text(cls, v: str) -> str:
        return _unicode(v, "code")

    @field_validator("stdin", check_fields=False)
    @classmethod
    def _stdin_text(cls, v: str | None) -> str | None:
        return v if v is None else _unicode(v, "stdin", allow_escaped_bytes=True)


class RunCodeRequest(_Strict):
    """SandboxFusion `/run_code` request (python and bash only)."""

    code: str
    language: str = "python"
    compile_timeout: float = Field(10, ge=0, description="accepted for compatibility; unused")
    run_timeout: float = Field(10, gt=0, le=3600)
    memory_limit_MB: int = Field(-1, description="<= 0: this sandbox's default (512 MB)")
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64, null skipped")
    fetch_files: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list, description="SandboxFusion pytest args: must be empty")
    # extensions of this project
    output_limit_bytes: int | None = Field(None, gt=0)
    collect_limit_bytes: int | None = Field(None, gt=0)
    max_procs: int | None = None
    isolated: bool = False

    @field_validator("language")
    @classmethod
    def _language(cls, v: str) -> str:
        lang = LANG_ALIASES.get(v.lower())
        if lang is None:
            raise ValueError(f"unsupported language {v!r}: this sandbox runs python and bash")
        return lang

    @field_validator("args")
    @classmethod
    def _no_args(cls, v: list[str]) -> list[str]:
        if v:
            raise ValueError("args (SandboxFusion's pytest mode) is not supported; send an empty list")
        return v

    @field_validator("files")
    @classmethod
    def _files_b64(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        _decode_files(v)  # validates here so the error points at the field
        return v

    def to_run_kwargs(self, max_output_bytes: int, max_fetch_files: int) -> tuple[str, dict[str, Any]]:
        kw: dict[str, Any] = {
            "language": self.language,
            "timeout_s": float(self.run_timeout),
            "memory_mb": self.memory_limit_MB if self.memory_limit_MB > 0 else DEFAULT_MEMORY_MB,
            "output_limit_bytes": _capped("output_limit_bytes", self.output_limit_bytes, max_output_bytes),
            "files": _decode_files(self.files),
        }
        if self.stdin is not None:
            kw["stdin"] = self.stdin
        if self.fetch_files:
            kw["collect"] = _fetch_list(self.fetch_files, max_fetch_files)
        kw["collect_limit_bytes"] = _capped("collect_limit_bytes", self.collect_limit_bytes, max_output_bytes)
        if self.max_procs is not None:
            kw["max_procs"] = self.max_procs
        if self.isolated:
            kw["isolated"] = True
        return self.code, kw


class NativeRunRequest(_Strict):
    """`POST /run` body and one `/run_sequence` step: `SandboxPool.run` arguments, files base64."""

    code: str
    language: Literal["python", "bash"] = "python"
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64, null skipped")
    timeout_s: float = Field(10.0, gt=0, le=3600)
    memory_mb: int = DEFAULT_MEMORY_MB
    output_limit_bytes: int | None = Field(None, gt=0)
    collect: list[str] = Field(default_factory=list)
    collect_limit_bytes: int | None = Field(None, gt=0)
    max_procs: int | None = None
    isolated: bool = Field(False, description="checks: interpreter and environment nothing in "
                           "/work can influence (see sandbox.result.normalize_request)")

    @field_validator("files")
    @classmethod
    def _files_b64(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        _decode_files(v)
        return v

    def to_run_kwargs(self, max_output_bytes: int, max_fetch_files: int) -> tuple[str, dict[str, Any]]:
        kw: dict[str, Any] = {
            "language": self.language, "timeout_s": float(self.timeout_s), "memory_mb": self.memory_mb,
            "output_limit_bytes": _capped("output_limit_bytes", self.output_limit_bytes, max_output_bytes),
            "collect_limit_bytes": _capped("collect_limit_bytes", self.collect_limit_bytes, max_output_bytes),
            "files": _decode_files(self.files),
        }
        if self.stdin is not None:
            kw["stdin"] = self.stdin
        if self.collect:
            kw["collect"] = _fetch_list(self.collect, max_fetch_files)
        if self.max_procs is not None:
            kw["max_procs"] = self.max_procs
        if self.isolated:
            kw["isolated"] = True
        return self.code, kw


class RunSequenceRequest(_Strict):
    steps: list[NativeRunRequest] = Field(min_length=1)


class SessionCreateRequest(_Strict):
    """`POST /sessions`: files placed in the new session's working directory (base64, null
    skipped), its limits (SessionLimits fields; absent ones default), its workspace (Workspace
    fields, or null: the plain /work session), and an optional request_id: a resend of the same
    id (a client retrying a create whose answer it lost) gets the same session back."""

    files: dict[str, str | None] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)
    workspace: dict[str, Any] | None = None
    request_id: str | None = Field(None, min_length=8, max_length=128)

    @field_validator("files")
    @classmethod
    def _files_b64(cls, v: dict[str, str | None]) -> dict[str, str | None]:
        _decode_files(v)
        return v

    def decoded_files(self) -> dict[str, bytes]:
        return _decode_files(self.files)


class SessionRunRequest(NativeRunRequest):
    """`POST /sessions/{id}/run`: a native run request plus `budget` (False: a task run such as
    a setup or a check, see sandbox/session.py), `seq` (1, 2, ... per session: a resend of the
    last number returns that command's result instead of running it twice) and `background`
    (True: a start command, `Session.start`, whose background processes keep running)."""

    budget: bool = Field(True, strict=True)
    seq: int | None = Field(None, ge=1, strict=True)
    background: bool = Field(False, strict=True)


class SessionFilesRequest(_Strict):
    """`POST /sessions/{id}/files`: regular files of the session's /work to read back."""

    paths: list[str] = Field(min_length=1)
    limit_bytes: int | None = Field(None, ge=0)


def _capped(name: str, value: int | None, cap: int) -> int:
    """The caller's limit, or the server's cap when absent or larger."""
    return cap if value is None else min(value, cap)


def note_output_cap(r: ExecutionResult, requested: int | None, cap: int) -> ExecutionResult:
    """Says in the result's message when the server's cap, not the caller's limit, cut the output."""
    if r.status == "output_limit" and requested is not None and requested > cap:
        r.message = (f"{r.message} (this server caps output at {cap} bytes per stream, "
                     f"lower than the requested output_limit_bytes={requested})").strip()
    return r


def _fetch_list(paths: list[str], cap: int) -> list[str]:
    if len(paths) > cap:
        raise InvalidRequest(f"{len(paths)} files to fetch; this server returns at most {cap} "
                             f"(sandbox.server --max-fetch-files)")
    return [_unicode(p, f"fetch path {p!r}") for p in paths]


_HOST = socket.gethostname()


def result_to_sf(r: ExecutionResult) -> dict[str, Any]:
    """ExecutionResult -> SandboxFusion `/run_code` response (+ exact status as extensions).

    status: Success (exit 0), Failed (ran but failed: non-zero exit, time limit, memory, output
    limit), SandboxError (the sandbox failed). run_result.status: Finished, TimeLimitExceeded, or
    Error for a sandbox failure. Output over the limit comes back truncated to the limit (the
    first bytes, as SandboxFusion keeps its first 1 MiB), with `stdout_truncated` /
    `stderr_truncated` set and `sandbox_status` "output_limit".
    """
    if r.status == "sandbox_error":
        top, run_status = "SandboxError", "Error"
    else:
        top = "Success" if r.status == "ok" else "Failed"
        run_status = "TimeLimitExceeded" if r.status == "timeout" else "Finished"
    return {
        "status": top,
        "message": r.message,
        "compile_result": None,
        "run_result": {"status": run_status, "execution_time": round(r.wall_s, 6),
                       "return_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr},
        "executor_pod_name": _HOST,
        "files": {k: base64.b64encode(v).decode() for k, v in r.files.items()},
        "sandbox_status": r.status,
        "memory_peak_mb": r.memory_peak_mb,
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
    }
