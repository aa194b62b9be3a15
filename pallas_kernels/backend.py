"""Which Pallas kernel family runs, and whether it is interpreted: one rule for KDA, DSA, MXFP4.

Every op with a Pallas path takes ``kernel`` and ``interpret``:

  kernel     "tpu" (Mosaic TPU lowering: BlockSpec pipelines, VMEM/SMEM scratch, DMAs) or
             "gpu" (Triton lowering: whole-array refs, masked/gathered loads, in-kernel loops);
             None -> the running platform's own family (``default_kernel``).
  interpret  None -> interpret mode unless the running platform compiles that family (a "tpu"
             kernel on a TPU, a "gpu" kernel on a CUDA/ROCm GPU).

``impl="pallas", kernel=K, interpret=False`` forces the compiled kernel of family K whatever the
running platform: on a CPU host the call then only *lowers* (e.g. under
``jax.export.export(..., platforms=["cuda"])`` or ``["tpu"]``; see
tests/pallas_kernels/test_lowering.py); executing it on the wrong platform fails in Pallas.

Compiling ahead of time for a TPU from a CPU host (``pallas_kernels.tpu_compile``, train/aot.py):
``with target_platform("tpu"):`` makes ``platform()`` answer "tpu" while a function is traced, so
``impl="auto"`` dispatch and the ``kernel`` / ``interpret`` defaults choose what a TPU runs.

The GPU family always passes Triton ``CompilerParams``: jax >= 0.10 lowers a ``pallas_call``
without compiler params through Mosaic GPU, which these kernels are not written for.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

KERNELS = ("tpu", "gpu")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_target",
                                                                    default=None)


def platform() -> str:
    """The running platform ("cpu", "gpu" or "tpu"), or the `target_platform` in effect."""
    return _TARGET.get() or jax.default_backend()


_platform = platform  # for functions whose argument shadows the name


@contextlib.contextmanager
def target_platform(name: str):
    """Trace as if running on platform `name` (e.g. "tpu" while compiling for a TPU topology
    from a CPU host): `platform()`, the dispatch tables and the kernel/interpret defaults follow
    it. Read at trace time, like every dispatch decision."""
    if name not in PLATFORMS:
        raise ValueError(f"target platform must be one of {PLATFORMS}, got {name!r}")
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


def normalize_kernel(kernel: str) -> str:
    """'tpu' / 'gpu' (also accepts the platform spellings 'cuda' and 'rocm' for 'gpu')."""
    if kernel in GPU_PLATFORMS:
        return "gpu"
    if kernel == "tpu":
        return "tpu"
    raise ValueError(f"kernel must be one of {KERNELS} (or 'cuda'/'rocm'), got {kernel!r}")


def default_kernel(cpu_default: str = "gpu") -> str:
    """The running platform's own family; on CPU (interpret only) `cpu_default`."""
    p = platform()
    if p == "tpu":
        return "tpu"
    if p in GPU_PLATFORMS:
        return "gpu"
    return cpu_default


def compiles_here(kernel: str) -> bool:
    """Whether the running platform compiles (rather than only interprets) this family."""
    p = platform()
    return (kernel == "tpu" and p == "tpu") or (kernel == "gpu" and p in GPU_PLATFORMS)


def resolve(kernel: str | None, interpret: bool | None, *, cpu_default: str = "gpu"):
    """-> (kernel family, interpret flag) under the rule in the module docstring."""
    kernel = default_kernel(cpu_default) if kernel is None else normalize_kernel(kernel)
    if interpret is None:
        interpret = not compiles_here(kernel)
    return kernel, bool(interpret)


def accelerated(platform: str | None = None) -> bool:
    """Whether `platform` (default: the running one) compiles Pallas kernels of some family
    (a TPU, or a CUDA/ROCm GPU); a CPU only interprets them."""
    p = platform or _platform()
    return p == "tpu" or p in GPU_PLATFORMS
