"""Public MXFP4 entry points (OCP MX v1.0 FP4): quantize / dequantize / matmuls / QAT fake-quant.

    quantize(x, *, axis=-1) -> MXFP4(blocks uint8 [..., n/32, 16], scales uint8 [..., n/32])
    dequantize(t, dtype=jnp.bfloat16, *, axis=-1) -> array          (exact)
    mxfp4_matmul(x, w, *, impl="auto", interpret=None) -> x @ dequantize(w).T
        x [..., K] bf16/f32, w logical [N, K] quantized along K -> [..., N] in x.dtype
    grouped_mxfp4_matmul(x, w, group_sizes, *, impl="auto", interpret=None) -> [M, N]
        MoE: x [M, K] sorted by expert, w logical [E, N, K], group_sizes [E] (sum <= M; rows past
        the sum are 0); equals a per-expert loop
    fake_quant(x, axis=-1) -> dequantize(quantize(x)) with an identity (straight-through) gradient
    check_finite(x), nonfinite_blocks(t)

impl (dispatch tables `MATMUL_DISPATCH`, `GROUPED_DISPATCH`; `pallas_kernels.dispatch`): "auto" =
the first of "pallas", "xla" that can take the call ("pallas" on GPU/TPU for f32 / bf16
activations, "xla" otherwise and on CPU; logged once); "xla" = the pure-JAX reference
(dequantize + dot / ragged_dot); "pallas" = the kernels (other activation dtypes raise
`dispatch.UnsupportedImpl` before tracing). kernel: "tpu" (Mosaic) or "gpu" (Triton) family, None
-> the platform's ("gpu" when interpreting on CPU); interpret=None -> interpret unless the platform
compiles that family (`pallas_kernels.backend`); `impl="pallas", kernel=K, interpret=False`
forces the compiled kernel (on a CPU host: lowering only, e.g. under jax.export). Gradients:
w.r.t. x on every path (the Pallas path through a custom_vjp whose backward is dy @ dequantize(w)
in XLA); MXFP4 weights are integer data and get no gradient (train them through `fake_quant`
on a float master copy). Layout and rounding rules: see `reference`.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backend as _backend
from pallas_kernels import dispatch
from pallas_kernels.mxfp4 import config as _config
from pallas_kernels.mxfp4.config import BlockConfig, block_config
from pallas_kernels.mxfp4.reference import (
    MXFP4,
    _check_matmul_shapes,
    _compute_dtype,
    check_finite,
    dequantize,
    grouped_mxfp4_matmul_reference,
    mxfp4_matmul_reference,
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

Impl = Literal["auto", "xla", "pallas"]
KernelBackend = Literal["tpu", "gpu"]


def _table(op: str) -> dispatch.OpTable:
    # The kernels mask or pad every M, N, K (K is a multiple of 32 in any MXFP4 tensor) and take
    # bf16 / f32 activations (pallas_gpu.py, pallas_tpu.py).
    return dispatch.OpTable(op, (
        dispatch.Impl("pallas", cannot=(dispatch.dtypes("float32", "bfloat16"),
                                        dispatch.multiples_of(32, "K", what=" (one MX block)")),
                      auto_skips=(dispatch.pallas_compiles_here,)),
        dispatch.Impl("xla")))


MATMUL_DISPATCH = _table("mxfp4.mxfp4_matmul")
GROUPED_DISPATCH = _table("mxfp4.grouped_mxfp4_matmul")


def _resolve(impl: str, interpret: bool | None, kernel: str | None,
             table: dispatch.OpTable = MATMUL_DISPATCH, **facts):
    """-> (impl, interpret, kernel): impl from `table` for the facts (dtype, K), kernel and
    interpret under the rule of `pallas_kernels.backend`.

    A compiled (interpret=False) kernel of a family foreign to the running platform is allowed:
    it only lowers (cross-platform `jax.export`); running it fails inside Pallas.
    """
    impl = table.resolve(impl, **facts)
    # Off-device (interpret) the Triton-style kernel is the cheaper one to interpret.
    kernel, interpret = _backend.resolve(kernel, interpret, cpu_default="gpu")
    return impl, interpret, kernel


def _kernels(kernel: str):
    if kernel == "tpu":
        from pallas_kernels.mxfp4 import pallas_tpu as mod
    else:
        from pallas_kernels.mxfp4 import pallas_gpu as mod
    return mod


def _config_for(m, n, k, kernel, interpret, cfg):
    if cfg is None:
        cfg = block_config(m, n, k, backend="interpret" if interpret else kernel)
    if not interpret:
        _config.check_config(cfg, backend=kernel)
    return cfg


def _no_grad_like(w: MXFP4):
    return jax.tree.map(lambda a: np.zeros(a.shape, dtype=jax.dtypes.float0), w)


def _dx(dy, w: MXFP4, x_dtype):
    cd = _compute_dtype(x_dtype)
    wd = dequantize(w, cd)  # [N, K]
    return jnp.einsum(
        "...n,nk->...k", dy.astype(cd), wd, preferred_element_type=jnp.float32
    ).astype(x_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _pallas_matmul(x2, w: MXFP4, kernel, interpret, cfg):
    return _kernels(kernel).matmul(x2, w.blocks, w.scales, cfg=cfg, interpret=interpret)


def _pallas_matmul_fwd(x2, w, kernel, interpret, cfg):
    return _pallas_matmul(x2, w, kernel, interpret, cfg), w


def _pallas_matmul_bwd(kernel, interpret, cfg, w, dy):
    return _dx(dy, w, dy.dtype), _no_grad_like(w)


_pallas_matmul.defvjp(_pallas_matmul_fwd, _pallas_matmul_bwd)


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "kernel", "config"))
def mxfp4_matmul(
    x: jax.Array,
    w: MXFP4,
    *,
    impl: Impl = "auto",
    interpret: bool | None = None,
    kernel: KernelBackend | None = None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """y = x @ dequantize(w).T with float32 accumulation, in x.dtype.

    Args:
      x: [..., K] bfloat16 or float32 activations.
      w: MXFP4 with logical shape [N, K] quantized along K (blocks [N, K/32, 16]).
      impl: "auto" | "xla" | "pallas" (module docstring).
      interpret: Pallas interpret mode; None -> True unless the platform compiles `kernel`.
      kernel: which Pallas kernel family, "tpu" (Mosaic-style) or "gpu" (Triton-style); None ->
        the platform's own (the "gpu" one when interpreting on CPU). Both run in interpret mode;
        a compiled foreign family only lowers (cross-platform export).
      config: tile sizes; None -> `config.block_config` heuristics.
    Returns:
      [..., N] in x.dtype.
    """
    _check_matmul_shapes(x, w, 2, "mxfp4_matmul")
    impl, interpret, kernel = _resolve(impl, interpret, kernel, MATMUL_DISPATCH, dtype=x.dtype,
                                       K=x.shape[-1])
    if impl == "xla":
        return mxfp4_matmul_reference(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    cfg = _config_for(x2.shape[0], w.shape[0], k, kernel, interpret, config)
    return _pallas_matmul(x2, w, kernel, interpret, cfg).reshape(*lead, w.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _pallas_grouped(x, w: MXFP4, group_sizes, kernel, interpret, cfg):
    return _kernels(kernel).grouped_matmul(
        x, w.blocks, w.scales, group_sizes, cfg=cfg, interpret=interpret
    )


def _pallas_grouped_fwd(x, w, group_sizes, kernel, interpret, cfg):
    return _pallas_grouped(x, w, group_sizes, kernel, interpret, cfg), (w, group_sizes)


def _pallas_grouped_bwd(kernel, interpret, cfg, res, dy):
    w, group_sizes = res
    cd = _compute_dtype(dy.dtype)
    wd = dequantize(w, cd)  # [E, N, K]
    dx = jax.lax.ragged_dot(
        dy.astype(cd), wd, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
    )
    valid = jnp.arange(dy.shape[0]) < jnp.sum(group_sizes)
    dx = jnp.where(valid[:, None], dx, 0).astype(dy.dtype)
    gs_ct = np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)
    return dx, _no_grad_like(w), gs_ct


_pallas_grouped.defvjp(_pallas_grouped_fwd, _pallas_grouped_bwd)


@functools.partial(jax.jit, static_argnames=("impl", "interpret", "kernel", "config"))
def grouped_mxfp4_matmul(
    x: jax.Array,
    w: MXFP4,
    group_sizes: jax.Array,
    *,
    impl: Impl = "auto",
    interpret: bool | None = None,
    kernel: KernelBackend | None = None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """MoE grouped matmul: out[r] = x[r] @ dequantize(w[e]).T for rows r of group e.

    Args:
      x: [M, K] bf16/f32, rows sorted by expert (group e owns rows
        [sum(group_sizes[:e]), sum(group_sizes[:e+1]))).
      w: MXFP4 with logical shape [E, N, K] quantized along K.
      group_sizes: [E] int32, sum <= M; rows past the sum give 0. Empty groups are fine.
      impl / interpret / kernel / config: as in `mxfp4_matmul`.
    Returns:
      [M, N] in x.dtype.
    """
    _check_matmul_shapes(x, w, 3, "grouped_mxfp4_matmul")
    impl, interpret, kernel = _resolve(impl, interpret, kernel, GROUPED_DISPATCH,
                                       dtype=x.dtype, K=x.shape[-1])
    if impl == "xla":
        return grouped_mxfp4_matmul_reference(x, w, group_sizes)
    if x.ndim != 2 or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_mxfp4_matmul: x must be [M, K] and group_sizes [E]; got x {tuple(x.shape)}, "
            f"group_sizes {tuple(group_sizes.shape)}, w {w.shape}"
        )
    cfg = _config_for(x.shape[0], w.shape[1], x.shape[1], kernel, interpret, config)
    return _pallas_grouped(x, w, group_sizes.astype(jnp.int32), kernel, interpret, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quant(x: jax.Array, axis: int = -1) -> jax.Array:
    """QAT fake quantization: forward dequantize(quantize(x, axis=axis), x.dtype, axis=axis),
    backward identity (straight-through estimator; the cotangent is never cast to float4).

    x.shape[axis] must be a multiple of 32. NaN/Inf blocks come out as NaN (see `reference`).
    """
    return dequantize(quantize(x, axis=axis), x.dtype, axis=axis)


def _fake_quant_fwd(x, axis):
    return fake_quant(x, axis), None


def _fake_quant_bwd(axis, _, g):
    return (g,)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)
