"""MXFP4 (OCP Microscaling Formats v1.0, FP4 E2M1 elements, E8M0 shared scale): pure-JAX oracle.

Everything here is exact: integer bit manipulation on the IEEE-754 encodings (or table lookups times
normal powers of two, which cannot round), so results do not depend on the
backend's float behaviour (XLA:CPU flushes subnormals to zero, `exp2` is off by
~2e-6 on CPU, `astype(float8_e8m0fnu)` rounds to nearest instead of OCP's floor).

Storage layout (the gpt-oss / Hugging Face checkpoint layout)
-------------------------------------------------------------
A tensor with logical shape ``[..., n]`` quantized along its last axis in 32-element blocks is

    blocks: uint8 [..., n // 32, 16]   two E2M1 codes per byte; the LOW nibble holds the EVEN
                                       element (2j), the HIGH nibble the odd element (2j + 1)
    scales: uint8 [..., n // 32]       E8M0 exponent, bias 127: scale = 2**(scales - 127);
                                       0xFF is NaN (the whole block decodes to NaN)

E2M1 code (4 bits) = sign << 3 | exponent (2 bits) << 1 | mantissa (1 bit); magnitudes by code
0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantization rule (`quantize`), per 32-element block, as in OCP MX v1.0:
    shared exponent  X = floor(log2(amax)) - 2      (2 = emax of E2M1; floor(log2) read from the
                                                    exponent bits of amax, never from log2)
    X is clamped to E8M0's range [-127, 127]; the only clamp that can occur for float32/bf16
    input is the lower one: amax < 2**-125 (including subnormal amax) gives X = -127 (byte 0x00)
    and the elements are then rounded on that finer-than-needed grid (tiny values become 0).
    element          q_i = E2M1(x_i / 2**X): round to nearest, ties to even code, saturate at +-6
    (x_i / 2**X is formed exactly from the bits, so subnormal inputs quantize correctly even
    where the hardware flushes them).
Explicit rules:
    * all-zero block: amax = 0, floor(log2 0) = -inf is clamped, so the scale byte is 0x00
      (2**-127) and all codes are 0. (Same bytes as an all-zero region of a zero-initialised
      checkpoint; dequantizes to exact zeros.)
    * signed zero: the sign bit is copied from the input, so -0.0, or a negative value that
      rounds to zero, encodes as code 0x8 (-0), as an IEEE cast would.
    * NaN or +-Inf anywhere in a block: the block's scale byte is 0xFF (E8M0 NaN, as in the OCP
      spec) and its codes are 0; `dequantize` turns the whole block into NaN. Under `jit` a
      trace-time error is impossible, so non-finite input is never silently turned into a finite
      value. Use `check_finite(x)` (eager) to raise instead, or `nonfinite_blocks(t)` to count.
    * float16 / bfloat16 / float32 input is exact; float64 input is rejected (would need a second
      rounding).

Reference matmuls (`mxfp4_matmul_reference`, `grouped_mxfp4_matmul_reference`) dequantize and
contract with float32 accumulation; they are the correctness oracles and the CPU default path.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import backend as _backend

BLOCK = 32  # elements per shared scale (OCP MX v1.0)
PACKED = BLOCK // 2  # bytes per block
SCALE_BIAS = 127
SCALE_NAN = 0xFF
E2M1_EMAX = 2  # floor(log2(6))
E2M1_MAX = 6.0
# Magnitudes of E2M1 codes 0..7 (codes 8..15 are the negatives).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@flax.struct.dataclass
class MXFP4:
    """An MXFP4 tensor quantized along its LAST logical axis (see module docstring for layout).

    A pytree with two uint8 leaves, so it passes through jit / vmap / device_put / orbax as is.

    Attributes:
      blocks: uint8 [..., n // 32, 16], low nibble = even element.
      scales: uint8 [..., n // 32], E8M0 (bias 127, 0xFF = NaN).
    """

    blocks: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape ``[..., n]``."""
        return tuple(self.scales.shape[:-1]) + (self.scales.shape[-1] * BLOCK,)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Storage bytes: 0.5 per element + 1 per 32 elements = 4.25 bits per element."""
        return math.prod(self.blocks.shape) + math.prod(self.scales.shape)

    def __getitem__(self, idx) -> MXFP4:
        """Index the leading (non-quantized) axes, e.g. ``w[e]`` for one expert."""
        return MXFP4(blocks=self.blocks[idx], scales=self.scales[idx])


def _validate(t: MXFP4) -> None:
    b, s = t.blocks, t.scales
    if b.dtype != jnp.uint8 or s.dtype != jnp.uint8:
        raise TypeError(f"MXFP4 leaves must be uint8, got blocks {b.dtype}, scales {s.dtype}")
    if b.ndim < 2 or b.shape[-1] != PACKED or tuple(b.shape[:-1]) != tuple(s.shape):
        raise ValueError(
            f"MXFP4 layout is blocks [..., n/32, {PACKED}] and scales [..., n/32]; got blocks "
            f"{tuple(b.shape)} and scales {tuple(s.shape)}"
        )


# ------------------------------------------------------------------------------------------------
# bit helpers
# ------------------------------------------------------------------------------------------------


def _float_bits_u32(x: jax.Array) -> jax.Array:
    """IEEE float32 bit pattern of x (exact for float16 / bfloat16 / float32 / float8 inputs)."""
    if x.dtype == jnp.float32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype == jnp.bfloat16:  # bf16 is the top half of f32: no conversion, no flushing
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    if x.dtype == jnp.float64:
        raise TypeError("quantize: float64 input would be rounded twice; pass x.astype(float32)")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize: expected a floating array, got {x.dtype}")
    # float16 / float8: every value is a normal float32 (smaller exponent range), exact.
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _pow2_f32(k: jax.Array) -> jax.Array:
    """2**k as float32 for integer k, built from exponent bits (k clipped to [-126, 127])."""
    k = jnp.clip(k, -126, 127).astype(jnp.int32)
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def e2m1_round_code(y: jax.Array) -> jax.Array:
    """E2M1 magnitude code (0..7) of y >= 0: round to nearest, ties to even code, saturate at 6.

    Midpoints and tie directions (the even code wins a tie): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; everything above 5 saturates to 6.
    """
    c = (
        (y > 0.25).astype(jnp.uint8)
        + (y >= 0.75)
        + (y > 1.25)
        + (y >= 1.75)
        + (y > 2.5)
        + (y >= 3.5)
        + (y > 5.0)
    )
    return c.astype(jnp.uint8)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., 2m] (values 0..15) -> bytes [..., m]; low nibble = even element."""
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8)


def unpack_codes(blocks: jax.Array) -> jax.Array:
    """bytes [..., m] -> uint8 codes [..., 2m]; even element from the low nibble."""
    lo = blocks & 0xF
    hi = blocks >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)


def decode_bits_f32(codes: jax.Array, scale_bytes: jax.Array) -> jax.Array:
    """Exact float32 bit patterns (uint32) of E2M1 codes times 2**(scale_bytes - 127).

    codes and scale_bytes broadcast against each other. Subnormal results (scale 2**-127 or
    2**-126 with small codes) are built directly from bits; results beyond float32 (>= 2**128,
    only for scale bytes >= 0xFE) become +-Inf; scale byte 0xFF gives NaN.
    """
    codes = codes.astype(jnp.int32)
    sb = scale_bytes.astype(jnp.int32)
    sign = (codes >> 3) & 1
    m = codes & 7
    e2 = m >> 1
    mb = m & 1
    s = sb - SCALE_BIAS
    # magnitude = 2**E * (1 + mbit / 2): code 1 (0.5) is 2**(s - 1); codes 2..7 are
    # 2**(e2 - 1 + s) * (1 + mb / 2).
    big_e = jnp.where(e2 == 0, s - 1, e2 - 1 + s)
    mbit = jnp.where(e2 == 0, 0, mb)
    normal = ((big_e + 127) << 23) | (mbit << 22)
    shift = jnp.clip(-126 - big_e, 0, 31)  # E in {-127, -128}: subnormal float32
    subnormal = ((1 << 23) | (mbit << 22)) >> shift
    bits = jnp.where(big_e >= -126, normal, subnormal)
    bits = jnp.where(big_e >= 128, 0x7F800000, bits)
    bits = jnp.where(m == 0, 0, bits)
    bits = bits | (sign << 31)
    bits = jnp.where(sb == SCALE_NAN, 0x7FC00000, bits)
    return lax.bitcast_convert_type(bits, jnp.uint32)


def _bits_to_dtype(bits: jax.Array, dtype) -> jax.Array:
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return lax.bitcast_convert_type(bits, jnp.float32)
    if dtype == jnp.bfloat16:
        # Every decoded value has at most 2 significant bits, so the low 16 bits are zero and the
        # bf16 pattern is the top half: exact, including subnormals.
        return lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


# ------------------------------------------------------------------------------------------------
# quantize / dequantize
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("axis",))
def quantize(x: jax.Array, *, axis: int = -1) -> MXFP4:
    """Quantize x to MXFP4 in 32-element blocks along `axis` (OCP MX v1.0; rules in module doc).

    Args:
      x: float16 / bfloat16 / float32 array; ``x.shape[axis]`` must be a multiple of 32.
      axis: the blocked (contracted) axis. If it is not the last axis it is MOVED LAST: the result
        is ``quantize(jnp.moveaxis(x, axis, -1))``, i.e. logical shape
        ``x.shape[:axis] + x.shape[axis+1:] + (x.shape[axis],)``. ``dequantize(t, axis=axis)``
        moves it back.
    Returns:
      MXFP4 with blocks uint8 [..., n/32, 16] and scales uint8 [..., n/32].
    Raises (at trace time):
      ValueError if n is not a multiple of 32 (pad with zeros to a multiple of 32 first: zeros
      do not change any block's scale); TypeError for non-float or float64 input.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("quantize: need at least one axis")
    axis = axis % x.ndim
    if axis != x.ndim - 1:
        x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(
            f"quantize: the blocked axis has length {n}, not a multiple of {BLOCK}; pad it with "
            f"zeros to {-(-n // BLOCK) * BLOCK} (zeros do not change any block's scale)"
        )
    lead = x.shape[:-1]
    nb = n // BLOCK
    bits = _float_bits_u32(x).reshape(*lead, nb, BLOCK)  # [..., nb, 32]
    sign = (bits >> 31).astype(jnp.uint8)
    mag = bits & 0x7FFFFFFF
    amax = jnp.max(mag, axis=-1)  # [..., nb]; integer order == magnitude order, NaN/Inf on top
    amax_e = (amax >> 23).astype(jnp.int32)  # biased exponent, 0 for zero / subnormal amax
    nonfinite = amax_e == 255
    # E8M0 byte of X = floor(log2 amax) - 2 = (amax_e - 127) - 2, clamped at 2**-127 (byte 0).
    scale_b = jnp.clip(amax_e - E2M1_EMAX, 0, 254)  # finite input gives <= 252
    scales = jnp.where(nonfinite, SCALE_NAN, scale_b).astype(jnp.uint8)

    # y = |x| / 2**X formed exactly: |x| = sig * 2**(e - 23) with sig < 2**24 an integer.
    eb = (mag >> 23).astype(jnp.int32)
    sig = (mag & 0x7FFFFF).astype(jnp.int32) | jnp.where(eb > 0, 1 << 23, 0)
    e = jnp.maximum(eb, 1) - 127
    k = e - 23 - (scale_b[..., None] - SCALE_BIAS)  # <= -21 for finite blocks, so y < 8
    # A clipped k (< -126) only makes y larger while still < 2**-102, which rounds to 0 anyway.
    y = sig.astype(jnp.float32) * _pow2_f32(k)
    codes = e2m1_round_code(y) | (sign << 3)
    codes = jnp.where(nonfinite[..., None], 0, codes).astype(jnp.uint8)
    return MXFP4(blocks=pack_codes(codes), scales=scales)


def dequantize(t: MXFP4, dtype=jnp.bfloat16, *, axis: int = -1) -> jax.Array:
    """Exact decode of an MXFP4 tensor to `dtype` (logical shape, blocked axis placed at `axis`).

    Exact for float32 and bfloat16 outputs: every MXFP4 value is representable in both, including
    the subnormal ones (scale bytes 0x00 / 0x01), which are built from bits; values beyond float32
    range (only with scale bytes >= 0xFD, which `quantize` never produces from finite float32)
    become +-Inf; scale 0xFF gives NaN. Other dtypes are rounded from float32 by `astype`.

    Two paths, same values: when every scale byte is in [2, 252] (or 0xFF) a table lookup times
    the normal power-of-two scale (exact: no rounding, no subnormal product); otherwise the
    all-integer bit construction. `lax.cond` picks one at run time. Two layouts of both paths,
    bit-identical: on a TPU (`pallas_kernels.backend.platform()`, read when traced) the lane-dense
    form, whose every intermediate keeps the logical axis minor; elsewhere the byte -> value-pair
    form, which XLA:CPU runs up to 2x faster.
    """
    # TPU layouts pad the pair form's [..., nb, 16, 2] lookup to 128 lanes (docs/tpu_compile.md)
    return _dequantize(t, dtype, axis, _backend.platform() == "tpu")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _dequantize(t: MXFP4, dtype, axis: int, lane_dense: bool) -> jax.Array:
    _validate(t)
    cd = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
    sb = t.scales
    extreme = jnp.any((sb <= 1) | ((sb >= 253) & (sb != SCALE_NAN)))
    bits, lut = (_dequantize_bits_lane_dense, _dequantize_lut_lane_dense) if lane_dense else (
        _dequantize_bits, _dequantize_lut)
    out = lax.cond(extreme, lambda u: bits(u, cd), lambda u: lut(u, cd), t)
    out = out.astype(dtype).reshape(t.shape)
    if axis % out.ndim != out.ndim - 1:
        out = jnp.moveaxis(out, -1, axis)
    return out


def _scale_normal(t: MXFP4, cd) -> jax.Array:
    # 2**(s - 127) from the exponent bits; right for scale bytes in [1, 254], NaN for 0xFF
    if cd == jnp.bfloat16:
        scale = lax.bitcast_convert_type(t.scales.astype(jnp.uint16) << 7, jnp.bfloat16)
    else:
        scale = lax.bitcast_convert_type(t.scales.astype(jnp.uint32) << 23, jnp.float32)
    return jnp.where(t.scales == SCALE_NAN, jnp.nan, scale).astype(cd)  # [..., nb]


def _dequantize_bits(t: MXFP4, cd) -> jax.Array:
    codes = unpack_codes(t.blocks)  # [..., nb, 32]
    return _bits_to_dtype(decode_bits_f32(codes, t.scales[..., None]), cd)


# byte -> (even value, odd value), unscaled; code 8 is -0.0
_SIGNED_E2M1 = np.concatenate([E2M1_VALUES, -E2M1_VALUES])
_BYTE_PAIRS = np.stack([_SIGNED_E2M1[np.arange(256) & 15], _SIGNED_E2M1[np.arange(256) >> 4]], -1)


def _dequantize_lut(t: MXFP4, cd) -> jax.Array:
    # valid only for scale bytes in [2, 252] or 0xFF: the scale and every product are normal
    pairs = jnp.take(
        jnp.asarray(_BYTE_PAIRS, cd), t.blocks.astype(jnp.int32), axis=0, mode="clip"
    )  # [..., nb, 16, 2]
    return pairs.reshape(*t.scales.shape, BLOCK) * _scale_normal(t, cd)[..., None]


def _codes_lane_dense(blocks: jax.Array) -> jax.Array:
    """bytes [..., nb, 16] -> E2M1 codes [..., nb * 32] (uint8), the logical axis minor throughout.

    Each byte is repeated twice along K and shifted by the pattern [0, 4, 0, 4, ...] (low nibble =
    even element): no intermediate has the minor dimension of 2 of `unpack_codes` / the pair table.
    """
    half = blocks.shape[-2] * PACKED
    b = jnp.repeat(blocks.reshape(*blocks.shape[:-2], half), 2, axis=-1)  # [..., K]
    shift = jnp.tile(jnp.array([0, 4], jnp.uint8), half)  # [K]
    return (b >> shift) & 0xF  # [..., K]


def _dequantize_bits_lane_dense(t: MXFP4, cd) -> jax.Array:
    codes = _codes_lane_dense(t.blocks)  # [..., K]
    sb = jnp.repeat(t.scales, BLOCK, axis=-1)  # [..., K]
    # Without the barrier XLA hoists the scale-only integer ops above the repeat and the TPU
    # compiler materialises them as int32 [..., nb, 32] arrays (5.3 GB against 0.95 GB of uint8
    # at 125 x 512 x 7168).
    codes, sb = lax.optimization_barrier((codes, sb))
    return _bits_to_dtype(decode_bits_f32(codes, sb), cd)  # [..., K]


def _dequantize_lut_lane_dense(t: MXFP4, cd) -> jax.Array:
    # valid only for scale bytes in [2, 252] or 0xFF: the scale and every product are normal
    codes = _codes_lane_dense(t.blocks)  # [..., K]
    vals = jnp.take(jnp.asarray(_SIGNED_E2M1, cd), codes.astype(jnp.int32), axis=0, mode="clip")
    return vals * jnp.repeat(_scale_normal(t, cd), BLOCK, axis=-1)  # [..., K]


def check_finite(x) -> None:
    """Eager guard: raise ValueError if x holds NaN/Inf (which `quantize` maps to NaN blocks).

    Not jittable (it reads values); call it on weights before quantizing them.
    """
    a = np.asarray(jax.device_get(x))
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"check_finite: {int(bad.sum())} non-finite value(s) of {a.size} (first at index "
            f"{first}: {a[first]}); quantize would encode their blocks with the NaN scale 0xFF"
        )


def nonfinite_blocks(t: MXFP4) -> jax.Array:
    """Number of blocks with the NaN scale byte 0xFF (jittable)."""
    return jnp.sum(t.scales == SCALE_NAN)


# ------------------------------------------------------------------------------------------------
# reference matmuls (oracles)
# ------------------------------------------------------------------------------------------------


def _compute_dtype(x_dtype):
    # bf16 activations meet bf16 weights (exact decode) in a bf16 x bf16 -> f32 dot; everything
    # else runs in float32.
    return jnp.bfloat16 if jnp.dtype(x_dtype) == jnp.bfloat16 else jnp.float32


def _check_matmul_shapes(x: jax.Array, w: MXFP4, w_ndim: int, what: str) -> None:
    _validate(w)
    if w.ndim != w_ndim:
        raise ValueError(f"{what}: w must have logical rank {w_ndim}, got shape {w.shape}")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(
            f"{what}: contraction mismatch, x {tuple(x.shape)} vs w logical {w.shape} "
            f"(w is [.., N, K] quantized along K)"
        )


@jax.jit
def mxfp4_matmul_reference(x: jax.Array, w: MXFP4) -> jax.Array:
    """x [..., K] @ dequantize(w [N, K]).T -> [..., N] in x.dtype, float32 accumulation."""
    _check_matmul_shapes(x, w, 2, "mxfp4_matmul")
    cd = _compute_dtype(x.dtype)
    wd = dequantize(w, cd)  # [N, K]
    y = jnp.einsum("...k,nk->...n", x.astype(cd), wd, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


@jax.jit
def grouped_mxfp4_matmul_reference(x: jax.Array, w: MXFP4, group_sizes: jax.Array) -> jax.Array:
    """Grouped (MoE) matmul: rows sorted by expert.

    x [M, K]; w logical [E, N, K]; group_sizes [E] int32 with sum <= M. Row r belongs to expert
    e iff offsets[e] <= r < offsets[e] + group_sizes[e] (offsets = exclusive cumsum); rows at or
    past sum(group_sizes) give 0. Output [M, N] in x.dtype, float32 accumulation.
    Uses `lax.ragged_dot` (a masked loop over groups on CPU: fine as an oracle, not fast).
    """
    _check_matmul_shapes(x, w, 3, "grouped_mxfp4_matmul")
    if x.ndim != 2 or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_mxfp4_matmul: x must be [M, K] and group_sizes [E]; got x {tuple(x.shape)}, "
            f"group_sizes {tuple(group_sizes.shape)}, w {w.shape}"
        )
    cd = _compute_dtype(x.dtype)
    wd = jnp.swapaxes(dequantize(w, cd), 1, 2)  # [E, K, N]
    y = lax.ragged_dot(
        x.astype(cd), wd, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
    )
    # ragged_dot leaves rows past sum(group_sizes) unspecified on some backends: zero them.
    valid = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], y, 0).astype(x.dtype)
