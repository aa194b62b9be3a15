"""The HTTP server under load and abuse: each abuse the server must withstand, as the
attack and the right answer, then a check that the server still runs code correctly.

Covered: connection bursts (no drops; 429 with Retry-After when the queue is full; the client
retries them), malformed requests (Content-Length -1, bad request lines, bad chunking, non-JSON,
non-UTF-8, lone surrogates: JSON 400/422, never a dropped connection), oversized bodies and heads
(413/431), idle and stalled connections (closed; 408), work whose client left (never runs), output
caps (a 600 MB request cannot make a 600 MB response), bearer-token auth and the loopback rule,
/health with slots down. Small numbers on purpose (a 200-connection burst, 200 requests at 50
clients); the 1,000-at-200 numbers are in the benchmark (python scripts/bench.py sandbox).
"""

import json
import os
import signal
import socket
import threading
import time

import pytest

from sandbox import SandboxClient, SandboxPool
from sandbox.client import parse_retry_after
from sandbox.server import SandboxServer, ServerConfig, check_bind

LIMITS = dict(max_queue=40, max_body_bytes=64 << 10, max_output_bytes=32 << 10, max_fetch_files=4,
              max_steps=4, request_timeout_s=1.0, idle_timeout_s=0.5, max_header_bytes=8 << 10)


@pytest.fixture(scope="module")
def server(pool):
    srv = SandboxServer(pool, **LIMITS).serve_in_thread()
    yield srv
    srv.stop()


def wait_for(pred, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached within the liveness timeout")
        time.sleep(0.01)


def read_response(s: socket.socket) -> tuple[int, dict, object]:
    """One complete HTTP response from s (fails if the connection ends before it is complete)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"connection closed without a complete response (got {buf!r})"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        assert chunk, "connection closed in the middle of a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, json.loads(body[:n]) if n else None


def raw(port: int, data: bytes, timeout: float = 20.0) -> tuple[int, dict, object]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_response(s)


def post_bytes(body: bytes, path: str = "/run_code", extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def assert_serving(srv, token=None):
    """The server still runs code and answers with the program's own output."""
    with SandboxClient(srv.url, max_concurrency=1, token=token) as c:
        r = c.run("import sys; print('alive', sys.argv[0])")
    assert r.status == "ok" and r.stdout == "alive /sandbox/main.py\n", r


def test_burst_is_answered_and_429s_are_retried(server):
    # 200 connections at once, no retry: every one gets an answer (the old server dropped 21-28%)
    replies: list = []
    go = threading.Event()

    def one(i):
        go.wait()
        replies.append(raw(server.port, post_bytes(json.dumps({"code": f"print({i})"}).encode())))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(200)]
    for t in ts:
        t.start()
    go.set()
    for t in ts:
        t.join()
    assert len(replies) == 200
    codes = [st for st, _, _ in replies]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 2
    for st, headers, body in replies:
        if st == 429:
            assert int(headers["retry-after"]) >= 1 and body["status"] == "SandboxError"
            assert "queue is full" in body["message"]
        else:
            assert body["status"] == "Success"
    # the project's client: 200 requests at 50 clients, each answered with its own output
    with SandboxClient(server.url, max_concurrency=50) as c:
        rs = c.run_batch([{"code": f"print({i})"} for i in range(200)])
        st = c.stats()
    assert [r.stdout for r in rs] == [f"{i}\n" for i in range(200)]
    assert st["failures"] == 0
    assert_serving(server)


def test_client_honours_retry_after(pool):
    # a queue of 0: both slots busy means 429; the client waits as told and gets its result
    srv = SandboxServer(pool, max_queue=0).serve_in_thread()
    try:
        with SandboxClient(srv.url, max_concurrency=3) as c:
            blockers = [c.submit("import time; time.sleep(1.2)") for _ in range(2)]
            wait_for(lambda: srv.state.admitted == 2)
            t0 = time.monotonic()
            r = c.run("print('after the wait')")
            waited = time.monotonic() - t0
            assert r.ok and r.stdout == "after the wait\n"
            assert all(f.result().ok for f in blockers)
            st = c.stats()
        assert st["busy_retries"] >= 1 and st["failures"] == 0 and st["retries"] == 0
        assert waited >= 1.0  # Retry-After is at least one second
        assert srv.state.counters["rejected_busy"] >= 1
    finally:
        srv.stop()
    assert [parse_retry_after(v) for v in ("2", " 0.5 ", "-3", "nan", "inf", "soon", None)] == \
        [2.0, 0.5, 0.0, None, None, None, None]
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past


@pytest.mark.parametrize("request_bytes, status, words", [
    (b"POST /run_code HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n", 400, "malformed"),
    (b"POST /run_code HTTP/1.1\r\nHost: t\r\nContent-Length: ten\r\n\r\n", 400, "malformed"),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed"),
    (b"POST /run_code HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "malformed"),
    (post_bytes(b"{not json"), 400, "not valid JSON"),
    (post_bytes(b""), 400, "empty request body"),
    (post_bytes(b'\xff\xfe{"code": 1}'), 400, "not valid JSON"),
    (post_bytes(b"[1, 2]"), 422, "valid dictionary"),
    (post_bytes(b'{"code": 5}'), 422, "code"),
    (post_bytes(b'{"code": "\\ud800print(1)"}'), 422, "lone surrogate"),
    (post_bytes(b'{"code": "1", "stdin": "\\udfff"}', "/run"), 422, "lone surrogate"),
    (post_bytes(b'{"steps": [{"code": "1", "language": "cobol"}]}', "/run_sequence"), 422, "steps.0.language"),
    (b"POST /run_code HTTP/1.1\r\nHost: t\r\nContent-Length: 10485760\r\n\r\n", 413, "--max-body-bytes"),
    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * (9 << 10) + b"\r\n\r\n", 431, "headers over"),
])
def test_malformed_requests_get_a_json_error(server, request_bytes, status, words):
    st, headers, body = raw(server.port, request_bytes)
    assert st == status, body
    assert headers["content-type"] == "application/json"
    assert body["status"] == "SandboxError" and words in body["message"], body


def test_chunked_body_over_the_cap_and_server_still_answers(server):
    chunk = b"x" * (16 << 10)
    data = (b"POST /run_code HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 5 + b"0\r\n\r\n")
    st, headers, body = raw(server.port, data)
    assert st == 413 and headers["connection"] == "close" and "max-body-bytes" in body["message"]
    assert_serving(server)


def test_idle_and_stalled_connections_are_closed(server):
    before = dict(server.state.counters)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(200)]
    try:
        assert_serving(server)  # 200 idle connections hold no worker (the old server: 200 threads)
        for s in idle:  # each is closed by the server after idle_timeout_s (0.5 s)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    # a request head that stalls (slowloris), and a body that stalls: 408 within request_timeout_s
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: t\r\nContent-Len")
        t0 = time.monotonic()
        st, _, body = read_response(s)
        assert st == 408 and "headers not received" in body["message"]
        assert time.monotonic() - t0 < 10 and s.recv(1) == b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"code\":")
        st, headers, body = read_response(s)
        assert st == 408 and "body not received" in body["message"] and headers["connection"] == "close"
    c = server.state.counters
    assert c["header_timeouts"] - before.get("header_timeouts", 0) == 1
    assert c["body_timeouts"] - before.get("body_timeouts", 0) == 1
    assert_serving(server)


def test_work_whose_client_left_never_runs(server, pool):
    k = 10
    before = pool.stats()["completed"]
    cancelled0 = server.state.counters.get("cancelled_client_gone", 0)
    with SandboxClient(server.url, max_concurrency=2) as c:
        blockers = [c.submit("import time; time.sleep(1.5)") for _ in range(2)]
        wait_for(lambda: server.state.admitted == 2 and pool.stats()["in_flight"] == 2)
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(k)]
        for s in socks:
            s.sendall(post_bytes(b'{"code": "print(\'abandoned\')"}'))
        wait_for(lambda: server.state.admitted == 2 + k)  # all k queued behind the blockers
        for s in socks:
            s.close()  # the clients leave
        wait_for(lambda: server.state.admitted == 2)
        assert all(f.result().ok for f in blockers)
    wait_for(lambda: pool.stats()["in_flight"] == 0)
    assert pool.stats()["completed"] - before == 2  # the two blockers, none of the k abandoned runs
    assert server.state.counters["cancelled_client_gone"] - cancelled0 == k
    assert_serving(server)


def test_output_is_capped_by_the_server(server):
    cap = LIMITS["max_output_bytes"]
    big = "import sys; sys.stdout.write('y' * (1 << 20)); sys.stderr.write('z' * (1 << 20))"
    body = json.dumps({"code": big, "output_limit_bytes": 600 << 20}).encode()  # asks for 600 MB
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(post_bytes(body))
        st, headers, out = read_response(s)
    assert st == 200 and int(headers["content-length"]) < 3 * cap
    assert out["sandbox_status"] == "output_limit" and out["stdout_truncated"] is True
    assert out["run_result"]["stdout"] == "y" * cap
    assert f"caps output at {cap} bytes" in out["message"]
    with SandboxClient(server.url, max_concurrency=1) as c:  # sends its default 1 MiB limit
        r = c.run(big)
        assert r.status == "output_limit" and len(r.stdout) == cap
        r = c.run("print(1)", collect=[f"f{i}" for i in range(5)])  # more files than the server returns
        assert r.status == "sandbox_error" and "422" in r.message and "--max-fetch-files" in r.message
        rs = c.run_sequence([{"code": "true", "language": "bash"}] * 5)
        assert all(r.status == "sandbox_error" and "--max-steps" in r.message for r in rs)
    assert_serving(server)


def test_bearer_token_and_loopback_rule(pool, secret_token, monkeypatch):
    monkeypatch.delenv("KIMI_SANDBOX_TOKEN", raising=False)
    srv = SandboxServer(pool, token=secret_token).serve_in_thread()
    try:
        run = post_bytes(b'{"code": "print(1)"}')
        for auth in (b"", b"Authorization: Bearer wrong-token-of-some-length\r\n",
                     b"Authorization: Basic " + secret_token.encode() + b"\r\n",
                     b"Authorization: Bearer " + secret_token.encode()[:-1] + b"\r\n"):
            st, headers, body = raw(srv.port, run.replace(b"Host: t\r\n", b"Host: t\r\n" + auth))
            assert st == 401 and headers["www-authenticate"] == "Bearer" and "bearer token" in body["message"]
        st, _, body = raw(srv.port, run.replace(b"Host: t\r\n", b"Host: t\r\nAuthorization: Bearer "
                                                + secret_token.encode() + b"\r\n"))
        assert st == 200 and body["run_result"]["stdout"] == "1\n"
        assert raw(srv.port, b"GET /stats HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 401
        assert raw(srv.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")[0] == 200  # probes need no token
        with SandboxClient(srv.url, max_concurrency=1) as c:  # no token configured
            r = c.run("print(1)")
            assert r.status == "sandbox_error" and "401" in r.message and "KIMI_SANDBOX_TOKEN" in r.message
            assert c.stats()["retries"] == 0  # not transient: no retry
        monkeypatch.setenv("KIMI_SANDBOX_TOKEN", secret_token)  # the client reads it from the env too
        assert_serving(srv)
        monkeypatch.delenv("KIMI_SANDBOX_TOKEN")
        assert_serving(srv, token=secret_token)
    finally:
        srv.stop()
    for host in ("127.0.0.1", "::1", "localhost", "127.5.5.5"):
        check_bind(host, None, False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "sandbox.example.org"):
        with pytest.raises(ValueError, match="refusing to serve"):
            check_bind(host, None, False)
        check_bind(host, secret_token, False)
        check_bind(host, None, True)  # explicitly insecure
    with pytest.raises(ValueError, match="refusing to serve"):
        SandboxServer(pool, host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16 characters"):
        ServerConfig(token="short")


def test_health_reports_slots_that_are_down():
    with SandboxPool(workers=2) as p:
        srv = SandboxServer(p).serve_in_thread()
        try:
            os.kill(p.worker_pids()[1], signal.SIGKILL)
            wait_for(lambda: p.health()["down"] == [1])
            st, _, body = raw(srv.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert st == 200 and body["status"] == "degraded" and body["up"] == 1 and body["down"] == [1]
            p.close()
            st, headers, body = raw(srv.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert st == 503 and body["status"] == "down" and body["down"] == [0, 1] and "retry-after" in headers
            st, _, body = raw(srv.port, post_bytes(b'{"code": "print(1)"}'))
            assert st == 503 and "pool unavailable" in body["message"]
        finally:
            srv.stop()


def test_unauthenticated_connections_cannot_lock_out_authenticated_ones(pool, secret_token):
    """With a token, connections that never send an authenticated request head are the ones
    closed at the connection cap: a client with the token is served while the cap is full of
    stalled unauthenticated connections (each would otherwise hold its socket for the request
    timeout), and a stalled one learns why (503 JSON)."""
    srv = SandboxServer(pool, token=secret_token, max_connections=6, request_timeout_s=20.0,
                        idle_timeout_s=20.0).serve_in_thread()
    stalled = []
    try:
        for _ in range(6):  # the cap, all half a request line, one of them a wrong token
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
            s.sendall(b"POST /run_code HTT")
            stalled.append(s)
        wrong = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        wrong.sendall(post_bytes(b'{"code": "print(1)"}', extra=b"Authorization: Bearer nope\r\n"))
        assert read_response(wrong)[0] == 401
        wait_for(lambda: srv.state.counters.get("evicted_unauthenticated", 0) >= 1)
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
        s.sendall(b"GET /stats HTTP/1.1\r\nHost: t\r\n")  # the cap is full again
        stalled.append(s)
        with SandboxClient(srv.url, max_concurrency=1, token=secret_token, retries=0) as c:
            for _ in range(3):
                r = c.run("print('served')")
                assert r.status == "ok" and r.stdout == "served\n", r
        assert srv.state.counters.get("refused_connections", 0) == 0, srv.state.counters
        assert srv.state.counters["evicted_unauthenticated"] >= 2, srv.state.counters
        status, _, body = read_response(stalled[0])  # the oldest stalled one made room first
        assert status == 503 and "authenticated" in body["message"], body
    finally:
        for s in stalled:
            s.close()
        srv.stop()


def test_deeply_nested_json_body_is_a_400(server):
    body = b'{"code": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # under the test server's body cap
    status, _, resp = raw(server.port, post_bytes(body))
    assert status == 400 and "nested too deeply" in resp["message"], resp
    assert_serving(server)
