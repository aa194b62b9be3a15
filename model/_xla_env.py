"""XLA environment set before jax is imported (tests and scripts call this first).

jax/jaxlib 0.10.2 XLA:CPU: the experimental "YNN" fusions segfault on the gradient of some
broadcast-multiply-sum patterns (hit by the KDA chunked backward and a DSA scatter). An empty
`--xla_cpu_experimental_ynn_fusion_type=` disables them; other XLA_FLAGS are kept.

`fast_compile=True` (the test suite) also sets `--xla_backend_optimization_level=0` (LLVM code
generation without its optimisation passes) and `--xla_cpu_use_fusion_emitters=false` (XLA:CPU's
older elemental emitter for fusions instead of the MLIR fusion emitters). The suite's tiny
programs are dominated by compile time: the first cut it by about a third (a cold smoke demo
137 s -> 89 s on 2 cores), the second by another 3-4x for a train step (the smoke model's
forward+backward at [8,64]: 3.6 s -> 0.95 s to compile, the same 60 ms per run). The numerics
are unchanged within the tests' tolerances. Processes the tests start inherit them via
XLA_FLAGS. Scripts keep XLA's defaults. A value already in XLA_FLAGS wins.

It also keeps jax's backend probe quiet ("Unable to initialize backend 'tpu'" on every start of a
machine without a TPU); real warnings still print.
"""

import logging
import os

_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def configure_xla_env(fast_compile: bool = False) -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_cpu_experimental_ynn_fusion_type") for f in flags):
        flags.append(_NO_YNN)
    if fast_compile:
        for flag in _FAST_COMPILE:
            name = flag.split("=")[0]
            if not any(f.split("=")[0] == name for f in flags):
                flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)
    # jax logs "Unable to initialize backend 'tpu' ... libtpu.so" at INFO on every start on a
    # machine without a TPU; absl's handler (scripts run under absl.app) would print it.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
