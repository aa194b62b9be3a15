"""The peers' side of the side-by-side benchmarks: the matched work and the timing helpers both
sides share.

The scripts in this package run with the PEER's python, in its own virtual environment
(scripts/setup_peers.sh), as `python -m benchmarks.peers.<script>` from the repository root; the
project never imports them. This file therefore imports nothing but the
standard library (jax only inside `Clock.wrap`, where both sides have it), so the project's
driver (benchmarks/grpo_peer.py) and its project-side twin (benchmarks/grpo_matched.py) read the
same MATCHED work and measure it with the same clock.
"""

from __future__ import annotations

import json
import os
import threading
import time

# The matched GRPO work (DESIGN.md section 5): 8 prompts x 4 samples = 32 rows; each prompt is BOS + 31
# random ids in [3, vocab) (no padding); exactly 64 generated tokens per row (the end-of-sequence
# id is never sampled); temperature 0.9, no truncation; GRPO with k3 KL 0.04 in the loss against a
# frozen reference (one reference forward per batch), clip 0.2; AdamW lr 1e-5 (optax.adamw's
# defaults otherwise: b2 0.999, weight decay 1e-4, no gradient clipping); reward = the fraction of
# even token ids in the completion, computed on the host. The peer's model: a 4-layer Qwen3-style
# transformer of ~4.46M parameters (d_model 256, SwiGLU 1024, 4 heads of 64, untied head).
MATCHED = dict(
    prompts=8, group=4, prompt_len=32, new_tokens=64, vocab=512, temperature=0.9, top_p=1.0,
    kl_coef=0.04, clip=0.2, lr=1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, seed=0,
    peer_model=dict(num_layers=4, embed_dim=256, hidden_dim=1024, num_heads=4, head_dim=64,
                    num_kv_heads=4),
)

_TICK = os.sysconf("SC_CLK_TCK")


def emit(record: dict, out: str | None) -> None:
    """A side's result: one JSON line on stdout (what the driver reads), also written to `out`
    when given."""
    text = json.dumps(record, default=str)
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text)


def flops_per_row(compiled, batch: int) -> float:
    """XLA's count of the floating-point operations of a compiled program (its cost analysis,
    not a run) divided by its `batch` rows: both sides' decode_flops_per_token."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) / batch


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_point() -> tuple[float, float, float]:
    """(wall s, CPU seconds the whole machine has been busy, CPU seconds of this process: all
    its threads, user + system). The process's comes from time.process_time (nanoseconds), not
    os.times, whose 10 ms clock ticks are coarse against one kernel call; the machine's from
    /proc/stat is in ticks (it only estimates the other processes' load)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    busy = (user + nice + system + irq + softirq + steal) / _TICK
    return time.perf_counter(), busy, time.process_time()


def foreign_cores(a, b) -> float:
    """Cores other processes kept busy on average between two cpu_point()s (contention)."""
    wall = max(b[0] - a[0], 1e-9)
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall)


class Clock:
    """Named samples of wall seconds (with the other processes' load during each) and compile
    seconds per phase. `wrap(fn, name)` returns fn timed: it blocks on `pick(output)` before
    stopping the clock, so a sample is device time, not dispatch time; compile events that
    jax.monitoring reports while a wrapped call runs are booked to its name (`listen` is the
    listener to register). Samples of a nested call are booked to the innermost name only for
    compile time; wall samples are kept for every level."""

    COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                      "/jax/core/compile/jaxpr_to_mlir_module_duration",
                      "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.samples: dict[str, list[float]] = {}
        self.foreign: dict[str, list[float]] = {}
        self.compile_s: dict[str, float] = {}
        self.phase = "setup"

    def listen(self, event, duration_secs, **_):
        if event in self.COMPILE_EVENTS:  # compiles on a "precompile" thread (train.rl's
            # precompile_updates) are booked to "ahead", whatever the main thread is running
            ahead = threading.current_thread().name.startswith("precompile")
            phase = "ahead" if ahead else self.phase
            self.compile_s[phase] = self.compile_s.get(phase, 0.0) + duration_secs

    def add(self, name: str, seconds: float, foreign: float = 0.0):
        self.samples.setdefault(name, []).append(seconds)
        self.foreign.setdefault(name, []).append(foreign)

    def wrap(self, fn, name: str, pick=lambda out: out):
        import jax

        def timed(*args, **kwargs):
            outer, self.phase = self.phase, name
            a = cpu_point()
            try:
                out = fn(*args, **kwargs)
                jax.block_until_ready(pick(out))
            finally:
                self.phase = outer
            b = cpu_point()
            self.add(name, b[0] - a[0], foreign_cores(a, b))
            return out

        timed.__wrapped__ = fn
        return timed

    def record(self) -> dict:
        return {"samples": self.samples, "foreign_cores": self.foreign,
                "compile_s": self.compile_s}
