"""HTTP service over a SandboxPool (stdlib only): `python -m sandbox.server --port 8080`.

Endpoints
  POST /run_code      SandboxFusion-compatible. Request:
                        {"code": str, "language": "python"|"bash", "run_timeout": s (10),
                         "memory_limit_MB": int (-1 = default 512), "stdin": str,
                         "files": {path: base64}, "fetch_files": [path],
                         "compile_timeout": ignored,
                         extensions: "output_limit_bytes": int, "max_procs": int}
                      Response:
                        {"status": "Success"|"Failed"|"SandboxError", "message": str,
                         "compile_result": null,
                         "run_result": {"status": "Finished"|"Error"|"TimeLimitExceeded",
                                        "execution_time": s, "return_code": int|null,
                                        "stdout": str, "stderr": str},
                         "files": {path: base64},
                         extensions: "sandbox_status": one of sandbox.STATUSES,
                                     "memory_peak_mb", "stdout_truncated", "stderr_truncated"}
                      Success = the program exited 0; Failed = it ran but failed (non-zero exit,
                      time limit, memory, output limit); SandboxError = the sandbox failed.
  POST /run_sequence  {"steps": [native run requests]} -> {"results": [native results]}: steps
                      share one working directory (terminal tasks).
  POST /run           one native request ({"code", "language", "stdin", "files" (base64),
                      "timeout_s", "memory_mb", "output_limit_bytes", "collect", "max_procs"})
                      -> ExecutionResult.to_dict() (files base64)
  GET  /health        {"status": "ok", "workers": N}
  GET  /stats         pool.stats()
Bad requests get HTTP 400 with {"status": "SandboxError", "message": ...}.
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .pool import SandboxPool
from .result import ExecutionResult, InvalidRequest

MAX_BODY = 64 << 20
LANG_ALIASES = {"python": "python", "python3": "python", "py": "python", "bash": "bash", "sh": "bash"}


def _b64_files(files: dict | None) -> dict[str, bytes]:
    out = {}
    for k, v in (files or {}).items():
        if not isinstance(v, str):
            raise InvalidRequest(f"files[{k!r}] must be base64 text")
        try:
            out[k] = base64.b64decode(v, validate=True)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"files[{k!r}] is not valid base64: {e}") from e
    return out


def sf_request_to_kwargs(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """SandboxFusion /run_code request -> (code, run kwargs)."""
    if not isinstance(body.get("code"), str):
        raise InvalidRequest("'code' (string) is required")
    lang = LANG_ALIASES.get(str(body.get("language", "python")).lower())
    if lang is None:
        raise InvalidRequest(f"unsupported language {body.get('language')!r} (python, bash)")
    kw: dict[str, Any] = {"language": lang}
    rt = body.get("run_timeout")
    kw["timeout_s"] = float(rt) if rt not in (None, "") else 10.0
    mem = body.get("memory_limit_MB")
    kw["memory_mb"] = int(mem) if mem not in (None, "", -1) and int(mem) > 0 else 512
    if body.get("stdin") is not None:
        kw["stdin"] = body["stdin"]
    if body.get("files"):
        kw["files"] = _b64_files(body["files"])
    if body.get("fetch_files"):
        kw["collect"] = list(body["fetch_files"])
    for ext in ("output_limit_bytes", "max_procs", "collect_limit_bytes"):
        if body.get(ext) is not None:
            kw[ext] = int(body[ext])
    return body["code"], kw


def result_to_sf(r: ExecutionResult) -> dict[str, Any]:
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
        "executor_pod_name": socket.gethostname(),
        "files": {k: base64.b64encode(v).decode() for k, v in r.files.items()},
        "sandbox_status": r.status,
        "memory_peak_mb": r.memory_peak_mb,
        "stdout_truncated": r.stdout_truncated,
        "stderr_truncated": r.stderr_truncated,
    }


def native_request_to_kwargs(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if not isinstance(body.get("code"), str):
        raise InvalidRequest("'code' (string) is required")
    kw = {k: body[k] for k in ("language", "stdin", "timeout_s", "memory_mb", "output_limit_bytes",
                               "collect", "collect_limit_bytes", "max_procs") if body.get(k) is not None}
    if body.get("files"):
        kw["files"] = _b64_files(body["files"])
    return body["code"], kw


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
    server_version = "kimi-sandbox/1.0"

    def log_message(self, fmt, *args):  # quiet by default
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _send(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise InvalidRequest(f"request body over {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise InvalidRequest(f"invalid JSON: {e}") from e
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        return body

    def do_GET(self):  # noqa: N802
        pool: SandboxPool = self.server.pool
        if self.path in ("/health", "/v1/ping", "/"):
            self._send(200, {"status": "ok", "workers": pool.n})
        elif self.path == "/stats":
            self._send(200, pool.stats())
        else:
            self._send(404, {"status": "SandboxError", "message": f"no route {self.path}"})

    def do_POST(self):  # noqa: N802
        pool: SandboxPool = self.server.pool
        try:
            body = self._body()
            if self.path == "/run_code":
                code, kw = sf_request_to_kwargs(body)
                self._send(200, result_to_sf(pool.run(code, **kw)))
            elif self.path == "/run":
                code, kw = native_request_to_kwargs(body)
                self._send(200, pool.run(code, **kw).to_dict())
            elif self.path == "/run_sequence":
                steps = body.get("steps")
                if not isinstance(steps, list) or not steps:
                    raise InvalidRequest("'steps' must be a non-empty list")
                parsed = []
                for s in steps:
                    code, kw = native_request_to_kwargs(s)
                    parsed.append({"code": code, **kw})
                self._send(200, {"results": [r.to_dict() for r in pool.run_sequence(parsed)]})
            else:
                self._send(404, {"status": "SandboxError", "message": f"no route {self.path}"})
        except (InvalidRequest, ValueError, TypeError) as e:
            self._send(400, {"status": "SandboxError", "message": str(e)})
        except RuntimeError as e:  # pool closed
            self._send(503, {"status": "SandboxError", "message": str(e)})


class SandboxServer(ThreadingHTTPServer):
    """ThreadingHTTPServer bound to a pool; `serve_in_thread()` for tests and embedding."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, pool: SandboxPool, host: str = "127.0.0.1", port: int = 0,
                 verbose: bool = False) -> None:
        self.pool = pool
        self.verbose = verbose
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_in_thread(self) -> SandboxServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="sandbox-http")
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Sandbox HTTP server (SandboxFusion-compatible /run_code)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=None, help="sandbox slots (default: CPU count)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    def _term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    with SandboxPool(workers=args.workers) as pool:
        srv = SandboxServer(pool, args.host, args.port, verbose=args.verbose)
        print(f"sandbox server on {srv.url} with {pool.n} workers", flush=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
