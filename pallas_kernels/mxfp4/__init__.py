"""MXFP4 (OCP microscaling FP4) weights: quantize / dequantize, matmul kernels, QAT fake-quant.

Public API lives in `pallas_kernels.mxfp4.ops` (re-exported here); the pure-JAX oracle in
`reference`, the Pallas kernels in `pallas_tpu` / `pallas_gpu`, tile sizes in `config`.
"""

from pallas_kernels.mxfp4.ops import (
    MXFP4,
    BlockConfig,
    block_config,
    check_finite,
    dequantize,
    fake_quant,
    grouped_mxfp4_matmul,
    mxfp4_matmul,
    nonfinite_blocks,
    quantize,
)

__all__ = [
    "MXFP4",
    "BlockConfig",
    "block_config",
    "check_finite",
    "dequantize",
    "fake_quant",
    "grouped_mxfp4_matmul",
    "mxfp4_matmul",
    "nonfinite_blocks",
    "quantize",
]
