"""HTTP server (SandboxFusion-compatible /run_code) and the client with retries.

Formats, endpoints, the client over HTTP and the command line. Limits, abuse and load (429s,
timeouts, caps, malformed bodies, disconnects, auth) are in test_sandbox_http_limits.py.
"""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sandbox import SandboxClient, SandboxPool, Task, connect
from sandbox.server import SandboxServer
from sandbox.verifiers import Verifier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server(pool):
    srv = SandboxServer(pool).serve_in_thread()
    yield srv
    srv.stop()


def post(url, body, expect=200, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == expect
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        assert e.code == expect, e.read()
        return json.loads(e.read())


def test_run_code_sandboxfusion_format(server):
    out = post(server.url + "/run_code", {
        "code": "import sys\nprint(open('in.txt').read() + sys.stdin.read())\nopen('out.bin', 'wb').write(b'\\x00ok')",
        "language": "python", "run_timeout": 5, "memory_limit_MB": 256, "compile_timeout": 10,
        "stdin": " world", "files": {"in.txt": base64.b64encode(b"hello").decode()},
        "fetch_files": ["out.bin"]})
    assert out["status"] == "Success" and out["compile_result"] is None
    rr = out["run_result"]
    assert rr["status"] == "Finished" and rr["return_code"] == 0 and rr["stdout"] == "hello world\n"
    assert rr["execution_time"] > 0
    assert base64.b64decode(out["files"]["out.bin"]) == b"\x00ok"
    assert out["sandbox_status"] == "ok"
    out = post(server.url + "/run_code", {"code": "exit 3", "language": "bash"})
    assert out["status"] == "Failed" and out["run_result"]["return_code"] == 3
    out = post(server.url + "/run_code", {"code": "sleep 10", "language": "bash", "run_timeout": 1})
    assert out["status"] == "Failed" and out["run_result"]["status"] == "TimeLimitExceeded"
    out = post(server.url + "/run_code", {"code": "x = bytearray(300 << 20)", "memory_limit_MB": 64})
    assert out["status"] == "Failed" and out["sandbox_status"] == "memory"


def test_bad_requests(server):
    # schema errors are 422 with SandboxFusion's (FastAPI's) "detail" list
    out = post(server.url + "/run_code", {"code": "1", "language": "cobol"}, expect=422)
    assert out["status"] == "SandboxError" and out["detail"][0]["loc"] == ["body", "language"]
    assert "absolute" in post(server.url + "/run_code", {"code": "1", "files": {"/etc/x": "eA=="}}, expect=422)["message"]
    out = post(server.url + "/run_code", {"language": "python"}, expect=422)
    assert out["detail"][0]["loc"] == ["body", "code"] and out["detail"][0]["type"] == "missing"
    out = post(server.url + "/run_code", {"code": "1", "run_timout": 5}, expect=422)  # a typo is not ignored
    assert "run_timout" in out["message"]
    assert post(server.url + "/run_code", {"code": "1", "run_timeout": -1}, expect=422)["detail"][0]["loc"] == ["body", "run_timeout"]
    assert "base64" in post(server.url + "/run", {"code": "1", "files": {"a": "%%%"}}, expect=422)["message"]
    assert post(server.url + "/run_sequence", {"steps": []}, expect=422)["status"] == "SandboxError"
    assert post(server.url + "/nope", {}, expect=404)["status"] == "SandboxError"
    with urllib.request.urlopen(server.url + "/health") as r:
        h = json.loads(r.read())
        assert (h["status"], h["workers"], h["up"], h["down"]) == ("ok", 2, 2, [])
    with urllib.request.urlopen(server.url + "/v1/ping") as r:
        assert json.loads(r.read()) == "pong"
    with urllib.request.urlopen(server.url + "/stats") as r:
        s = json.loads(r.read())
        assert "runs_per_s" in s and s["server"]["http_422"] >= 7 and s["server"]["admitted"] == 0
    out = post(server.url + "/run_code", {"code": "print(1)"})  # and it still runs code
    assert out["run_result"]["stdout"] == "1\n"


def test_files_null_and_output_truncation(server):
    # SandboxFusion clients send {path: null} for "no content": skipped, not a 400
    out = post(server.url + "/run_code", {
        "code": "import os; print(sorted(os.listdir('.')))",
        "files": {"skipped.txt": None, "kept.txt": base64.b64encode(b"k").decode()}})
    assert out["status"] == "Success" and out["run_result"]["stdout"] == "['kept.txt']\n"
    # output over the limit comes back as its first bytes, flagged
    out = post(server.url + "/run_code", {"code": "print('x' * 5000)", "output_limit_bytes": 100})
    assert out["run_result"]["stdout"] == "x" * 100 and out["stdout_truncated"] is True
    assert out["sandbox_status"] == "output_limit" and out["status"] == "Failed"


def test_native_endpoints(server):
    out = post(server.url + "/run", {"code": "print(2)", "timeout_s": 5})
    assert out["status"] == "ok" and out["stdout"] == "2\n"
    out = post(server.url + "/run", {"code": "print(open('f').read())", "files": {"f": "aGk=", "g": None}})
    assert out["stdout"] == "hi\n"
    out = post(server.url + "/run_sequence", {"steps": [
        {"code": "echo x > f", "language": "bash"}, {"code": "cat f", "language": "bash"}]})
    assert [r["stdout"] for r in out["results"]] == ["", "x\n"]


def test_client_round_trip_and_verifier(server):
    with SandboxClient(server.url, max_concurrency=4) as c:
        rs = c.map([f"print({i} * {i})" for i in range(10)])
        assert [r.stdout for r in rs] == [f"{i * i}\n" for i in range(10)]
        r = c.run("import sys; sys.stdout.write(sys.stdin.read())", stdin="écho\n", collect=["x"])
        assert r.ok and r.stdout == "écho\n"
        r = c.run("while True: pass", timeout_s=1)
        assert r.status == "timeout"
        # the same verifier code works over HTTP
        v = Verifier(c)
        t = Task(id="t", family="terminal", files={"a": "1"}, check="test \"$(cat a)\" = 2")
        assert v.verify(t, "echo 2 > a")[0] == 1.0
        s = c.stats()
        assert s["requests"] >= 12 and s["failures"] == 0


class _Flaky(BaseHTTPRequestHandler):
    """A front that answers 503 (or drops the connection) before forwarding to the real server."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        srv = self.server
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with srv.lock:
            srv.count += 1
            n = srv.count
        if n in srv.fail_503:
            data = b'{"status": "SandboxError", "message": "busy"}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if n in srv.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        req = urllib.request.Request(srv.target + self.path, data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_client_retries_transient_failures(server):
    flaky = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    flaky.daemon_threads = True
    flaky.lock, flaky.count, flaky.target = threading.Lock(), 0, server.url
    flaky.fail_503, flaky.drop = {1, 2}, {3}
    t = threading.Thread(target=flaky.serve_forever, daemon=True)
    t.start()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there: connection refused
    try:
        url = f"http://127.0.0.1:{flaky.server_address[1]}"
        with SandboxClient(url, retries=4, backoff_s=0.01, max_concurrency=1) as c:
            r = c.run("print('through')")
            assert r.ok and r.stdout == "through\n"
            st = c.stats()  # two 503s retried, one dropped connection re-sent
            assert st["retries"] == 2 and st["reconnects"] == 1 and flaky.count == 4
        with SandboxClient([f"http://127.0.0.1:{dead_port}", server.url], retries=3, backoff_s=0.01) as c:
            rs = c.map(["print(1)"] * 6)
            assert all(r.ok for r in rs)
        with SandboxClient(f"http://127.0.0.1:{dead_port}", retries=2, backoff_s=0.01) as c:
            r = c.run("print(1)")
            assert r.status == "sandbox_error" and "remote sandbox failed" in r.message
            assert c.stats()["failures"] == 1
    finally:
        flaky.shutdown()
        flaky.server_close()


def test_connect_returns_one_interface(server):
    c = connect(server.url)
    assert isinstance(c, SandboxClient)
    c.close()
    with connect(workers=1) as local:
        assert isinstance(local, SandboxPool)
        assert local.run("print(1)").stdout == "1\n"


def test_server_command_line(secret_token):
    # beyond loopback without a token: refused before anything starts
    bad = subprocess.run([sys.executable, "-m", "sandbox.server", "--host", "0.0.0.0", "--port", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "KIMI_SANDBOX_TOKEN"})
    assert bad.returncode == 2 and "refusing to serve on '0.0.0.0'" in bad.stderr and "--token" in bad.stderr
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    # the token comes from the environment here (not visible in ps)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.server", "--port", str(port), "--workers", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "KIMI_SANDBOX_TOKEN": secret_token})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:  # open without a token
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        assert post(url + "/run_code", {"code": "print('cli')"}, expect=401)["status"] == "SandboxError"
        out = post(url + "/run_code", {"code": "print('cli')", "language": "python"},
                   headers={"Authorization": f"Bearer {secret_token}"})
        assert out["run_result"]["stdout"] == "cli\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    out = proc.stdout.read().decode()
    assert proc.returncode == 0, out
    assert "bearer token required" in out and secret_token not in out


def test_remote_checks_run_isolated(server):
    # A verifier on a remote fleet judges like a local pool: the check's `isolated` flag crosses
    # HTTP (native /run_sequence and SandboxFusion /run_code), so a package the completion writes
    # into /work cannot hijack the check's interpreter.
    from sandbox.tasks.sampling import make_split
    (task, demo), = make_split("terminal", "train", 1, seed=5, difficulty=1)
    hack = "mkdir encodings; printf 'import os\\nos._exit(0)\\n' > encodings/__init__.py"
    with SandboxClient(server.url, max_concurrency=2) as c:
        got = [s for s, _ in Verifier(c).verify_batch([task, task], [demo, hack])]
        assert got == [1.0, 0.0], got
    check = "import sys\nsys.exit(0)"
    files = {"encodings/__init__.py": base64.b64encode(b"raise SystemExit(3)").decode()}
    out = post(server.url + "/run_code", {"code": check, "files": files})
    assert out["run_result"]["return_code"] != 0  # plain run: /work is on the path
    out = post(server.url + "/run_code", {"code": check, "files": files, "isolated": True})
    assert out["status"] == "Success", out
