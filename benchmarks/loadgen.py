"""Closed-loop load for the sandbox benchmarks (benchmarks/sandbox_*.py): `threads` callers each call
fn() again as soon as the previous call returns, until n calls are done."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank on the sorted values)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def closed_loop(fn: Callable[[], Any], n: int, threads: int, *, unit: str = "runs") -> dict:
    """n calls of fn() from `threads` threads. A call that returns False or raises is a failure
    (the first 5 exceptions are kept). Returns {unit, threads, wall_s, <unit>_per_s, p50_ms,
    p90_ms, p99_ms, mean_ms, failed, errors}."""
    lat: list[float] = []
    errors: list[str] = []
    failed = [0]
    left = [n]
    lock = threading.Lock()

    def loop():
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            t0 = time.perf_counter()
            try:
                ok = fn() is not False
            except Exception as e:  # noqa: BLE001 - counted; the benchmark goes on
                ok = False
                with lock:
                    if len(errors) < 5:
                        errors.append(f"{type(e).__name__}: {e}")
            dt = time.perf_counter() - t0
            with lock:
                lat.append(dt)
                failed[0] += not ok

    t0 = time.perf_counter()
    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    ms = lambda q: round(percentile(lat, q) * 1000, 1)
    return {unit: n, "threads": threads, "wall_s": round(wall, 3),
            f"{unit}_per_s": round(n / wall, 2), "p50_ms": ms(50), "p90_ms": ms(90),
            "p99_ms": ms(99), "mean_ms": round(statistics.mean(lat) * 1000, 1),
            "failed": failed[0], "errors": errors}
