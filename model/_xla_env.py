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

`unroll_threefry_on_cpu()` (called when model/transformer.py is imported, so after jax is) lowers
jax's threefry2x32 hash on CPU as straight-line code, as jax does on GPU and TPU, instead of its
CPU default, a 5-trip rolled loop. The rounds and so the bits are the same. XLA:CPU then fuses each hash
into one kernel instead of a loop of small ones. Every parameter initialiser draws through it: the
matched GRPO model's jitted init (compile + run) went 13.5 -> 9.2-10.4 s, and that run's set-up
15.9 / 12.5 -> 9.7 / 8.9 s (2 alternating pairs, identical parameters). The sampler's per-step
draw did not change.
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


def _threefry2x32_unrolled(key1, key2, x1, x2):
    """Threefry-2x32, 20 rounds (Salmon et al. 2011, Random123): jax's own rounds, unrolled."""
    import numpy as np

    def rotl(v, r):
        return (v << np.uint32(r)) | (v >> np.uint32(32 - r))

    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (key1, key2, key1 ^ key2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in rotations[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ rotl(x[1], r)
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return tuple(x)


def unroll_threefry_on_cpu() -> None:
    """Lower jax.extend.random.threefry2x32_p on CPU with `_threefry2x32_unrolled` (module
    docstring). Idempotent; the values jax.random returns do not change."""
    from jax.extend.random import threefry2x32_p
    from jax.interpreters import mlir

    mlir.register_lowering(threefry2x32_p,
                           mlir.lower_fun(_threefry2x32_unrolled, multiple_results=True),
                           platform="cpu")
