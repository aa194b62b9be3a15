"""Pallas kernels for chunked KDA: forward and a custom_vjp backward that is also Pallas.

Kernels (all f32 math on per-chunk tiles from `tiles.py`; inputs may be bf16):
  intra_fwd   grid (B*H, N) parallel: per chunk A_qk, w, u, q e^G, k e^(G_C-G), e^(G_C)
  state_fwd   sequential over chunks: o, the state entering every chunk (saved for the
              backward), the final state
  state_bwd   sequential, reversed: the state cotangent leaving every chunk, d initial_state
  intra_bwd   grid (B*H, N) parallel: recomputes the chunk's forward from the saved entering
              state and returns dq, dk, dv, dg, dbeta

Residuals kept between forward and backward: the inputs and the per-chunk entering states
[B*H, N, K, V] (f32). Everything else is recomputed inside chunks.

Backends. The sequential kernels come in two forms (`KDAConfig.seq_mode`):
  "grid": grid (B*H, N) with the chunk axis sequential ("arbitrary") and the state carried in a
          VMEM scratch: the TPU (Mosaic) form.
  "loop": grid (B*H,) with an in-kernel `fori_loop` over chunks reading whole-sequence refs:
          the GPU (Triton) form, where grid steps run in parallel and cannot carry state.
Both run in interpret mode on CPU (the tests cover both). `KDAConfig.backend` ("tpu" / "gpu",
from `get_config(backend=...)` / `kda_pallas(kernel=...)`) picks the compiler params of the
compiled kernels: Mosaic dimension semantics, or Triton warps/stages (a GPU pallas_call without
Triton params would lower through Mosaic GPU in jax >= 0.10); compiled, "grid" goes with "tpu"
and "loop" with "gpu" (checked). Triton needs power-of-two tiles, so K, V, the chunk and the
sub-chunk must be powers of two (asserted), and T is padded to a multiple of the chunk.
Lowering for both platforms (fwd + bwd, test and benchmark shapes) is checked from a CPU host by
tests/pallas_kernels/test_lowering.py; nothing here has been compiled or run on a GPU/TPU yet.

Not covered: variable-length packed batches (cu_seqlens), K or V that are not powers of two,
fused gate computation (the caller passes g), fp8.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend
from pallas_kernels.kda import tiles

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Block sizes and knobs of the Pallas KDA kernels (see `get_config` for the defaults)."""

    chunk_size: int = 64  # C: tokens per chunk (power of two)
    sub_chunk: int = 16  # c: rows per exact diagonal block inside a chunk (power of two, <= C)
    seq_mode: str = "grid"  # "grid" (TPU) or "loop" (GPU): how the sequential kernels walk chunks
    backend: str = "tpu"  # kernel family when compiled: "tpu" (Mosaic params) or "gpu" (Triton)
    num_warps: int | None = None  # Triton only
    num_stages: int | None = None  # Triton only

    def __post_init__(self):
        for name in ("chunk_size", "sub_chunk"):
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise ValueError(f"{name} must be a power of two; got {x}")
        if self.sub_chunk > self.chunk_size:
            raise ValueError("sub_chunk must be <= chunk_size")
        if self.seq_mode not in ("grid", "loop"):
            raise ValueError(f"seq_mode must be 'grid' or 'loop'; got {self.seq_mode!r}")
        if self.backend not in ("tpu", "gpu"):
            raise ValueError(f"backend must be 'tpu' or 'gpu'; got {self.backend!r}")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def get_config(*, T: int, K: int, V: int, chunk_size: int = 64, backend: str | None = None,
               seq_mode: str | None = None) -> KDAConfig:
    """The one place block sizes are chosen.

    The chunk is `chunk_size`, shrunk to the next power of two >= T for short inputs (not below
    16, Triton's smallest dot). The exact diagonal blocks are 16 rows. TPU walks chunks on the
    grid, GPU inside the kernel (8 warps once K or V reach 128); CPU (interpret) follows TPU.
    `backend`: a kernel family ("tpu" / "gpu") or a platform name ("cpu", "cuda", "rocm");
    None -> the running platform.
    """
    backend = backend or _backend.platform()
    family = "gpu" if backend in ("gpu", "cuda", "rocm") else "tpu"
    C = max(16, min(_next_pow2(chunk_size), _next_pow2(T)))
    c = min(16, C)
    if seq_mode is None:
        seq_mode = "loop" if family == "gpu" else "grid"
    warps = stages = None
    if family == "gpu":
        warps, stages = (8 if max(K, V) >= 128 else 4), 1
    return KDAConfig(chunk_size=C, sub_chunk=c, seq_mode=seq_mode, backend=family,
                     num_warps=warps, num_stages=stages)


def _compiler_params(cfg: KDAConfig, semantics, interpret: bool):
    """Compiler params of the config's kernel family (never None when compiled: a GPU
    pallas_call without Triton params would lower through Mosaic GPU instead)."""
    if interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

        return pltpu.CompilerParams(dimension_semantics=semantics)
    from jax.experimental.pallas import triton as pltr  # noqa: PLC0415

    return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _ld(ref):
    return ref[...].astype(f32)


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------


def _intra_fwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref,
                      aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref, *, c):
    outs = tiles.intra_forward(_ld(q_ref), _ld(k_ref), _ld(v_ref), _ld(g_ref), _ld(b_ref), c)
    for ref, x in zip((aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref), outs, strict=True):
        ref[...] = x


def _state_fwd_grid_kernel(aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref, h0_ref,
                           o_ref, h_ref, ht_ref, s_scr, *, scale, nchunks):
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
        s_scr[...] = _ld(h0_ref)

    S = s_scr[...]
    h_ref[...] = S
    o, S = tiles.state_forward(_ld(aqk_ref), _ld(w_ref), _ld(u_ref), _ld(qg_ref), _ld(kd_ref),
                               _ld(dec_ref), S, scale)
    o_ref[...] = o.astype(o_ref.dtype)
    s_scr[...] = S

    @pl.when(n == nchunks - 1)
    def _():
        ht_ref[...] = S


def _state_fwd_loop_kernel(aqk_ref, w_ref, u_ref, qg_ref, kd_ref, dec_ref, h0_ref,
                           o_ref, h_ref, ht_ref, *, scale, nchunks, C):
    bh = pl.program_id(0)

    def body(n, S):
        sl = pl.ds(n * C, C)
        h_ref[bh, n] = S
        o, S = tiles.state_forward(
            aqk_ref[bh, sl, :].astype(f32), w_ref[bh, sl, :].astype(f32),
            u_ref[bh, sl, :].astype(f32), qg_ref[bh, sl, :].astype(f32),
            kd_ref[bh, sl, :].astype(f32), dec_ref[bh, n].astype(f32), S, scale)
        o_ref[bh, sl, :] = o.astype(o_ref.dtype)
        return S

    ht_ref[bh] = lax.fori_loop(0, nchunks, body, h0_ref[bh].astype(f32))


def _state_bwd_grid_kernel(aqk_ref, w_ref, qg_ref, kd_ref, dec_ref, do_ref, dht_ref,
                           dso_ref, dh0_ref, ds_scr, *, scale, nchunks):
    n = pl.program_id(1)  # walks chunks N-1 .. 0 (the index maps reverse it)

    @pl.when(n == 0)
    def _():
        ds_scr[...] = _ld(dht_ref)

    dS = ds_scr[...]
    dso_ref[...] = dS
    dS = tiles.state_backward(_ld(aqk_ref), _ld(w_ref), _ld(qg_ref), _ld(kd_ref), _ld(dec_ref),
                              _ld(do_ref), dS, scale)
    ds_scr[...] = dS

    @pl.when(n == nchunks - 1)
    def _():
        dh0_ref[...] = dS


def _state_bwd_loop_kernel(aqk_ref, w_ref, qg_ref, kd_ref, dec_ref, do_ref, dht_ref,
                           dso_ref, dh0_ref, *, scale, nchunks, C):
    bh = pl.program_id(0)

    def body(i, dS):
        n = nchunks - 1 - i
        sl = pl.ds(n * C, C)
        dso_ref[bh, n] = dS
        return tiles.state_backward(
            aqk_ref[bh, sl, :].astype(f32), w_ref[bh, sl, :].astype(f32),
            qg_ref[bh, sl, :].astype(f32), kd_ref[bh, sl, :].astype(f32),
            dec_ref[bh, n].astype(f32), do_ref[bh, sl, :].astype(f32), dS, scale)

    dh0_ref[bh] = lax.fori_loop(0, nchunks, body, dht_ref[bh].astype(f32))


def _intra_bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, h_ref, dso_ref, do_ref,
                      dq_ref, dk_ref, dv_ref, dg_ref, db_ref, *, scale, c):
    grads = tiles.intra_backward(_ld(q_ref), _ld(k_ref), _ld(v_ref), _ld(g_ref), _ld(b_ref),
                                 _ld(h_ref), _ld(dso_ref), _ld(do_ref), scale, c)
    for ref, x in zip((dq_ref, dk_ref, dv_ref, dg_ref, db_ref), grads, strict=True):
        ref[...] = x.astype(ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers. Layouts: per (batch*head) rows, [BH, T_pad, D]; beta [BH, T_pad, 1];
# states [BH, K, V]; per-chunk states [BH, N, K, V]; chunk decays [BH, N, K, 1].
# ----------------------------------------------------------------------------------------------


def _tile(C, D):
    return pl.BlockSpec((None, C, D), lambda bh, n: (bh, n, 0))


def _chunk_state(K, V, rev=None):
    if rev is None:
        return pl.BlockSpec((None, None, K, V), lambda bh, n: (bh, n, 0, 0))
    return pl.BlockSpec((None, None, K, V), lambda bh, n: (bh, rev - 1 - n, 0, 0))


def _intra_forward(q, k, v, g, beta, cfg, interpret):
    BH, Tp, K = q.shape
    V = v.shape[-1]
    C = cfg.chunk_size
    N = Tp // C
    out_shape = (
        jax.ShapeDtypeStruct((BH, Tp, C), f32),  # A_qk
        jax.ShapeDtypeStruct((BH, Tp, K), f32),  # w
        jax.ShapeDtypeStruct((BH, Tp, V), f32),  # u
        jax.ShapeDtypeStruct((BH, Tp, K), f32),  # q e^G
        jax.ShapeDtypeStruct((BH, Tp, K), f32),  # k e^(G_C - G)
        jax.ShapeDtypeStruct((BH, N, K, 1), f32),  # e^(G_C)
    )
    return pl.pallas_call(
        functools.partial(_intra_fwd_kernel, c=cfg.sub_chunk),
        grid=(BH, N),
        in_specs=[_tile(C, K), _tile(C, K), _tile(C, V), _tile(C, K), _tile(C, 1)],
        out_specs=[_tile(C, C), _tile(C, K), _tile(C, V), _tile(C, K), _tile(C, K),
                   _chunk_state(K, 1)],
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg, ("parallel", "parallel"), interpret),
        interpret=interpret,
        name="kda_intra_fwd",
    )(q, k, v, g, beta)


def _state_forward(aqk, w, u, qg, kd, dec, h0, o_dtype, scale, cfg, interpret):
    BH, Tp, K = w.shape
    V = u.shape[-1]
    C = cfg.chunk_size
    N = Tp // C
    out_shape = (
        jax.ShapeDtypeStruct((BH, Tp, V), o_dtype),  # o
        jax.ShapeDtypeStruct((BH, N, K, V), f32),  # state entering each chunk
        jax.ShapeDtypeStruct((BH, K, V), f32),  # final state
    )
    if cfg.seq_mode == "loop":
        return pl.pallas_call(
            functools.partial(_state_fwd_loop_kernel, scale=scale, nchunks=N, C=C),
            grid=(BH,),
            out_shape=out_shape,
            compiler_params=_compiler_params(cfg, ("parallel",), interpret),
            interpret=interpret,
            name="kda_state_fwd",
        )(aqk, w, u, qg, kd, dec, h0)
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415 (VMEM scratch spec)

    state = pl.BlockSpec((None, K, V), lambda bh, n: (bh, 0, 0))
    return pl.pallas_call(
        functools.partial(_state_fwd_grid_kernel, scale=scale, nchunks=N),
        grid=(BH, N),
        in_specs=[_tile(C, C), _tile(C, K), _tile(C, V), _tile(C, K), _tile(C, K),
                  _chunk_state(K, 1), state],
        out_specs=[_tile(C, V), _chunk_state(K, V), state],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=_compiler_params(cfg, ("parallel", "arbitrary"), interpret),
        interpret=interpret,
        name="kda_state_fwd",
    )(aqk, w, u, qg, kd, dec, h0)


def _state_backward(aqk, w, qg, kd, dec, do, dht, scale, cfg, interpret):
    BH, Tp, K = w.shape
    V = do.shape[-1]
    C = cfg.chunk_size
    N = Tp // C
    out_shape = (
        jax.ShapeDtypeStruct((BH, N, K, V), f32),  # cotangent of the state leaving each chunk
        jax.ShapeDtypeStruct((BH, K, V), f32),  # d initial_state
    )
    if cfg.seq_mode == "loop":
        return pl.pallas_call(
            functools.partial(_state_bwd_loop_kernel, scale=scale, nchunks=N, C=C),
            grid=(BH,),
            out_shape=out_shape,
            compiler_params=_compiler_params(cfg, ("parallel",), interpret),
            interpret=interpret,
            name="kda_state_bwd",
        )(aqk, w, qg, kd, dec, do, dht)
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

    rtile = lambda D: pl.BlockSpec((None, C, D), lambda bh, n: (bh, N - 1 - n, 0))
    state = pl.BlockSpec((None, K, V), lambda bh, n: (bh, 0, 0))
    return pl.pallas_call(
        functools.partial(_state_bwd_grid_kernel, scale=scale, nchunks=N),
        grid=(BH, N),
        in_specs=[rtile(C), rtile(K), rtile(K), rtile(K), _chunk_state(K, 1, rev=N), rtile(V),
                  state],
        out_specs=[_chunk_state(K, V, rev=N), state],
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), f32)],
        compiler_params=_compiler_params(cfg, ("parallel", "arbitrary"), interpret),
        interpret=interpret,
        name="kda_state_bwd",
    )(aqk, w, qg, kd, dec, do, dht)


def _intra_backward(q, k, v, g, beta, h, dso, do, scale, cfg, interpret):
    BH, Tp, K = q.shape
    V = v.shape[-1]
    C = cfg.chunk_size
    N = Tp // C
    out_shape = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, g, beta))
    return pl.pallas_call(
        functools.partial(_intra_bwd_kernel, scale=scale, c=cfg.sub_chunk),
        grid=(BH, N),
        in_specs=[_tile(C, K), _tile(C, K), _tile(C, V), _tile(C, K), _tile(C, 1),
                  _chunk_state(K, V), _chunk_state(K, V), _tile(C, V)],
        out_specs=[_tile(C, K), _tile(C, K), _tile(C, V), _tile(C, K), _tile(C, 1)],
        out_shape=out_shape,
        compiler_params=_compiler_params(cfg, ("parallel", "parallel"), interpret),
        interpret=interpret,
        name="kda_intra_bwd",
    )(q, k, v, g, beta, h, dso, do)


# ----------------------------------------------------------------------------------------------
# custom_vjp core on the kernel layout, and the public wrapper.
# ----------------------------------------------------------------------------------------------


def _forward(q, k, v, g, beta, h0, scale, cfg, interpret):
    aqk, w, u, qg, kd, dec = _intra_forward(q, k, v, g, beta, cfg, interpret)
    return _state_forward(aqk, w, u, qg, kd, dec, h0, v.dtype, scale, cfg, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _kda_core(q, k, v, g, beta, h0, scale, cfg, interpret):
    o, _, ht = _forward(q, k, v, g, beta, h0, scale, cfg, interpret)
    return o, ht


def _kda_core_fwd(q, k, v, g, beta, h0, scale, cfg, interpret):
    o, h, ht = _forward(q, k, v, g, beta, h0, scale, cfg, interpret)
    return (o, ht), (q, k, v, g, beta, h)


def _kda_core_bwd(scale, cfg, interpret, res, cts):
    q, k, v, g, beta, h = res
    do, dht = cts
    aqk, w, _, qg, kd, dec = _intra_forward(q, k, v, g, beta, cfg, interpret)
    dso, dh0 = _state_backward(aqk, w, qg, kd, dec, do, dht.astype(f32), scale, cfg, interpret)
    dq, dk, dv, dg, db = _intra_backward(q, k, v, g, beta, h, dso, do, scale, cfg, interpret)
    return dq, dk, dv, dg, db, dh0


_kda_core.defvjp(_kda_core_fwd, _kda_core_bwd)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "output_final_state", "chunk_size", "interpret", "config",
                     "kernel"),
)
def kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
               chunk_size=64, interpret=False, config: KDAConfig | None = None,
               kernel: str | None = None):
    """KDA through the Pallas kernels; same contract as `ops.kda`. Differentiable (custom_vjp).

    `kernel` ("tpu" | "gpu" | None = the running platform's) picks the kernel family for
    `get_config`; `config` overrides `get_config` (its chunk_size then wins over the argument).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d & (d - 1):
            raise ValueError(f"the Pallas KDA kernels need a power-of-two {name}; got {d}")
    scale = K**-0.5 if scale is None else float(scale)
    cfg = config or get_config(T=T, K=K, V=V, chunk_size=chunk_size, backend=kernel)
    if not interpret and (cfg.seq_mode == "loop") != (cfg.backend == "gpu"):
        raise ValueError(f"compiled KDA kernels need seq_mode 'loop' on the gpu family and "
                         f"'grid' on tpu; got {cfg}")
    C = cfg.chunk_size
    Tp = -(-T // C) * C

    def rows(x):  # [B,T,H,...] -> [B*H, Tp, D] (zero tail: k = 0, beta = 0, g = 0 is a no-op)
        x = x if x.ndim == 4 else x[..., None]
        x = jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])
        return jnp.moveaxis(x, 2, 1).reshape(B * H, Tp, x.shape[-1])

    h0 = (jnp.zeros((B * H, K, V), f32) if initial_state is None
          else initial_state.astype(f32).reshape(B * H, K, V))
    o, ht = _kda_core(rows(q), rows(k), rows(v), rows(g), rows(beta), h0, scale, cfg,
                      bool(interpret))
    o = jnp.moveaxis(o.reshape(B, H, Tp, V), 1, 2)[:, :T]  # [B,T,H,V]
    return o, (ht.reshape(B, H, K, V) if output_final_state else None)
