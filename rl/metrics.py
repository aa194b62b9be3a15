"""Metrics: the unbiased pass@k estimator, Wilson intervals, and a TensorBoard + JSONL writer."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion p measured on n trials."""
    if n <= 0:
        return 0.0, 1.0
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered_interval(per_task: list[tuple[int, int]], z: float = 1.96) -> tuple[float, float]:
    """95% interval for pass@1 measured as (n samples, c correct) on each of several tasks.

    Samples of one task are correlated (an easy task passes on every sample), so treating all
    n * tasks samples as independent trials would understate the uncertainty. This is the Wilson
    interval at the effective sample size n_eff = p(1-p) / Var(mean of the per-task rates), i.e.
    the trial count divided by the design effect (capped at the trial count); with one sample
    per task it is exactly the Wilson interval over tasks.
    """
    if not per_task:
        return 0.0, 1.0
    rates = np.array([c / n for n, c in per_task], np.float64)
    trials = int(sum(n for n, _ in per_task))
    p = float(rates.mean())
    if len(rates) < 2 or p in (0.0, 1.0):
        return wilson_interval(p, trials if len(rates) < 2 else len(rates), z)
    var_mean = float(rates.var()) / len(rates)  # ddof 0: Bernoulli rates give n_eff = n
    n_eff = trials if var_mean <= 0 else min(trials, p * (1 - p) / var_mean)
    return wilson_interval(p, max(int(round(n_eff)), 1), z)


def mean_interval(values, z: float = 1.96) -> tuple[float, float, float]:
    """Mean of per-task values in [0, 1] (e.g. pass@k estimates) with a 95% interval: (mean, lo,
    hi). The Wilson interval over the tasks: a value in [0, 1] with mean p varies at most as a
    Bernoulli(p) does, so this is conservative, and it stays honest when every task scores the
    same (a normal interval would collapse to the point)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return 0.0, 0.0, 1.0
    m = float(v.mean())
    return (m, *wilson_interval(m, v.size, z))


class MetricsWriter:
    """Scalars to TensorBoard event files (tensorboardX) and one JSON object per line."""

    def __init__(self, logdir: str, *, tensorboard: bool = True, config=None):
        """config (a ConfigDict or dict): written resolved to <logdir>/config.json, the record
        scripts/compare.py reads to tell runs apart."""
        os.makedirs(logdir, exist_ok=True)
        if config is not None:
            d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            with open(os.path.join(logdir, "config.json"), "w") as f:
                json.dump(d, f, indent=1, sort_keys=True, default=str)
        self.path = os.path.join(logdir, "metrics.jsonl")
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(logdir)

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        flat = {}
        for k, v in metrics.items():
            if isinstance(v, (int, float, np.floating, np.integer)) or (
                    hasattr(v, "shape") and getattr(v, "shape", None) == ()):
                flat[f"{prefix}{k}"] = float(v)
        self._f.write(json.dumps({"step": int(step), "time": time.time(), **flat}) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, int(step))

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
