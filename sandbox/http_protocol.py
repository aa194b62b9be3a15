"""uvicorn's httptools HTTP/1.1 protocol with the connection-level guards the sandbox server needs.

uvicorn alone closes a keep-alive connection idle after a response, but not a connection that
never sends a byte, nor one that sends part of a request line or headers and stalls (each holds a
socket for ever), and its protocol errors are plain text. `GuardedHttpProtocol` adds:

- idle timeout from the moment a connection opens (not only between requests);
- request-head timeout: the request line and headers must arrive within `request_timeout_s` of
  their first byte, else 408 (JSON) and close; the body's deadline is the ASGI guard's
  (sandbox/server.py), which can still answer with a status;
- header size cap (`max_header_bytes`, 431);
- connection cap (`max_connections`): a connection over it first makes room by closing the
  oldest open connection that has not authenticated (no complete request head carrying the
  token, or, without a token, no complete request head at all); only when every open connection
  has, it gets 503 with Retry-After and is closed. So clients that connect and stall (each could
  otherwise hold its socket for `request_timeout_s`) cannot lock authenticated clients out;
- JSON bodies for every error uvicorn answers itself (malformed request line, header or
  Content-Length: 400).

It relies on uvicorn's parser callbacks (`on_message_begin`, `on_url`, `on_header`,
`on_headers_complete`, `send_400_response`, `timeout_keep_alive_task`), pinned by the version
bound in setup.cfg and exercised by tests/sandbox/test_sandbox_http_limits.py. Not covered: HTTP/2,
WebSockets (no upgrade is served), TLS.
"""

from __future__ import annotations

import hmac
import itertools
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


@dataclass(frozen=True)
class ConnectionLimits:
    request_timeout_s: float
    max_header_bytes: int
    max_connections: int
    token: bytes | None = None  # the bearer token a request head must carry to authenticate


def bearer_ok(authorization: bytes, token: bytes | None) -> bool:
    """True when an Authorization header value carries `token` as a bearer token (always, without
    a token)."""
    if token is None:
        return True
    scheme, _, given = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)


class _HeadTooLarge(Exception):
    pass


def raw_json_response(status: int, message: str, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A complete `Connection: close` HTTP/1.1 response with a JSON error body."""
    body = json.dumps({"status": "SandboxError", "message": message}).encode()
    head = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Error")),
            b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
    head += [k + b": " + v for k, v in extra_headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def guarded_protocol(limits: ConnectionLimits, counters: dict[str, int]) -> type[HttpToolsProtocol]:
    """A protocol class bound to `limits`; `counters` (a dict) gets header_timeouts,
    oversized_heads, refused_connections, evicted_unauthenticated, malformed_requests
    incremented."""

    opened = itertools.count()

    class GuardedHttpProtocol(HttpToolsProtocol):
        _head_timer = None
        _head_bytes = 0
        _reject: tuple[int, str] | None = None
        _authed = False
        _auth_header = b""
        _opened = 0  # the order connections opened in (uvloop's clock is too coarse for it)

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._opened = next(opened)
            if len(self.connections) > limits.max_connections and not self._evict_one():
                counters["refused_connections"] = counters.get("refused_connections", 0) + 1
                transport.write(raw_json_response(
                    503, f"too many open connections (over {limits.max_connections}); retry later",
                    ((b"retry-after", b"1"),)))
                transport.close()
                return
            # idle until the first byte: the keep-alive timer (cancelled by data_received)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def _evict_one(self) -> bool:
            """Closes the oldest other connection that has not authenticated; False if none."""
            victim = None
            for c in self.connections:
                if c is not self and not getattr(c, "_authed", True) and \
                        not c.transport.is_closing() and (victim is None or c._opened < victim._opened):
                    victim = c
            if victim is None:
                return False
            counters["evicted_unauthenticated"] = counters.get("evicted_unauthenticated", 0) + 1
            victim._cancel_head_timer()
            victim.transport.write(raw_json_response(
                503, "connection closed to make room: it had not sent an authenticated request "
                "while the server was at its connection cap", ((b"retry-after", b"1"),)))
            victim.transport.close()
            self.connections.discard(victim)  # (connection_lost discards it again, harmlessly)
            return True

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # an earlier (pipelined) request is still being served: its head can wait
                self._head_timer = self.loop.call_later(limits.request_timeout_s, self._head_timeout)
                return
            counters["header_timeouts"] = counters.get("header_timeouts", 0) + 1
            self.transport.write(raw_json_response(
                408, f"request line and headers not received within {limits.request_timeout_s:g}s"))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.request_timeout_s, self._head_timeout)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > limits.max_header_bytes:
                self._reject = (431, f"request line and headers over {limits.max_header_bytes} bytes")
                raise _HeadTooLarge()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            if name.lower() == b"authorization":
                self._auth_header = value
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            if not self._authed and bearer_ok(self._auth_header, limits.token):
                self._authed = True
            self._auth_header = b""
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            self._cancel_head_timer()
            if self._reject is not None:
                status, message = self._reject
                counters["oversized_heads"] = counters.get("oversized_heads", 0) + 1
            else:
                status = 400
                message = ("malformed HTTP request (request line, a header, Content-Length or "
                           "chunked encoding could not be parsed)")
                counters["malformed_requests"] = counters.get("malformed_requests", 0) + 1
            if not self.transport.is_closing():
                self.transport.write(raw_json_response(status, message))
                self.transport.close()

    return GuardedHttpProtocol
