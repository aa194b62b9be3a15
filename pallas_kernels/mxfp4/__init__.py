"""MXFP4 (OCP microscaling FP4) weights: quantize / dequantize, matmul kernels, QAT fake-quant.

Public API lives in `pallas_kernels.mxfp4.ops` (re-exported here); the pure-JAX oracle in
`reference`, the Pallas kernels in `pallas_tpu` / `pallas_gpu`, tile sizes in `config`.
"""

from pallas_kernels.mxfp4 import ops as _ops
from pallas_kernels.mxfp4.ops import *  # noqa: F403  (the public API, listed once in ops)

__all__ = list(_ops.__all__)
