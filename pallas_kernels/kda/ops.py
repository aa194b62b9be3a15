"""Public entry for KDA (Kimi Delta Attention).

    kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        chunk_size=64, impl="auto", interpret=None, kernel=None) -> (o, final_state)
    kda_step(q, k, v, g, beta, state, *, scale=None) -> (o, state)

Layouts (flash-linear-attention convention):
  q, k: [B,T,H,K] (the caller L2-normalises), v: [B,T,H,V], g: [B,T,H,K] log-decay (<= 0),
  beta: [B,T,H] (post-sigmoid), scale: python float (default K**-0.5),
  initial_state / final_state: [B,H,K,V] f32 (final_state is None unless output_final_state),
  o: [B,T,H,V] in v's dtype.

Per step:  S <- S * exp(g_t)[:, None];  S <- S + (beta_t k_t)(v_t - k_t^T S)^T;  o_t = (scale q_t)^T S.

impl (the dispatch table `DISPATCH`, `pallas_kernels.dispatch`):
  "auto"                 the first of "pallas", "chunked_vjp" that can take the call: the
                         Pallas kernels on GPU/TPU when K and V are powers of two and the inputs
                         f32 or bf16, else the chunked form with the hand-written backward (CPU:
                         always; the choice and its reason are logged once);
  "xla" / "chunked_vjp"  the pure-JAX chunked form (`reference.kda_chunked`'s forward) with a
                         hand-written backward (`chunked_vjp.py`: jax.custom_vjp over the chunk
                         terms, only the state entering each scan step kept for reverse mode;
                         1.3-1.4x the autodiff path's forward+backward on CPU, benchmarks/kda.py);
  "chunked"              the same chunked forward differentiated by plain autodiff (explicit
                         only; its gradients agree with "chunked_vjp" to f32 rounding, ~1e-6
                         relative);
  "recurrent"            the token-by-token oracle (`reference.kda_recurrent`);
  "pallas"               the Pallas kernels (forward + custom_vjp backward, also Pallas); a call
                         they cannot take (K or V not a power of two, other dtypes) raises
                         `dispatch.UnsupportedImpl` before tracing, saying why.
A compiled Pallas call on a device mesh (model.sharding.use_mesh) runs under shard_map, each
device on its batch rows and heads (`pallas_kernels.partition`).
kernel / interpret (Pallas only; the rule of `pallas_kernels.backend`): kernel "tpu" (Mosaic,
chunks walked on the grid) or "gpu" (Triton, chunks walked in-kernel), None -> the running
platform's (the "tpu" form when interpreting on CPU); interpret None -> interpret unless the
platform compiles that family. `impl="pallas", kernel="gpu", interpret=False` forces the compiled
Triton kernels (on a CPU host: lowering only, e.g. under jax.export for "cuda").
All implementations accept any T (not only multiples of chunk_size) and are differentiable
w.r.t. q, k, v, g, beta and initial_state. `chunk_size` is the Pallas kernels' chunk; the pure-JAX
chunked paths use min(chunk_size, reference.cpu_chunk(T, K)) (16, or 32 for K >= 96 over T >= 256:
measured fastest on XLA:CPU). The result does not depend on the chunk size beyond rounding.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import backend as _backend
from pallas_kernels import dispatch, partition
from pallas_kernels.kda import reference
from pallas_kernels.kda.chunked_vjp import kda_chunked_vjp


def kda_step(q, k, v, g, beta, state, *, scale=None):
    """One decode token, as `reference.kda_step` (same contract) with one pass over the state
    fewer. The reference decays the state, reads it (k^T S), writes the delta update and reads
    the new state again (q^T S'): two full reads of a written state, two writes. Here both
    readouts come from the incoming state, with the decay moved onto the short vectors:

        r_k = (k e^g)^T S,   r_q = scale (q e^g)^T S,   delta = beta (v - r_k)
        S'  = e^g S + k delta^T           (one elementwise pass: read S, write S')
        o   = scale q^T S' = r_q + scale (q . k) delta

    The same numbers up to f32 rounding (tests/pallas_kernels/test_kda.py); what it saves is
    memory traffic on the [B,H,K,V] f32 state, which is what a decode step of the KDA layers
    moves most of at batch 32 (2 MB per layer at H=4, K=V=64)."""
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f32 = jnp.float32
    out_dtype = v.dtype
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    S = state.astype(f32)  # [B,H,K,V]
    d = jnp.exp(g)  # [B,H,K]
    # both readouts as one broadcast multiply and sum over K: XLA:CPU runs the two batched
    # [1,K]x[K,V] dots they equal at a quarter of its memory rate and copies the state for them
    # (the update below overwrites it in place); the read-once form shortens the rollout
    # (`python -m benchmarks.grpo_peer`; docs/speed.md). Rounding as the dots', not bitwise.
    kq = jnp.stack([k * d, scale * q * d], axis=-2)  # [B,H,2,K]
    r = jnp.sum(kq[..., None] * S[..., None, :, :], axis=-2)  # [B,H,2,V]
    r_k, r_q = r[..., 0, :], r[..., 1, :]  # [B,H,V] each
    delta = beta[..., None] * (v - r_k)  # [B,H,V]
    o = r_q + (scale * jnp.sum(q * k, axis=-1))[..., None] * delta  # [B,H,V]
    S = S * d[..., None] + k[..., None] * delta[..., None, :]
    return o.astype(out_dtype), S

# What the Pallas kernels can take: Triton tiles K and V (and the chunk) in powers of two, and
# the kernels are written and tested for f32 and bf16 inputs (pallas_kda.py).
DISPATCH = dispatch.OpTable(
    "kda",
    (dispatch.Impl("pallas",
                   cannot=(dispatch.powers_of_two("K", "V", what=": the Pallas KDA kernels tile "
                                                  "K and V in powers of two; use power-of-two "
                                                  "head dims"),
                           dispatch.dtypes("float32", "bfloat16")),
                   auto_skips=(dispatch.pallas_compiles_here,)),
     dispatch.Impl("chunked_vjp"),
     dispatch.Impl("chunked"),
     dispatch.Impl("recurrent")),
    aliases={"xla": "chunked_vjp"},
    explicit_only=("chunked", "recurrent"),
)
IMPLS = ("auto", "xla", "chunked", "chunked_vjp", "recurrent", "pallas")
assert set(IMPLS) == set(DISPATCH.names())


def _resolve_impl(impl: str, K: int, V: int, dtype=None) -> str:
    """The implementation `kda` runs for head dims K, V (and the input dtype): `DISPATCH`."""
    return DISPATCH.resolve(impl, K=K, V=V, dtype=dtype)


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=64,
    impl="auto",
    interpret=None,
    kernel=None,
):
    """KDA over a whole sequence. See the module docstring for shapes and `impl`."""
    impl = _resolve_impl(impl, q.shape[-1], v.shape[-1], q.dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = float(scale)
    if impl == "recurrent":
        return reference.kda_recurrent(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
        )
    if impl in ("chunked", "chunked_vjp"):
        chunked = kda_chunked_vjp if impl == "chunked_vjp" else reference.kda_chunked
        return chunked(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
            chunk_size=min(chunk_size, reference.cpu_chunk(q.shape[1], q.shape[-1])),
        )
    from pallas_kernels.kda import pallas_kda  # noqa: PLC0415 (keeps CPU imports light)

    kernel, interpret = _backend.resolve(kernel, interpret, cpu_default="tpu")

    def run(q, k, v, g, beta, h0):
        return pallas_kda.kda_pallas(
            q, k, v, g, beta, scale=scale, initial_state=h0,
            output_final_state=output_final_state, chunk_size=chunk_size, interpret=interpret,
            kernel=kernel,
        )

    if interpret:
        return run(q, k, v, g, beta, initial_state)
    # compiled: one device's batch rows and heads per call on a mesh (pallas_kernels.partition)
    bthk, bhkv = ("batch", "length", "act_heads", None), ("batch", "act_heads", None, None)
    return partition.per_device(
        run, (q, k, v, g, beta, initial_state),
        (bthk, bthk, bthk, bthk, ("batch", "length", "act_heads"), bhkv),
        (bthk, bhkv if output_final_state else None))
