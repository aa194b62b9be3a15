"""HTTP service over a SandboxPool: Starlette + pydantic behind uvicorn.

    python -m sandbox.server --port 8080 [--host 127.0.0.1] [--workers N] [--token T]

Endpoints
  POST /run_code      SandboxFusion-compatible (sandbox/http_models.py: RunCodeRequest,
                      result_to_sf): {"code", "language", "run_timeout", "memory_limit_MB", "stdin",
                      "files": {path: base64 | null}, "fetch_files", "compile_timeout"} (+ extensions
                      "output_limit_bytes", "max_procs", "collect_limit_bytes") -> {"status":
                      Success|Failed|SandboxError, "message", "compile_result": null, "run_result":
                      {"status", "execution_time", "return_code", "stdout", "stderr"}, "files",
                      "executor_pod_name"} (+ "sandbox_status", "memory_peak_mb", "*_truncated").
  POST /run_sequence  {"steps": [native requests]} -> {"results": [ExecutionResult dicts]}: the steps
                      share one working directory (terminal tasks).
  POST /run           one native request (SandboxPool.run arguments, files base64) ->
                      ExecutionResult.to_dict().
  GET  /health        200 {"status": "ok"|"degraded", "workers", "up", "down": [slots], ...} (all
                      of SandboxPool.health()); 503 with "status": "down" when no slot is up.
                      /v1/ping answers "pong" (SandboxFusion's liveness probe).
  GET  /stats         pool.stats() plus "server": this server's counters (429s, cancellations, ...).

Sessions (sandbox/session.py: one episode's private working directory across commands; the
server owns them, as a pool's caller would):
  POST /sessions               {"files": {path: base64}, "limits": {SessionLimits fields},
                               "workspace": {Workspace fields} | null, "request_id"} ->
                               {"session_id", "limits", "workspace"}; 429 + Retry-After when
                               the pool's `--max-sessions` are open (client waits, as for 429s).
  POST /sessions/{id}/run      a native request + "budget" (false: setup/check runs) + "seq"
                               (1, 2, ...: a resend of the last seq returns its result, never runs
                               it twice) + "background" (true: a start command whose background
                               processes keep running; a task run) -> ExecutionResult dict.
  POST /sessions/{id}/files    {"paths", "limit_bytes"} -> {"files": {path: base64}, "notes"}
  POST /sessions/{id}/close    (or DELETE /sessions/{id}) -> {"closed": true, "reason"}
  GET  /sessions/{id}          usage: commands, wall_s, idle_s, limits, closed_reason
  Session errors are JSON errors with "session_error": "closed" (410; 404 "unknown" for an id
  never seen), "limit" or "busy" (409), "cap" (429). Session run and create requests count
  against the same admission capacity as /run; every endpoint has the same auth, body and output
  caps (read-back files at most max_output_bytes each, max_fetch_files of them).

Behaviour under load and abuse (ServerConfig fields; each a command-line flag):
  - bounded queue: at most `workers + max_queue` run requests are admitted at once; beyond that
    the answer is 429 with Retry-After (seconds, from the queue length and the mean run time),
    before the body is read. The project's client (sandbox/client.py) retries 429s honouring it.
  - a client that disconnects while its run is queued gets that run cancelled (it never
    executes); a run already executing finishes (bounded by its own timeout), its result dropped.
  - body: at most `max_body_bytes` (413, from Content-Length before reading, or while reading a
    chunked body), all of it within `request_timeout_s` (408); the request line and headers too
    (408, sandbox/http_protocol.py), at most `max_header_bytes` (431).
  - connections: idle ones closed after `idle_timeout_s` (from open, and between requests); at
    most `max_connections` open: at the cap a new connection closes the oldest one that has not
    authenticated (sandbox/http_protocol.py), and gets 503 only when every open one has.
  - output: stdout and stderr each at most `max_output_bytes` per run, every fetched file too
    (the caller's output_limit_bytes / collect_limit_bytes may be lower; a higher one is lowered
    to the cap and the result's message says so), at most `max_fetch_files` files (422 beyond)
    and `max_steps` sequence steps (422); so a response is bounded.
  - errors are JSON {"status": "SandboxError", "message": ...}: 400 the body is not JSON (or the
    request could not be parsed), 422 the JSON does not validate (with FastAPI-style "detail", as
    SandboxFusion answers), 401 bad or missing token, 404/405 no such route, 503 pool closed.
  - auth: with a token (`--token` or env KIMI_SANDBOX_TOKEN) every endpoint but /health and
    /v1/ping needs `Authorization: Bearer <token>`. Binding beyond loopback without a token is
    refused unless `--insecure-no-token` is given.
Not covered: TLS (put a TLS-terminating proxy in front), several server processes over one pool.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .http_models import (
    NativeRunRequest,
    RunCodeRequest,
    RunSequenceRequest,
    SessionCreateRequest,
    SessionFilesRequest,
    SessionRunRequest,
    _fetch_list,
    note_output_cap,
    result_to_sf,
)
from .http_protocol import ConnectionLimits, bearer_ok, guarded_protocol
from .pool import SandboxPool
from .result import ExecutionResult, InvalidRequest, check_rel_path, normalize_request

TOKEN_ENV = "KIMI_SANDBOX_TOKEN"
RUN_PATHS = frozenset({"/run_code", "/run", "/run_sequence"})
SESSION_PREFIX = "/sessions"
OPEN_PATHS = frozenset({"/health", "/v1/ping"})
_OFFLOAD_BYTES = 256 << 10  # bodies / results larger than this are (de)serialised in a thread


@dataclass(frozen=True)
class ServerConfig:
    """Limits of one server (see the module docstring); validated on construction."""

    max_queue: int = 64  # run requests waiting for a slot beyond one per slot; more -> 429
    max_body_bytes: int = 16 << 20
    max_output_bytes: int = 1 << 20  # per stream and per fetched file
    max_fetch_files: int = 64
    max_steps: int = 64
    request_timeout_s: float = 30.0  # request head, and body, each within this
    idle_timeout_s: float = 5.0
    max_header_bytes: int = 64 << 10
    max_connections: int = 4096
    backlog: int = 2048
    shutdown_grace_s: float = 30.0  # in-flight requests get this long on stop; then cancelled
    token: str | None = None

    def __post_init__(self) -> None:
        ints = {"max_queue": 0, "max_body_bytes": 1024, "max_output_bytes": 1, "max_fetch_files": 0,
                "max_steps": 1, "max_header_bytes": 1024, "max_connections": 1, "backlog": 1}
        for name, lo in ints.items():
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"ServerConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.max_output_bytes > 1 << 30:
            raise ValueError(f"ServerConfig.max_output_bytes must be <= 1 GiB, got {self.max_output_bytes}")
        for name in ("request_timeout_s", "idle_timeout_s", "shutdown_grace_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"ServerConfig.{name} must be a positive number of seconds, got {v!r}")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16
                                       or not self.token.isprintable() or " " in self.token):
            raise ValueError("ServerConfig.token must be a printable string of at least 16 characters "
                             "without spaces (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")


@dataclass
class ServerState:
    """Counters and the admission count (touched only from the event loop thread)."""

    admitted: int = 0
    exec_ewma_s: float = 0.05
    counters: dict[str, int] = field(default_factory=dict)

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n


class ApiError(Exception):
    def __init__(self, status: int, message: str, detail: Any = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.detail, self.headers = status, message, detail, headers or {}
        self.extra = extra or {}


def _json_bytes(obj: Any) -> bytes:
    # ensure_ascii: any str (even one with a lone surrogate) encodes
    return json.dumps(obj, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json_bytes(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(status: int, message: str, detail: Any = None,
                   headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> Response:
    body: dict[str, Any] = {"status": "SandboxError", "message": message}
    if detail is not None:
        body["detail"] = detail
    if extra:
        body.update(extra)
    return json_response(body, status, headers)


def _is_session_run(path: str) -> bool:
    """POST /sessions (create) and /sessions/{id}/run take a pool slot like /run."""
    return path == SESSION_PREFIX or (path.startswith(SESSION_PREFIX + "/") and path.endswith("/run"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, insecure_no_token: bool) -> None:
    """Refuses a non-loopback bind without a token unless explicitly told otherwise."""
    if token or insecure_no_token or is_loopback(host):
        return
    raise ValueError(f"refusing to serve on {host!r} (beyond loopback) without a token: anyone who "
                     f"can reach it could run code here. Set --token (or env {TOKEN_ENV}), bind "
                     f"--host 127.0.0.1, or pass --insecure-no-token to accept the risk")


# ---- ASGI guard: auth, admission (429), body size and deadline -----------------------------------


class Guard:
    """Pure ASGI middleware in front of the app (runs before any body is read)."""

    def __init__(self, app, pool: SandboxPool, cfg: ServerConfig, state: ServerState) -> None:
        self.app, self.pool, self.cfg, self.state = app, pool, cfg, state
        self._token = cfg.token.encode() if cfg.token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        st.bump("requests")
        path = scope["path"]
        headers = dict(scope["headers"])
        if self._token is not None and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            if not bearer_ok(auth, self._token):
                st.bump("unauthorized")
                return await error_response(
                    401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                    "(SandboxClient(token=...) or env " + TOKEN_ENV + ")",
                    headers={"www-authenticate": "Bearer", "connection": "close"})(scope, receive, send)
        sessions = path == SESSION_PREFIX or path.startswith(SESSION_PREFIX + "/")
        if scope["method"] != "POST" or not (path in RUN_PATHS or sessions):
            return await self.app(scope, receive, send)
        cl = headers.get(b"content-length")
        if cl is not None and (not cl.isdigit() or int(cl) > self.cfg.max_body_bytes):
            st.bump("body_too_large")  # (the HTTP parser already refuses a non-numeric length)
            return await self._too_large(scope, receive, send)
        admit = path in RUN_PATHS or _is_session_run(path)  # files/close: bounded body only
        capacity = self.pool.n + self.cfg.max_queue
        if admit and st.admitted >= capacity:
            st.bump("rejected_busy")
            ra = self.retry_after()
            return await error_response(
                429, f"the sandbox queue is full ({capacity} requests admitted); retry after {ra}s",
                headers={"retry-after": str(ra)})(scope, receive, send)
        st.admitted += admit
        try:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            sent = False

            async def replay():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: waits for http.disconnect

            await self.app(scope, replay, send)
        finally:
            st.admitted -= admit

    def retry_after(self) -> int:
        queued = max(1, self.state.admitted - self.pool.n)
        return int(min(30, max(1, math.ceil(queued * self.state.exec_ewma_s / self.pool.n))))

    async def _too_large(self, scope, receive, send) -> None:
        await error_response(413, f"request body over this server's cap of {self.cfg.max_body_bytes} "
                             "bytes (sandbox.server --max-body-bytes)",
                             headers={"connection": "close"})(scope, receive, send)

    async def _read_body(self, scope, receive, send) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        chunks: list[bytes] = []
        n = 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                self.state.bump("body_timeouts")
                await error_response(408, f"request body not received within {self.cfg.request_timeout_s:g}s",
                                     headers={"connection": "close"})(scope, receive, send)
                return None
            if msg["type"] == "http.disconnect":
                self.state.bump("gone_before_body")
                return None
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.cfg.max_body_bytes:
                self.state.bump("body_too_large")
                await self._too_large(scope, receive, send)
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)


# ---- the application ---------------------------------------------------------------------------


def _parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    if not raw.strip():
        raise ApiError(400, "empty request body: send a JSON object")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON (UTF-8): {e}") from e
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply to parse: send a flat request "
                       "object (the fields documented for this endpoint)") from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_context=False, include_input=False)
        msg = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errs)
        detail = [{"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]} for err in errs]
        raise ApiError(422, f"invalid request: {msg}", detail) from e


async def _parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    if len(raw) > _OFFLOAD_BYTES:
        return await asyncio.to_thread(_parse, raw, model)
    return _parse(raw, model)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _ClientGone(Exception):
    pass


def build_app(pool: SandboxPool, cfg: ServerConfig, state: ServerState,
              owned_sessions: set[str] | None = None):
    """The ASGI application (Guard in front of the Starlette routes). `owned_sessions` collects
    the ids of the sessions opened through it (the server closes them when it stops)."""
    owned = owned_sessions if owned_sessions is not None else set()
    created_by_request: dict[str, str] = {}  # request_id -> session id (bounded below)

    def submit(fn: Callable[[], Future]) -> Future:
        try:
            return fn()
        except (InvalidRequest, ValueError, TypeError) as e:
            raise ApiError(422, f"invalid request: {e}") from e
        except RuntimeError as e:  # the pool is closed
            raise ApiError(503, f"sandbox pool unavailable: {e}") from e

    async def execute(request: Request, fn: Callable[[], Future]):
        """Submits to the pool and waits for the result, or for the client to leave (then a run
        still queued is cancelled and never executes)."""
        fut = submit(fn)
        done_f = asyncio.wrap_future(fut)
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({done_f, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # server shutdown past its grace period
            fut.cancel()
            gone.cancel()
            raise
        if done_f.done():
            gone.cancel()
            return done_f.result()
        if fut.cancel():
            state.bump("cancelled_client_gone")
        else:  # already executing: let it finish so the admission count stays true
            state.bump("finished_client_gone")
            try:
                await done_f
            except Exception:  # noqa: BLE001 - nobody is listening any more
                pass
        raise _ClientGone()

    def learn(results: list[ExecutionResult]) -> None:
        for r in results:
            state.exec_ewma_s = 0.9 * state.exec_ewma_s + 0.1 * (r.wall_s + 0.005)

    async def respond(obj: Any, size_hint: int) -> Response:
        if size_hint > _OFFLOAD_BYTES:
            data = await asyncio.to_thread(_json_bytes, obj)
            return Response(data, media_type="application/json")
        return json_response(obj)

    def size_of(rs: list[ExecutionResult]) -> int:
        return sum(len(r.stdout) + len(r.stderr) + sum(len(v) for v in r.files.values()) for r in rs)

    async def run_one(request: Request, model, render) -> Response:
        """One program: parse the body as `model`, run it, answer render(result)."""
        req = await _parse_body(request, model)
        code, kw = _kwargs(req)
        try:
            r = await execute(request, lambda: pool.submit(code, **kw))
        except _ClientGone:
            return Response(status_code=499)
        learn([r])
        note_output_cap(r, req.output_limit_bytes, cfg.max_output_bytes)
        return await respond(render(r), size_of([r]))

    async def run_code(request: Request) -> Response:
        return await run_one(request, RunCodeRequest, result_to_sf)

    async def run_native(request: Request) -> Response:
        return await run_one(request, NativeRunRequest, lambda r: r.to_dict())

    async def run_sequence(request: Request) -> Response:
        req = await _parse_body(request, RunSequenceRequest)
        if len(req.steps) > cfg.max_steps:
            raise ApiError(422, f"{len(req.steps)} steps; this server runs at most {cfg.max_steps} "
                           "per sequence (sandbox.server --max-steps)")
        steps = []
        for s in req.steps:
            code, kw = _kwargs(s)
            steps.append({"code": code, **kw})
        try:
            rs = await execute(request, lambda: pool.submit_sequence(steps))
        except _ClientGone:
            return Response(status_code=499)
        learn(rs)
        for r, s in zip(rs, req.steps):
            note_output_cap(r, s.output_limit_bytes, cfg.max_output_bytes)
        return await respond({"results": [r.to_dict() for r in rs]}, size_of(rs))

    def _kwargs(req) -> tuple[str, dict]:
        try:
            return req.to_run_kwargs(cfg.max_output_bytes, cfg.max_fetch_files)
        except (InvalidRequest, ValueError) as e:
            raise ApiError(422, f"invalid request: {e}") from e

    # ---- sessions ------------------------------------------------------------------------
    from .session import SessionError, SessionLimits, Workspace

    def session_error(e: SessionError) -> ApiError:
        status = {"closed": 410, "limit": 409, "busy": 409, "cap": 429}.get(e.kind, 409)
        state.bump(f"session_{e.kind}")
        return ApiError(status, str(e), headers={"retry-after": "1"} if e.kind == "cap" else None,
                        extra={"session_error": e.kind})

    def lookup(request: Request):
        sid = request.path_params["sid"]
        try:
            return pool.sessions.get(sid)
        except SessionError as e:
            raise session_error(e) from e
        except KeyError:
            raise ApiError(404, f"no session {sid!r} on this server",
                           extra={"session_error": "unknown"}) from None

    async def session_create(request: Request) -> Response:
        req = await _parse_body(request, SessionCreateRequest)
        try:
            limits = SessionLimits.coerce(req.limits)
            workspace = Workspace.coerce(req.workspace)
            files = req.decoded_files()
        except ValueError as e:
            raise ApiError(422, f"invalid request: {e}") from e
        if req.request_id is not None and req.request_id in created_by_request:
            sid = created_by_request[req.request_id]
            try:
                s = pool.sessions.get(sid)
                return json_response(created(s))
            except (SessionError, KeyError):
                pass  # closed since: open a new one
        try:
            s = await asyncio.to_thread(pool.sessions.open, files=files, limits=limits,
                                        workspace=workspace)
        except SessionError as e:
            raise session_error(e) from e
        except (InvalidRequest, ValueError) as e:
            raise ApiError(422, f"invalid request: {e}") from e
        owned.add(s.id)
        if req.request_id is not None:
            created_by_request[req.request_id] = s.id
            while len(created_by_request) > 4096:
                created_by_request.pop(next(iter(created_by_request)))
        state.bump("sessions_opened")
        return json_response(created(s))

    def created(s) -> dict:
        return {"session_id": s.id, "limits": s.limits.to_dict(),
                "workspace": s.workspace.to_dict() if s.workspace is not None else None}

    async def session_run(request: Request) -> Response:
        s = lookup(request)
        req = await _parse_body(request, SessionRunRequest)
        code, kw = _kwargs(req)
        try:
            q = normalize_request(code, **kw)
            if req.background and q.get("isolated"):
                raise InvalidRequest("a start command (background) cannot be isolated")
        except InvalidRequest as e:
            raise ApiError(422, f"invalid request: {e}") from e
        try:
            r = await execute(request, lambda: s.submit(q, req.budget, req.seq, req.background))
        except _ClientGone:
            return Response(status_code=499)
        except SessionError as e:
            raise session_error(e) from e
        learn([r])
        note_output_cap(r, req.output_limit_bytes, cfg.max_output_bytes)
        return await respond(r.to_dict(), size_of([r]))

    async def session_files(request: Request) -> Response:
        s = lookup(request)
        req = await _parse_body(request, SessionFilesRequest)
        try:
            paths = [check_rel_path(p) for p in _fetch_list(req.paths, cfg.max_fetch_files)]
        except (InvalidRequest, ValueError) as e:
            raise ApiError(422, f"invalid request: {e}") from e
        limit = min(req.limit_bytes if req.limit_bytes is not None else cfg.max_output_bytes,
                    cfg.max_output_bytes)
        try:
            files, notes = await asyncio.to_thread(s.read_files_with_notes, paths, limit)
        except SessionError as e:
            raise session_error(e) from e
        return await respond({"files": {k: base64.b64encode(v).decode() for k, v in files.items()},
                              "notes": notes}, sum(len(v) for v in files.values()))

    async def session_close(request: Request) -> Response:
        sid = request.path_params["sid"]
        try:
            s = pool.sessions.get(sid)
        except SessionError as e:  # closed already: closing is idempotent
            return json_response({"closed": True, "reason": str(e)})
        except KeyError:
            raise ApiError(404, f"no session {sid!r} on this server",
                           extra={"session_error": "unknown"}) from None
        await asyncio.to_thread(s.close)
        owned.discard(sid)
        return json_response({"closed": True, "reason": s.closed_reason})

    async def session_info(request: Request) -> Response:
        return json_response(lookup(request).usage())

    async def health(request: Request) -> Response:
        h = pool.health()  # workers, up, down (+ whatever else the pool reports per slot)
        up = h["up"]
        status = "ok" if up == h["workers"] else ("degraded" if up else "down")
        return json_response({"status": status, **h}, 200 if up else 503,
                             None if up else {"retry-after": "5"})

    async def ping(request: Request) -> Response:
        return json_response("pong")

    async def stats(request: Request) -> Response:
        s = await asyncio.to_thread(pool.stats)
        s["server"] = {**state.counters, "admitted": state.admitted,
                       "capacity": pool.n + cfg.max_queue, "exec_ewma_ms": round(state.exec_ewma_s * 1000, 2),
                       "config": {k: v for k, v in asdict(cfg).items() if k != "token"},
                       "auth": cfg.token is not None}
        return json_response(s)

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        state.bump(f"http_{exc.status}")
        return error_response(exc.status, exc.message, exc.detail, exc.headers, exc.extra)

    async def on_http_exc(request: Request, exc: HTTPException) -> Response:
        state.bump(f"http_{exc.status_code}")
        msg = {404: f"no route {request.url.path}", 405: f"{request.method} not allowed on {request.url.path}"}
        return error_response(exc.status_code, msg.get(exc.status_code, str(exc.detail)), headers=exc.headers)

    async def on_error(request: Request, exc: Exception) -> Response:
        state.bump("http_500")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")

    app = Starlette(
        routes=[Route("/run_code", run_code, methods=["POST"]), Route("/run", run_native, methods=["POST"]),
                Route("/run_sequence", run_sequence, methods=["POST"]),
                Route("/health", health, methods=["GET"]), Route("/", health, methods=["GET"]),
                Route("/v1/ping", ping, methods=["GET"]), Route("/stats", stats, methods=["GET"]),
                Route("/sessions", session_create, methods=["POST"]),
                Route("/sessions/{sid}/run", session_run, methods=["POST"]),
                Route("/sessions/{sid}/files", session_files, methods=["POST"]),
                Route("/sessions/{sid}/close", session_close, methods=["POST"]),
                Route("/sessions/{sid}", session_close, methods=["DELETE"]),
                Route("/sessions/{sid}", session_info, methods=["GET"])],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_exc, Exception: on_error})
    return Guard(app, pool, cfg, state)


# ---- server ------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class SandboxServer:
    """The HTTP service bound to a pool. `serve_in_thread()` for tests and embedding, `stop()`.

    host/port: where to listen (port 0 picks a free one; `url` tells which). `config` or keyword
    overrides of ServerConfig fields set the limits and the token. Raises ValueError for a
    non-loopback host without a token unless insecure_no_token=True.
    """

    def __init__(self, pool: SandboxPool, host: str = "127.0.0.1", port: int = 0, *,
                 config: ServerConfig | None = None, insecure_no_token: bool = False,
                 verbose: bool = False, **overrides: Any) -> None:
        if config is None:
            config = ServerConfig(**overrides)
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        check_bind(host, config.token, insecure_no_token)
        self.pool, self.config, self.host = pool, config, host
        self.state = ServerState()
        self.sock = _bind(host, port)
        bound = self.sock.getsockname()[0]
        if not (config.token or insecure_no_token or is_loopback(bound)):  # e.g. a remapped name
            self.sock.close()
            check_bind(bound, None, False)
        self.port = self.sock.getsockname()[1]
        protocol = guarded_protocol(ConnectionLimits(config.request_timeout_s, config.max_header_bytes,
                                                     config.max_connections,
                                                     config.token.encode() if config.token else None),
                                    self.state.counters)
        self.sessions: set[str] = set()  # ids opened through this server; closed by stop()
        self._uv = uvicorn.Server(uvicorn.Config(
            build_app(pool, config, self.state, self.sessions), http=protocol, lifespan="off", loop="auto",
            timeout_keep_alive=config.idle_timeout_s, backlog=config.backlog,
            timeout_graceful_shutdown=config.shutdown_grace_s, proxy_headers=False,
            server_header=False, access_log=verbose, log_level="info" if verbose else "warning"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def serve_in_thread(self, timeout_s: float = 60.0) -> SandboxServer:
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [self.sock]},
                                        daemon=True, name="sandbox-http")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("sandbox HTTP server failed to start (see the log above)")
            time.sleep(0.01)
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish (up to shutdown_grace_s), returns."""
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join()
        try:
            self.sock.close()
        except OSError:
            pass
        if self.sessions and self.pool._sessions is not None:
            for sid in list(self.sessions):
                try:
                    self.pool.sessions.get(sid).close("the sandbox server stopped", "pool")
                except (KeyError, RuntimeError):
                    pass
            self.sessions.clear()


def main(argv: list[str] | None = None) -> int:
    d = ServerConfig()
    p = argparse.ArgumentParser(description="Sandbox HTTP server (SandboxFusion-compatible /run_code)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=None, help="sandbox slots (default: CPU count)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                   help=f"bearer token required on every endpoint but /health (default: env {TOKEN_ENV})")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="allow a non-loopback --host without a token (anyone reaching it can run code)")
    p.add_argument("--max-queue", type=int, default=d.max_queue)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-output-bytes", type=int, default=d.max_output_bytes)
    p.add_argument("--max-fetch-files", type=int, default=d.max_fetch_files)
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s)
    p.add_argument("--max-connections", type=int, default=d.max_connections)
    p.add_argument("--max-sessions", type=int, default=64,
                   help="sessions open at once (POST /sessions beyond it: 429)")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    try:
        cfg = ServerConfig(max_queue=a.max_queue, max_body_bytes=a.max_body_bytes,
                           max_output_bytes=a.max_output_bytes, max_fetch_files=a.max_fetch_files,
                           max_steps=a.max_steps, request_timeout_s=a.request_timeout,
                           idle_timeout_s=a.idle_timeout, max_connections=a.max_connections,
                           token=a.token)
        check_bind(a.host, cfg.token, a.insecure_no_token)  # before the (slow) pool start
    except ValueError as e:
        print(f"sandbox.server: {e}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with SandboxPool(workers=a.workers, max_sessions=a.max_sessions) as pool:
        srv = SandboxServer(pool, a.host, a.port, config=cfg, insecure_no_token=a.insecure_no_token,
                            verbose=a.verbose).serve_in_thread()
        auth = "bearer token required" if cfg.token else "no token"
        print(f"sandbox server on {srv.url} with {pool.n} workers ({auth})", flush=True)
        while not stop.wait(0.5):
            if not srv.alive:
                print("sandbox.server: the HTTP server stopped unexpectedly", file=sys.stderr)
                return 1
        srv.stop()
        pool.close(cancel_pending=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
