"""Unauthenticated slow connections against a server with a token (loopback only):

    python -m benchmarks.sandbox_http_auth [--slow 1000] [--requests 20] [--hold-s 20]

The server runs as its own process (`python -m sandbox.server --token T --workers 2`). For each
connection cap (the default 4096, and 500: below the attack, so every authenticated connection
has to make room), it measures authenticated requests (a fresh connection each, a program
sleeping 0.1 s) one after another: first alone, then while `--slow` connections from 127.0.0.1
hold the server without a token (each sends part of a request line, then one more byte a second,
never finishing: the slowloris pattern; each lives at most `--hold-s` seconds). Reported per cap:
latency p50/max alone and under the attack, the run time of the program (the response's
execution_time), the added delay (p50 under attack minus p50 alone) next to it, how many
authenticated requests were answered with something else than a result, and the server's
counters (evicted_unauthenticated, refused_connections).

Bounded: at most --slow connections (<= 4000), only to 127.0.0.1, for at most --hold-s seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import sys
import threading
import time
import urllib.request

from benchmarks.sandbox_http import get_json, start_server, stop_server

PROGRAM = "import time; time.sleep(0.1)"


def _authed_request(url: str, token: str) -> tuple[float, float, bool]:
    """(latency s, run time s, answered with a result) of one /run_code on a fresh connection."""
    body = json.dumps({"code": PROGRAM, "language": "python", "run_timeout": 10}).encode()
    req = urllib.request.Request(url + "/run_code", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {token}", "Connection": "close"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        ok = out.get("status") == "Success"
        run_s = float(out["run_result"]["execution_time"]) if ok else 0.0
    except OSError:
        ok, run_s = False, 0.0
    return time.perf_counter() - t0, run_s, ok


def _measure(url: str, token: str, n: int) -> dict:
    lat, run, bad = [], [], 0
    for _ in range(n):
        latency, run_s, ok = _authed_request(url, token)
        lat.append(latency)
        run.append(run_s)
        bad += not ok
    return {"p50_s": round(statistics.median(lat), 4), "max_s": round(max(lat), 4),
            "run_p50_s": round(statistics.median(run), 4), "not_answered": bad}


class Slowloris:
    """`n` connections to 127.0.0.1:port without a token, each trickling a request head."""

    def __init__(self, port: int, n: int, hold_s: float) -> None:
        self.port, self.n, self.hold_s = port, n, hold_s
        self.socks: list[socket.socket] = []
        self.opened = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def start(self) -> None:
        for _ in range(self.n):
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                s.setblocking(False)
                s.send(b"POST /run_code HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                self.socks.append(s)
                self.opened += 1
            except OSError:
                self.failed += 1
        self._t0 = time.monotonic()
        self._thread.start()

    def _trickle(self) -> None:
        while not self._stop.wait(1.0) and time.monotonic() - self._t0 < self.hold_s:
            for s in self.socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    def still_open(self) -> int:
        n = 0
        for s in self.socks:
            try:
                if s.recv(1) == b"":
                    continue  # closed by the server
            except BlockingIOError:
                n += 1  # nothing received: still held
                continue
            except OSError:
                continue
        return n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()


def run(slow: int = 1000, requests: int = 20, hold_s: float = 20.0, workers: int = 2) -> dict:
    if not 0 < slow <= 4000:
        raise ValueError("--slow must be in 1..4000 (connections to 127.0.0.1)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < slow + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, slow + 1024), hard))
    token = "bench-" + "0123456789abcdef" * 2
    out = {}
    for cap in (4096, 500):
        proc, url = start_server(workers, extra_args=("--token", token, "--max-connections", str(cap)))
        try:
            port = int(url.rsplit(":", 1)[1])
            _measure(url, token, 3)  # warm
            alone = _measure(url, token, requests)
            attack = Slowloris(port, slow, hold_s)
            attack.start()
            t0 = time.monotonic()
            under = _measure(url, token, requests)
            held = attack.still_open()
            took = time.monotonic() - t0
            attack.stop()
            req = urllib.request.Request(url + "/stats", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                server = json.loads(r.read()).get("server", {})
            counters = server.get("counters", server)
            out[f"cap_{cap}"] = {
                "alone": alone, "under_attack": under,
                "added_delay_p50_s": round(under["p50_s"] - alone["p50_s"], 4),
                "run_time_s": under["run_p50_s"],
                "slow_opened": attack.opened, "slow_refused_at_connect": attack.failed,
                "slow_still_open_after": held, "measured_during_s": round(took, 1),
                "evicted_unauthenticated": counters.get("evicted_unauthenticated", 0),
                "refused_connections": counters.get("refused_connections", 0)}
            get_json(url + "/health")
        finally:
            stop_server(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slow", type=int, default=1000)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--hold-s", type=float, default=20.0)
    a = p.parse_args(argv)
    out = run(a.slow, a.requests, a.hold_s)
    print(json.dumps(out, indent=1))
    ok = all(r["under_attack"]["not_answered"] == 0 and r["added_delay_p50_s"] <= r["run_time_s"]
             for r in out.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
