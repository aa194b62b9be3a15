"""One interface for local and remote sandboxes.

    ex = connect()                                   # local SandboxPool (CPU-count workers)
    ex = connect("http://10.0.0.5:8080")             # a remote sandbox server (or SandboxFusion)
    ex = connect(["http://a:8080", "http://b:8080"], max_concurrency=64)
    fut = ex.submit("print(1)", timeout_s=5)        # Future[ExecutionResult]
    results = ex.run_batch([{"code": c} for c in programs])   # in order

`SandboxClient` speaks the SandboxFusion-compatible `POST /run_code` (so it also works against a
SandboxFusion deployment; this project's server adds exact statuses as extension fields) and this
project's `POST /run_sequence` for multi-step jobs. Concurrency is bounded by a thread pool of
`max_concurrency`; requests rotate over the URLs. A server that is full answers 429 with
Retry-After: the client waits that long (plus up to 25% jitter, on that URL; another URL is tried
at once if one is not resting) and sends again, for up to `busy_timeout_s` in all, without using up
`retries`. Other transient failures (connection errors, timeouts, HTTP 500/502/503/504) are
retried `retries` times on the next URL with exponential backoff (or the server's Retry-After). A
request that still fails comes back as a `sandbox_error` result (never an exception, never lost).
With `token` (or env KIMI_SANDBOX_TOKEN) every request carries `Authorization: Bearer <token>`.

`client.session(files=..., limits=...)` opens a `sandbox.Session` on the server (POST /sessions):
the same interface as a local pool's session (submit/run/check/read_files/usage/close). Each
command carries a per-session sequence number, so a retried request (a connection reset after the
server got it) returns the command's result instead of running it twice; a create carries a
request id for the same reason. Session errors (closed, limit, busy, cap) come back as the same
`SessionError` subclasses, through the command's Future.
"""

from __future__ import annotations

import base64
import http.client
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .backend import Executor
from .result import ExecutionResult, normalize_request

RETRY_HTTP = {429, 500, 502, 503, 504}
TOKEN_ENV = "KIMI_SANDBOX_TOKEN"


class RemoteError(RuntimeError):
    def __init__(self, msg: str, transient: bool, status: int | None = None,
                 retry_after_s: float | None = None, body: Any = None) -> None:
        super().__init__(msg)
        self.transient = transient
        self.status = status
        self.retry_after_s = retry_after_s
        self.body = body  # the parsed JSON error body, when there is one


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (delay-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        secs = None
    if secs is None:
        try:
            from email.utils import parsedate_to_datetime

            secs = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    if secs != secs or secs == float("inf"):  # NaN, inf
        return None
    return max(0.0, secs)


def sf_response_to_result(resp: dict[str, Any]) -> ExecutionResult:
    """SandboxFusion /run_code response -> ExecutionResult (exact status if the server says it)."""
    rr = resp.get("run_result") or {}
    files = {k: base64.b64decode(v) for k, v in (resp.get("files") or {}).items()}
    status = resp.get("sandbox_status")
    code = rr.get("return_code")
    if status is None:
        if resp.get("status") == "SandboxError" or rr.get("status") == "Error" or not rr:
            status = "sandbox_error"
        elif rr.get("status") == "TimeLimitExceeded":
            status = "timeout"
        else:
            status = "ok" if code == 0 else "error"
    return ExecutionResult(
        status=status, exit_code=code, stdout=rr.get("stdout") or "", stderr=rr.get("stderr") or "",
        wall_s=float(rr.get("execution_time") or 0.0),
        signal=(code - 128) if isinstance(code, int) and 128 < code <= 192 else None,
        stdout_truncated=bool(resp.get("stdout_truncated")),
        stderr_truncated=bool(resp.get("stderr_truncated")),
        memory_peak_mb=resp.get("memory_peak_mb"), files=files, message=resp.get("message") or "")


def req_to_sf(req: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "code": req["code"], "language": req["language"], "run_timeout": req["timeout_s"],
        "memory_limit_MB": req["memory_mb"], "output_limit_bytes": req["output_limit_bytes"],
    }
    if req.get("stdin") is not None:
        body["stdin"] = req["stdin"].decode("utf-8", errors="surrogateescape")
    if req.get("files"):
        body["files"] = {k: base64.b64encode(v).decode() for k, v in req["files"].items()}
    if req.get("collect"):
        body["fetch_files"] = list(req["collect"])
        body["collect_limit_bytes"] = req["collect_limit_bytes"]
    if req.get("max_procs"):
        body["max_procs"] = req["max_procs"]
    if req.get("isolated"):
        body["isolated"] = True  # verifier checks: see sandbox.result.normalize_request
    return body


def req_to_native(req: dict[str, Any]) -> dict[str, Any]:
    body = {k: req[k] for k in ("code", "language", "timeout_s", "memory_mb", "output_limit_bytes",
                                "collect", "collect_limit_bytes", "max_procs") if req.get(k) is not None}
    if req.get("isolated"):
        body["isolated"] = True
    if req.get("stdin") is not None:
        body["stdin"] = req["stdin"].decode("utf-8", errors="surrogateescape")
    if req.get("files"):
        body["files"] = {k: base64.b64encode(v).decode() for k, v in req["files"].items()}
    return body


class SandboxClient(Executor):
    """Remote sandbox executor with the SandboxPool interface (sandbox/backend.py's `Executor`:
    submit, run, map, run_batch, submit_sequence, run_sequence, session; plus stats, close). The
    number of steps per sequence is the server's to limit (ServerConfig.max_steps).

    max_concurrency: requests in flight (one thread and one keep-alive connection each).
    retries / backoff_s: transient failures other than 429 (exponential backoff, or Retry-After).
    busy_timeout_s: how long in all a request keeps waiting through 429s (Retry-After honoured).
    timeout_pad_s: added to a run's timeout_s for the socket timeout (queueing, transfer).
    token: bearer token for servers started with one (default: env KIMI_SANDBOX_TOKEN).
    stats(): requests, retries, busy_retries, reconnects, failures, by_status, latency_ms.
    """

    def __init__(self, urls: str | Iterable[str], *, max_concurrency: int = 16, retries: int = 3,
                 backoff_s: float = 0.1, timeout_pad_s: float = 30.0, busy_timeout_s: float = 600.0,
                 token: str | None = None) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("SandboxClient needs at least one URL")
        self._parsed = [urllib.parse.urlsplit(u) for u in self.urls]
        for u in self._parsed:
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"bad sandbox URL {urllib.parse.urlunsplit(u)!r}")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_pad_s = timeout_pad_s
        self.busy_timeout_s = busy_timeout_s
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.max_concurrency = max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sandbox-client")
        self._rr = itertools.count(random.randrange(len(self.urls)))
        self._down_until = [0.0] * len(self.urls)  # a URL that refused a connection rests a while
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "busy_retries": 0, "reconnects": 0, "failures": 0,
                       "by_status": {}}
        self._lat: list[float] = []

    # ---- transport ---------------------------------------------------------------------------
    def _conn(self, i: int, timeout: float) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(i)
        if c is None:
            u = self._parsed[i]
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            c = cls(u.hostname, u.port, timeout=timeout)
            c.connect()
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns[i] = c
        c.timeout = timeout
        if c.sock is not None:
            c.sock.settimeout(timeout)
        return c

    def _drop(self, i: int) -> None:
        conns = getattr(self._local, "conns", {})
        c = conns.pop(i, None)
        if c is not None:
            c.close()

    def _post_once(self, i: int, path: str, body: dict, timeout: float) -> dict:
        base = self._parsed[i].path.rstrip("/")
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):  # one silent reconnect for a stale keep-alive connection
            try:
                c = self._conn(i, timeout)
                c.request("POST" if data is not None else "GET", base + path, body=data,
                          headers=self._headers)
                resp = c.getresponse()
                raw = resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._drop(i)
                if attempt == 0:
                    with self._lock:
                        self._stats["reconnects"] += 1
                    continue
                raise RemoteError(f"{self.urls[i]}: {e}", transient=True) from e
            except (OSError, http.client.HTTPException) as e:
                self._drop(i)
                raise RemoteError(f"{self.urls[i]}: {type(e).__name__}: {e}", transient=True) from e
            if resp.status != 200:
                if resp.getheader("Connection", "").lower() == "close":
                    self._drop(i)
                msg = raw[:300].decode(errors="replace")
                hint = " (set token= or env KIMI_SANDBOX_TOKEN)" if resp.status == 401 else ""
                try:
                    body = json.loads(raw) if len(raw) < 1 << 16 else None
                except ValueError:
                    body = None
                raise RemoteError(f"{self.urls[i]}{path}: HTTP {resp.status}: {msg}{hint}",
                                  transient=resp.status in RETRY_HTTP, status=resp.status,
                                  retry_after_s=parse_retry_after(resp.getheader("Retry-After")),
                                  body=body)
            try:
                return json.loads(raw)
            except ValueError as e:
                raise RemoteError(f"{self.urls[i]}: invalid JSON reply", transient=True) from e
        raise AssertionError("unreachable")

    def _pick(self) -> int:
        now = time.monotonic()
        n = len(self.urls)
        start = next(self._rr)
        for k in range(n):
            i = (start + k) % n
            if self._down_until[i] <= now:
                return i
        return start % n  # all resting: try anyway

    def _rest(self) -> float:
        """Seconds until the first URL stops resting (0 if one is available now)."""
        now = time.monotonic()
        return max(0.0, min(self._down_until) - now)

    def _get(self, path: str, timeout: float, url: int | None = None) -> dict:
        return self._post(path, None, timeout, url=url)

    def _post(self, path: str, body: dict | None, timeout: float, url: int | None = None) -> dict:
        """POST (GET when body is None) with the retry rules of the module docstring; `url`
        pins the request to one of self.urls (a session's server)."""
        attempt = 0  # transient failures other than 429
        busy_deadline = time.monotonic() + self.busy_timeout_s
        while True:
            i = self._pick() if url is None else url
            try:
                out = self._post_once(i, path, body, timeout)
                self._down_until[i] = 0.0
                return out
            except RemoteError as e:
                if isinstance(e.__cause__, ConnectionRefusedError):
                    self._down_until[i] = time.monotonic() + 2.0
                if not e.transient:
                    raise
                if e.status == 429:  # full: wait as told (jittered), not counted against retries
                    wait = (e.retry_after_s if e.retry_after_s is not None else 1.0) * (1 + 0.25 * random.random())
                    self._down_until[i] = max(self._down_until[i], time.monotonic() + wait)
                    wait = (self._rest() if url is None  # another URL may be free now
                            else max(0.0, self._down_until[i] - time.monotonic()))
                    if time.monotonic() + wait > busy_deadline:
                        raise RemoteError(f"{e} (still busy after {self.busy_timeout_s:g}s of 429s)",
                                          transient=False, status=429, body=e.body) from e
                    with self._lock:
                        self._stats["busy_retries"] += 1
                    time.sleep(wait)
                    continue
                if attempt >= self.retries:
                    raise
                wait = self.backoff_s * (2 ** attempt) * (0.5 + random.random())
                if e.retry_after_s is not None:
                    wait = max(wait, min(e.retry_after_s, 60.0))
                attempt += 1
                with self._lock:
                    self._stats["retries"] += 1
                time.sleep(wait)

    def _record(self, results: list[ExecutionResult], t0: float) -> None:
        with self._lock:
            self._stats["requests"] += 1
            for r in results:
                self._stats["by_status"][r.status] = self._stats["by_status"].get(r.status, 0) + 1
            self._lat.append(time.monotonic() - t0)
            if len(self._lat) > 20000:
                del self._lat[:10000]

    # ---- executor interface ------------------------------------------------------------------
    def _do_run(self, req: dict) -> ExecutionResult:
        t0 = time.monotonic()
        try:
            resp = self._post("/run_code", req_to_sf(req), req["timeout_s"] + self.timeout_pad_s)
            r = sf_response_to_result(resp)
        except RemoteError as e:
            with self._lock:
                self._stats["failures"] += 1
            r = ExecutionResult.sandbox_error(f"remote sandbox failed: {e}")
        self._record([r], t0)
        return r

    def _do_seq(self, reqs: list[dict]) -> list[ExecutionResult]:
        t0 = time.monotonic()
        try:
            resp = self._post("/run_sequence", {"steps": [req_to_native(r) for r in reqs]},
                              sum(r["timeout_s"] for r in reqs) + self.timeout_pad_s)
            rs = [ExecutionResult.from_dict(d) for d in resp["results"]]
        except (RemoteError, KeyError, TypeError) as e:
            with self._lock:
                self._stats["failures"] += 1
            rs = [ExecutionResult.sandbox_error(f"remote sandbox failed: {e}") for _ in reqs]
        self._record(rs, t0)
        return rs

    def _submit_request(self, req: dict) -> Future:
        return self._pool.submit(self._do_run, req)

    def _submit_steps(self, reqs: list[dict]) -> Future:
        return self._pool.submit(self._do_seq, reqs)

    # ---- sessions ----------------------------------------------------------------------------
    def open_session(self, *, files: dict | None = None, limits=None, workspace=None):
        """The backend of a `Session` on the server; use `session()`."""
        return RemoteSession(self, files, limits, workspace)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            lat = sorted(self._lat)
            s = json.loads(json.dumps(self._stats))

        def pct(q):
            return round(lat[min(len(lat) - 1, int(q / 100 * (len(lat) - 1)))] * 1000, 2) if lat else None

        s["latency_ms"] = {"p50": pct(50), "p90": pct(90), "p99": pct(99)}
        s["urls"] = list(self.urls)
        s["max_concurrency"] = self.max_concurrency
        return s

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _session_error(e: RemoteError, sid: str | None):
    """A RemoteError that carries a session error -> that SessionError (else None)."""
    from .session import ERRORS, SessionClosed

    kind = e.body.get("session_error") if isinstance(e.body, dict) else None
    if kind is None:
        return None
    if kind == "unknown":
        return SessionClosed(f"the server has no session {sid}: {e.body.get('message')}")
    return ERRORS.get(kind, ERRORS["session"])(e.body.get("message") or str(e))


class RemoteSession:
    """The backend of a `Session` over HTTP. A session lives on one server: every request of it
    goes to the URL that created it (a client with several URLs picks one per session)."""

    def __init__(self, client: SandboxClient, files: dict | None, limits, workspace=None) -> None:
        from .session import SessionLimits, Workspace

        self.c = client
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self.url = client._pick()
        req = normalize_request("", files=files or {})  # validates paths and contents
        body = {"files": {k: base64.b64encode(v).decode() for k, v in req["files"].items()},
                "limits": SessionLimits.coerce(limits).to_dict(),
                "request_id": "c-" + os.urandom(12).hex()}
        self.workspace = Workspace.coerce(workspace)
        if self.workspace is not None:
            body["workspace"] = self.workspace.to_dict()
        try:
            resp = self._post("/sessions", body, client.timeout_pad_s)
        except RemoteError as e:
            err = _session_error(e, None)
            if err is not None:
                raise err from e
            raise
        self.id = resp["session_id"]
        self.limits = SessionLimits(**resp["limits"])

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        return self.c._post(path, body, timeout, url=self.url)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, req: dict, budget: bool = True, background: bool = False) -> Future:
        with self._lock:
            self._seq += 1
            body = {**req_to_native(req), "budget": budget and not background, "seq": self._seq}
            if background:
                body["background"] = True
        return self.c._pool.submit(self._do_run, body, req["timeout_s"] + self.c.timeout_pad_s)

    def _do_run(self, body: dict, timeout: float) -> ExecutionResult:
        t0 = time.monotonic()
        try:
            r = ExecutionResult.from_dict(self._post(f"/sessions/{self.id}/run", body, timeout))
        except RemoteError as e:
            err = _session_error(e, self.id)
            if err is not None:
                raise err from e
            with self.c._lock:
                self.c._stats["failures"] += 1
            r = ExecutionResult.sandbox_error(f"remote sandbox failed: {e}")
        except (KeyError, TypeError) as e:
            r = ExecutionResult.sandbox_error(f"remote sandbox sent a malformed result: {e}")
        self.c._record([r], t0)
        return r

    def read_files(self, paths: list[str], limit_bytes: int = 1 << 20) -> dict[str, bytes]:
        try:
            resp = self._post(f"/sessions/{self.id}/files", {"paths": paths, "limit_bytes": limit_bytes},
                              self.c.timeout_pad_s)
        except RemoteError as e:
            err = _session_error(e, self.id)
            if err is not None:
                raise err from e
            raise
        return {k: base64.b64decode(v) for k, v in resp["files"].items()}

    def usage(self) -> dict[str, Any]:
        try:
            return self.c._get(f"/sessions/{self.id}", self.c.timeout_pad_s, url=self.url)
        except RemoteError as e:
            err = _session_error(e, self.id)
            if err is not None:
                raise err from e
            raise

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._post(f"/sessions/{self.id}/close", {}, self.c.timeout_pad_s)
        except RemoteError as e:
            if _session_error(e, self.id) is None:
                raise  # the server may still hold it: its idle timeout closes it


def connect(target: str | Iterable[str] | None = None, **kw: Any):
    """A local SandboxPool (target None or "local") or a SandboxClient for URL(s)."""
    if target is None or target == "local":
        from .pool import SandboxPool

        return SandboxPool(**kw)
    return SandboxClient(target, **kw)
