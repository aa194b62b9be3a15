"""HTTP part of the sandbox benchmark (`python scripts/bench.py sandbox`; called by benchmarks/sandbox_pool.py).

The server runs as its own process (`python -m sandbox.server --workers W`), as it would in
production, so its event loop does not share a GIL with the benchmark's client threads. Measured
side by side in one run, for a trivial program (`pass`):

  pool16     the pool directly, 16 submitting threads (closed loop): the queueing floor
  http16     the same through the server and SandboxClient, 16 concurrent clients: p50/p99
  raw_burst  C connections at once, one POST each, no client retry: answered vs dropped
  burst      N requests at C concurrent clients through SandboxClient (1,000 at 200; quick: 200
             at 50): lost (not answered with a real result), 429s retried, wall
  abandoned  K requests whose clients close their connection while the work is queued behind two
             busy slots: how many of them executed (the server's pool counter, /stats)
  retry_storm  80 requests of a 0.2 s program at 16 clients whose socket timeout is shorter than
             the queue wait (they give up and resend): executions vs requests

With 2 workers and 16 clients, Little's law bounds the latency from below: 16 / runs_per_s, so
`pool16` is the floor the HTTP numbers are read against. Not covered: TLS, several servers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from benchmarks.loadgen import closed_loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(workers: int, cwd: str = ROOT, extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m sandbox.server` on a free loopback port; returns (process, url) once /health answers."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.server", "--port", str(port),
                             "--workers", str(workers), *extra_args],
                            cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            get_json(url + "/health", timeout=5)
            return proc, url
        except OSError as e:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode()[-2000:]
                raise RuntimeError(f"sandbox server did not start: {err}") from e
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pool_counters(url: str) -> dict:
    s = get_json(url + "/stats")
    return s.get("pool", s)  # this server nests the pool's counters; the old one did not


def burst(url: str, n: int, clients: int) -> dict:
    """n requests through one SandboxClient with `clients` concurrent connections."""
    from sandbox.client import SandboxClient

    t0 = time.perf_counter()
    with SandboxClient(url, max_concurrency=clients) as c:
        rs = c.run_batch([{"code": f"print({i})"} for i in range(n)])
        st = c.stats()
    wall = time.perf_counter() - t0
    wrong = sum(1 for i, r in enumerate(rs) if r.status != "ok" or r.stdout != f"{i}\n")
    return {"requests": n, "clients": clients, "wall_s": round(wall, 2),
            "lost": wrong, "answered_ok": n - wrong,
            "retries": st.get("retries"), "busy_retries": st.get("busy_retries"),
            "reconnects": st.get("reconnects"), "client_failures": st.get("failures")}


def raw_burst(url: str, clients: int) -> dict:
    """`clients` connections opened at once, one POST each, no retry: how many got any HTTP answer
    (a result or a 429) and how many saw a dropped or refused connection."""
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"code": "pass"}).encode()
    req = (b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    codes: dict[str, int] = {}
    lock = threading.Lock()
    go = threading.Event()

    def one():
        go.wait()
        try:
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(req)
                data = b""
                while b"\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            key = data.split(b" ")[1].decode() if data.startswith(b"HTTP/") else "dropped"
        except OSError as e:
            key = f"dropped ({type(e).__name__})"
        with lock:
            codes[key] = codes.get(key, 0) + 1

    ts = [threading.Thread(target=one) for _ in range(clients)]
    for t in ts:
        t.start()
    go.set()
    for t in ts:
        t.join()
    dropped = sum(v for k, v in codes.items() if k.startswith("dropped"))
    return {"clients": clients, "answered": clients - dropped, "dropped": dropped, "by_reply": codes}


def abandoned(url: str, k: int) -> dict:
    """Two slow runs occupy both slots; k more requests are sent and their sockets closed while
    queued. Returns how many of the k executed (pool completions minus the two blockers)."""
    from sandbox.client import SandboxClient

    before = _pool_counters(url)["completed"]
    with SandboxClient(url, max_concurrency=2) as c:
        blockers = [c.submit("import time; time.sleep(1.5)", timeout_s=10) for _ in range(2)]
        time.sleep(0.3)
        body = json.dumps({"code": "print('abandoned')"}).encode()
        host, port = url.split("//")[1].split(":")
        socks = []
        for _ in range(k):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        time.sleep(0.3)
        for s in socks:
            s.close()
        for f in blockers:
            f.result()
    deadline = time.monotonic() + 60 + k
    while True:  # let whatever was queued drain
        s = _pool_counters(url)
        if s.get("in_flight", 0) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    executed = s["completed"] - before - 2
    return {"abandoned_requests": k, "executed_anyway": executed}


def retry_storm(url: str, n: int, clients: int = 16) -> dict:
    """n requests of a 0.2 s program at `clients` concurrent clients whose socket timeout (1.5 s)
    is shorter than the queue wait, so clients give up and resend: executions vs requests."""
    from sandbox.client import SandboxClient

    before = _pool_counters(url)["completed"]
    with SandboxClient(url, max_concurrency=clients, timeout_pad_s=0.5, retries=3, backoff_s=0.05) as c:
        rs = c.run_batch([{"code": "import time; time.sleep(0.2)", "timeout_s": 1.0}] * n)
        st = c.stats()
    deadline = time.monotonic() + 120
    while True:
        s = _pool_counters(url)
        if s.get("in_flight", 0) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {"requests": n, "executions": s["completed"] - before, "answered_ok": sum(r.ok for r in rs),
            "client_retries": st.get("retries"), "client_failures": st.get("failures")}


def run_http(quick: bool = False, workers: int = 2, cwd: str = ROOT, pool=None) -> dict[str, Any]:
    """All HTTP measurements against a server started from `cwd` (a checkout of this repo)."""
    from sandbox.client import SandboxClient

    n16 = 100 if quick else 400
    nb, cb = (200, 50) if quick else (1000, 200)
    out: dict[str, Any] = {"workers": workers}
    if pool is not None:  # the pool directly, same concurrency, for the floor
        pool.map(["pass"] * 4)
        out["pool16"] = closed_loop(lambda: pool.run("pass").ok, n16, 16)
    proc, url = start_server(workers, cwd)
    try:
        with SandboxClient(url, max_concurrency=16) as c:
            c.map(["pass"] * 8)  # warm
            out["http16"] = closed_loop(lambda: c.run("pass").ok, n16, 16)
        out["raw_burst"] = raw_burst(url, cb)
        out["burst"] = burst(url, nb, cb)
        out["abandoned"] = abandoned(url, 10 if quick else 40)
        out["retry_storm"] = retry_storm(url, 20 if quick else 80)
        try:
            out["server_stats"] = get_json(url + "/stats")
        except OSError as e:
            out["server_stats"] = {"error": str(e)}
    finally:
        stop_server(proc)
    return out


if __name__ == "__main__":
    # `python -m benchmarks.sandbox_http [--quick] [--with-pool]`: the HTTP part alone.
    pool = None
    if "--with-pool" in sys.argv:
        from sandbox.pool import SandboxPool

        pool = SandboxPool(workers=2)
    try:
        print(json.dumps(run_http(quick="--quick" in sys.argv, pool=pool), indent=2, default=str))
    finally:
        if pool is not None:
            pool.close()
