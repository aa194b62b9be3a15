"""XLA environment set before jax is imported (tests and scripts call this first).

jax/jaxlib 0.10.2 XLA:CPU: the experimental "YNN" fusions segfault on the gradient of some
broadcast-multiply-sum patterns (hit by the KDA chunked backward and a DSA scatter). An empty
`--xla_cpu_experimental_ynn_fusion_type=` disables them; other XLA_FLAGS are kept.

`fast_compile=True` (the test suite) also sets `--xla_backend_optimization_level=0`: LLVM code
generation without its optimisation passes. The suite's tiny programs are dominated by compile
time, which this cuts by about a third (a cold smoke demo 137 s -> 89 s on 2 cores); the numerics
are unchanged within the tests' tolerances. Processes the tests start inherit it via XLA_FLAGS.
Scripts keep full optimisation. An explicit level already in XLA_FLAGS wins.

It also keeps jax's backend probe quiet ("Unable to initialize backend 'tpu'" on every start of a
machine without a TPU); real warnings still print.
"""

import logging
import os

_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
_FAST_COMPILE = "--xla_backend_optimization_level=0"


def configure_xla_env(fast_compile: bool = False) -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_cpu_experimental_ynn_fusion_type") for f in flags):
        flags.append(_NO_YNN)
    if fast_compile and not any(f.startswith("--xla_backend_optimization_level") for f in flags):
        flags.append(_FAST_COMPILE)
    os.environ["XLA_FLAGS"] = " ".join(flags)
    # jax logs "Unable to initialize backend 'tpu' ... libtpu.so" at INFO on every start on a
    # machine without a TPU; absl's handler (scripts run under absl.app) would print it.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
