"""The one table of KDA argument specs, shared by tests/pallas_kernels/test_kda.py and bench.py.

A spec fixes shapes, dtype, gate magnitude and whether an initial state is passed; `make_args`
turns it into arrays in the `ops.kda` layout:
  q, k: [B,T,H,K] L2-normalised; v: [B,T,H,V]; g: [B,T,H,K] = -gate * U(0, 2) (so mean -gate
  per token, with a tail of near-zero gates that keeps long windows alive); beta: [B,T,H]
  sigmoid of a normal; initial_state: [B,H,K,V] f32 or None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KDASpec:
    name: str
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: str = "float32"
    gate: float = 50.0  # mean |g| per token
    initial_state: bool = True
    seq_mode: str | None = None  # Pallas sequential form to use under interpret (None: default)

    @property
    def tokens(self) -> int:
        return self.B * self.T


def make_args(spec: KDASpec, seed: int = 0) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    B, T, H, K, V = spec.B, spec.T, spec.H, spec.K, spec.V
    dt = jnp.dtype(spec.dtype)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (B, T, H, K), jnp.float32))
    k = unit(jax.random.normal(ks[1], (B, T, H, K), jnp.float32))
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.float32)
    g = -spec.gate * jax.random.uniform(ks[3], (B, T, H, K), jnp.float32, 0.0, 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    h0 = jax.random.normal(ks[5], (B, H, K, V), jnp.float32) if spec.initial_state else None
    return dict(q=q.astype(dt), k=k.astype(dt), v=v.astype(dt), g=g.astype(dt),
                beta=beta.astype(dt), initial_state=h0)


# Chunked reference vs the recurrent oracle (f32): T not a multiple of the 64-token chunk, V != K.
# The extreme-gate and decode specs share these shapes so tests reuse one compiled program.
REFERENCE = (
    KDASpec("ref_t130_h0", B=2, T=130, H=2, K=32, V=16, initial_state=True),
    KDASpec("ref_t130", B=2, T=130, H=2, K=32, V=16, initial_state=False),
)
# Extreme gates: trained models reach about -1700 per token.
EXTREME = dataclasses.replace(REFERENCE[0], name="ref_t130_gate1700", gate=1700.0)
# Decode parity: kda_step over the sequence vs one full forward.
DECODE = dataclasses.replace(REFERENCE[0], name="decode_t130", gate=5.0)

# Pallas (interpret on CPU) vs the reference: every T in {1, 63, 64, 130}, K=V in {16, 32, 64},
# with and without initial state, both sequential forms; gates near -50 per token.
PALLAS = (
    KDASpec("pallas_t1_k16_h0", B=1, T=1, H=2, K=16, V=16, seq_mode="grid"),
    KDASpec("pallas_t63_k32", B=1, T=63, H=2, K=32, V=32, initial_state=False, seq_mode="loop"),
    KDASpec("pallas_t64_k64_h0", B=1, T=64, H=2, K=64, V=64, seq_mode="grid"),
    KDASpec("pallas_t130_k16_h0", B=1, T=130, H=2, K=16, V=16, seq_mode="loop"),
)
PALLAS_BF16 = KDASpec("pallas_bf16_t130_k32", B=1, T=130, H=2, K=32, V=32, dtype="bfloat16",
                      gate=5.0, seq_mode="grid")

# Benchmarks (tokens/s): the DESIGN.md target shape, then B=1, H=16, K=V=128 by length.
BENCH = (
    KDASpec("bench_h4_t2048", B=1, T=2048, H=4, K=128, V=128, gate=1.0, initial_state=False),
    KDASpec("bench_h16_t2048", B=1, T=2048, H=16, K=128, V=128, gate=1.0, initial_state=False),
    KDASpec("bench_h16_t8192", B=1, T=8192, H=16, K=128, V=128, gate=1.0, initial_state=False),
)
BENCH_QUICK = (
    KDASpec("quick_h4_t512", B=1, T=512, H=4, K=128, V=128, gate=1.0, initial_state=False),
    KDASpec("quick_h4_t2048", B=1, T=2048, H=4, K=128, V=128, gate=1.0, initial_state=False),
)
