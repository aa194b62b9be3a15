"""Shared argument specs for DSA tests and benchmarks (one table, two consumers).

A spec is shapes + dtype + causal offset; ``make_args`` builds deterministic inputs. Tests
(tests/pallas_kernels/test_dsa.py) parametrise over ``TEST_SPECS``; the benchmark
(benchmarks/dsa.py) over ``bench_specs(quick)``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

__all__ = ["DSAArgSpec", "TEST_SPECS", "TEST_SPECS_BY_NAME", "bench_specs", "make_args"]


@dataclasses.dataclass(frozen=True)
class DSAArgSpec:
    """One DSA problem: attention q [B,T,H,D], kv [B,S,D] (values = first v_dim channels),
    indexer q_idx [B,T,HI,DI], k_idx [B,S,DI], w [B,T,HI]; query t sits at position t + q_offset
    (q_offset: int or a per-batch-row tuple of length B)."""

    name: str
    b: int
    t: int
    s: int
    h: int
    d: int
    v_dim: int
    topk: int
    hi: int = 4
    di: int = 32
    q_offset: int | tuple[int, ...] = 0
    dtype: str = "float32"

    @property
    def scale(self) -> float:
        return self.d ** -0.5

    @property
    def offset_array(self):
        """q_offset as an int or an int32 [B] array (what select_topk takes)."""
        if isinstance(self.q_offset, tuple):
            return jnp.asarray(self.q_offset, jnp.int32)
        return self.q_offset

    def with_dtype(self, dtype: str) -> DSAArgSpec:
        return dataclasses.replace(self, name=f"{self.name}_{dtype}", dtype=dtype)


def make_args(spec: DSAArgSpec, seed: int = 0) -> dict:
    """Deterministic inputs for a spec: q, kv, q_idx, k_idx, w (in spec.dtype; w f32).

    Drawn with numpy (no JAX PRNG programs to compile: tests stay fast on CPU).
    """
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(spec.dtype)

    def normal(*shape, scale=1.0, dtype=dt):  # cast in numpy (ml_dtypes bf16): no device op
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype))

    return dict(
        q=normal(spec.b, spec.t, spec.h, spec.d),
        kv=normal(spec.b, spec.s, spec.d),
        q_idx=normal(spec.b, spec.t, spec.hi, spec.di),
        k_idx=normal(spec.b, spec.s, spec.di),
        w=normal(spec.b, spec.t, spec.hi, scale=spec.hi ** -0.5, dtype=np.float32),
    )


TEST_SPECS = (
    # square causal prefill, rope channels (D = v_dim + 16), top-k well below S
    DSAArgSpec("prefill_rope", b=2, t=32, s=32, h=4, d=48, v_dim=32, topk=8),
    # odd sizes, chunked prefill: 13 queries at positions 5..17 of a 29-slot cache (the slots
    # past a query's position must stay unselected)
    DSAArgSpec("odd_chunk", b=1, t=13, s=29, h=3, d=40, v_dim=24, topk=10, hi=3, di=20, q_offset=5),
    # no rope part (D == v_dim); topk > S (extra slots -1; equals dense attention)
    DSAArgSpec("no_rope_topk_gt_s", b=2, t=24, s=24, h=2, d=32, v_dim=32, topk=32),
    # ragged decode-style batch: rows at different positions (row 1 has < topk valid keys early)
    DSAArgSpec("ragged_rows", b=2, t=8, s=40, h=4, d=64, v_dim=48, topk=16, q_offset=(32, 3)),
)
TEST_SPECS_BY_NAME = {s.name: s for s in TEST_SPECS}


def bench_specs(quick: bool = False) -> list[DSAArgSpec]:
    """Per-layer shapes: H=16, D=576 (512 latent + 64 rope), v_dim=512, top-k 256, indexer
    16 heads x 128. ``t`` is the number of timed queries, placed at the end of an S-long
    context (q_offset = S - t): the per-token cost at context length S."""
    lengths = (256, 512, 1024) if quick else (512, 1024, 4096, 16384)
    t = 64 if quick else 128
    return [DSAArgSpec(f"S{s}", b=1, t=t, s=s, h=16, d=576, v_dim=512, topk=256, hi=16, di=128,
                       q_offset=s - t) for s in lengths]
