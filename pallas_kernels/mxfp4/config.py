"""Frozen per-backend block sizes for the MXFP4 Pallas kernels and the one heuristics function.

Tile sizes are in LOGICAL elements: `block_k` counts unpacked K elements (a multiple of 32; the
kernels read block_k / 2 packed bytes and block_k / 32 scale bytes per row and step).

Backends differ in what they need:
  * "tpu" (Mosaic): tiles are VMEM blocks moved by the BlockSpec pipeline, with a K grid axis
    and a float32 VMEM accumulator. Block minor dims must be multiples of 128 (or the full dim):
    the scale block is [block_n, block_k / 32], so block_k is either all of K or a multiple of
    4096; uint8 weight blocks want block_n a multiple of 32.
  * "gpu" (Triton): one program per (M tile, N tile) loops over K inside the kernel with masked
    loads; every loaded extent must be a power of two and every dot operand dim >= 16.
  * "interpret" (CPU tests): any sizes work; big tiles keep the grid (and interpret time) small.
Decode-shaped problems (M <= 64 rows) are weight-bandwidth bound: small M tile, narrow N tiles so
that enough programs stream the weights in parallel. Prefill-shaped problems are compute bound:
square-ish M x N tiles.
"""

from __future__ import annotations

import dataclasses

DECODE_MAX_M = 64


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes: block_m rows of x, block_n rows of w (output columns), block_k K elements."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int | None = None  # gpu only
    num_stages: int | None = None  # gpu only

    def __post_init__(self):
        if min(self.block_m, self.block_n, self.block_k) <= 0:
            raise ValueError(f"BlockConfig sizes must be positive: {self}")
        if self.block_k % 32:
            raise ValueError(f"block_k must be a multiple of 32 (one MX block), got {self}")


# The frozen tables: (decode, prefill) per backend. Sizes are clipped to the problem below.
CONFIGS: dict[str, dict[str, BlockConfig]] = {
    "tpu": {
        "decode": BlockConfig(block_m=64, block_n=256, block_k=4096),
        "prefill": BlockConfig(block_m=256, block_n=256, block_k=4096),
    },
    "gpu": {
        # H100/H200: 16-row MMA minimum; narrow N so ~N/16 programs share the weight stream.
        "decode": BlockConfig(block_m=16, block_n=16, block_k=512, num_warps=4, num_stages=4),
        "prefill": BlockConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    },
    "interpret": {
        "decode": BlockConfig(block_m=64, block_n=256, block_k=1024),
        "prefill": BlockConfig(block_m=256, block_n=256, block_k=1024),
    },
}


def _pow2_floor(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << (max(int(v), 1) - 1).bit_length()


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def block_config(m: int, n: int, k: int, *, backend: str) -> BlockConfig:
    """Pick tiles for an [m, k] x [n, k]^T MXFP4 matmul on `backend` ("tpu"|"gpu"|"interpret").

    Decode-shaped (m <= 64) vs prefill-shaped tables from `CONFIGS`, clipped to the problem and
    to the backend's alignment rules (see module docstring).
    """
    if backend not in CONFIGS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {sorted(CONFIGS)}")
    base = CONFIGS[backend]["decode" if m <= DECODE_MAX_M else "prefill"]
    if backend == "tpu":
        bm = m if m <= base.block_m else base.block_m  # full dim or a multiple of 8
        bn = n if n <= base.block_n else base.block_n
        bk = k if k <= base.block_k else base.block_k  # full K or a multiple of 4096
        return dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk)
    if backend == "gpu":
        bm = min(base.block_m, max(16, _pow2_ceil(m)))
        bn = min(base.block_n, max(16, _pow2_ceil(n)))
        bk = min(base.block_k, max(32, _pow2_ceil(k)))
        return dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk)
    bm = min(base.block_m, _round_up(m, 8))
    bn = min(base.block_n, _round_up(n, 8))
    bk = min(base.block_k, k)
    return dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk)


def check_config(cfg: BlockConfig, *, backend: str) -> None:
    """Raise if cfg cannot lower on backend (interpret accepts anything)."""
    if backend == "gpu":
        for name in ("block_m", "block_n"):
            v = getattr(cfg, name)
            if v < 16 or v != _pow2_floor(v):
                raise ValueError(f"gpu {name} must be a power of two >= 16, got {cfg}")
        if cfg.block_k < 32 or cfg.block_k != _pow2_floor(cfg.block_k):
            raise ValueError(f"gpu block_k must be a power of two >= 32, got {cfg}")
