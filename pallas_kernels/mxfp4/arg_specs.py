"""Shared argument specs for the MXFP4 tests and benchmark (one table, two consumers).

Test specs stay <= 256 per dim (Pallas interpret cost grows with grid steps). Configs pin tiles
so that the edge cases are actually hit: K not a multiple of block_k (ragged K tail), M / N not
multiples of their tiles, leading batch dims, several tiles per expert and experts sharing a tile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mxfp4.config import BlockConfig
from pallas_kernels.mxfp4.reference import MXFP4, quantize


@dataclasses.dataclass(frozen=True)
class MatmulSpec:
    """x [*lead, m, k] @ dequantize(w [n, k]).T."""

    name: str
    m: int
    n: int
    k: int
    dtype: str = "bfloat16"
    lead: tuple[int, ...] = ()
    config: BlockConfig | None = None  # None: heuristics


@dataclasses.dataclass(frozen=True)
class GroupedSpec:
    """x [m, k] sorted by expert, w [len(group_sizes), n, k]."""

    name: str
    m: int
    n: int
    k: int
    group_sizes: tuple[int, ...]
    dtype: str = "bfloat16"
    config: BlockConfig | None = None


MATMUL_SPECS: tuple[MatmulSpec, ...] = (
    MatmulSpec("decode_bf16", m=8, n=64, k=128),
    MatmulSpec("decode_f32_batched", m=4, n=48, k=96, dtype="float32", lead=(2,)),
    # 160 = 2 * 64 + 32: ragged K tail; 40 rows / 80 cols: partial M and N tiles.
    MatmulSpec("ragged_k_bf16", m=40, n=80, k=160, config=BlockConfig(16, 32, 64)),
    MatmulSpec("ragged_k_f32", m=40, n=80, k=160, dtype="float32", config=BlockConfig(16, 32, 64)),
    MatmulSpec("prefill_bf16", m=128, n=96, k=256),
)

GROUPED_SPECS: tuple[GroupedSpec, ...] = (
    # empty groups at the start, middle and end; 3 rows past the sum
    GroupedSpec(
        "moe_empty_groups",
        m=40,
        n=48,
        k=96,
        group_sizes=(0, 5, 0, 20, 12, 0),
        config=BlockConfig(16, 32, 64),
    ),
    GroupedSpec(
        "moe_f32",
        m=24,
        n=32,
        k=64,
        group_sizes=(7, 9, 8),
        dtype="float32",
        config=BlockConfig(16, 16, 32),
    ),
    GroupedSpec(
        "moe_all_empty",
        m=16,
        n=32,
        k=64,
        group_sizes=(0, 0),
        dtype="float32",
        config=BlockConfig(16, 16, 32),
    ),
    GroupedSpec("moe_heuristic_tiles", m=64, n=64, k=128, group_sizes=(30, 2, 0, 31)),
)

# Benchmark problems: decode-shaped (M = 8, weight-bandwidth bound) and prefill-shaped.
BENCH_SPECS: dict[str, tuple[MatmulSpec, ...]] = {
    "full": (
        MatmulSpec("decode", m=8, n=2048, k=2048),
        MatmulSpec("prefill", m=2048, n=2048, k=2048),
    ),
    "quick": (
        MatmulSpec("decode", m=8, n=512, k=512),
        MatmulSpec("prefill", m=256, n=512, k=512),
    ),
    # On an accelerator (H200: 4.8 TB/s): weights big enough to stream from HBM.
    "device": (
        MatmulSpec("decode", m=8, n=8192, k=8192),
        MatmulSpec("prefill", m=2048, n=8192, k=8192),
    ),
}


def make_weight(rng: np.random.Generator, shape, *, spread: int = 1) -> MXFP4:
    """Random weights of logical `shape` (numpy RNG: no per-op compiles), each row scaled by
    2**j, j uniform in [-spread, spread], so blocks get different scales; quantized along the
    last axis."""
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp2(rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))).astype(np.float32)
    return quantize(jnp.asarray(w))


def make_matmul_args(spec: MatmulSpec, seed: int = 0) -> tuple[jax.Array, MXFP4]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*spec.lead, spec.m, spec.k)).astype(np.float32)
    return jnp.asarray(x).astype(spec.dtype), make_weight(rng, (spec.n, spec.k))


def make_grouped_args(spec: GroupedSpec, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((spec.m, spec.k)).astype(np.float32)
    w = make_weight(rng, (len(spec.group_sizes), spec.n, spec.k))
    return jnp.asarray(x).astype(spec.dtype), w, jnp.asarray(np.array(spec.group_sizes, np.int32))
