"""Helpers shared by the MXFP4 Pallas kernels: in-kernel decode and grouped-matmul metadata.

In-kernel decode (no gathers, no interleave): the packed weight tile w [tn, tk/2] uint8 holds the
even K elements in the low nibbles and the odd ones in the high nibbles. Instead of interleaving
the decoded nibbles back into K order, the wrapper splits the activations into x[:, 0::2] and
x[:, 1::2] (cheap, activations only) and the kernel computes

    y = x_even @ decode(lo).T + x_odd @ decode(hi).T          (f32 accumulation)

E2M1 nibble -> float32 bits with integer ops: magnitude code m = 2*e + b gives
    m >= 2: ((e + 126) << 23) | (b << 22)     (1 + b/2) * 2**(e - 1)
    m == 1: 126 << 23                          0.5
    m == 0: 0
and the sign bit moves from bit 3 to bit 31. The E8M0 byte s becomes the float32 2**(s - 127) as
the bit pattern s << 23 (0xFF -> quiet NaN, so a NaN block stays NaN). The kernels therefore
decode scale byte 0x00 (2**-127, a float32 subnormal) as 0: only blocks whose values are all
below 6 * 2**-127 ~ 3.5e-38 are affected, which the MXU would flush anyway. The XLA reference
(`reference.dequantize`) is exact there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mxfp4.reference import PACKED


def nibble_to_f32(code: jax.Array) -> jax.Array:
    """int32 E2M1 codes (0..15) -> float32 values (unscaled), integer ops + one bitcast."""
    m = code & 7
    e = m >> 1
    bits = jnp.where(m >= 2, ((e + 126) << 23) | ((m & 1) << 22), jnp.where(m == 1, 126 << 23, 0))
    bits = bits | ((code & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


def scale_to_f32(scale_bytes: jax.Array) -> jax.Array:
    """int32 E8M0 bytes -> float32 2**(s - 127); 0 -> 0.0 (see module doc), 255 -> NaN."""
    bits = jnp.where(scale_bytes == 255, 0x7FC00000, scale_bytes << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def expand_scales_reshape(s: jax.Array) -> jax.Array:
    """[tn, nb] -> [tn, nb * 16]: each scale repeated over its 16 packed bytes (broadcast+reshape).

    Used by the Triton and interpret kernels.
    """
    tn, nb = s.shape
    return jnp.broadcast_to(s[:, :, None], (tn, nb, PACKED)).reshape(tn, nb * PACKED)


def expand_scales_onehot(s_bytes: jax.Array) -> jax.Array:
    """[tn, nb] int32 bytes -> [tn, nb * 16] int32 via an exact one-hot matmul on the MXU.

    Mosaic TPU does not relayout a [tn, nb, 16] -> [tn, nb * 16] reshape (16 < 128 lanes), but a
    dot with a 0/1 matrix does the repeat: bytes 0..255 are exact in bf16 and each output is a
    single product, so the f32 result is the exact integer.
    """
    tn, nb = s_bytes.shape
    width = nb * PACKED
    rows = lax.broadcasted_iota(jnp.int32, (nb, width), 0)
    cols = lax.broadcasted_iota(jnp.int32, (nb, width), 1)
    onehot = ((cols >> 4) == rows).astype(jnp.bfloat16)
    # explicit DEFAULT: exact here (one bf16 product per output), and a global
    # jax_default_matmul_precision="highest" would otherwise ask Mosaic for an fp32-contract
    # bf16 matmul, which it rejects ("Bad lhs type")
    rep = jnp.dot(s_bytes.astype(jnp.bfloat16), onehot, preferred_element_type=jnp.float32,
                  precision=lax.Precision.DEFAULT)
    return rep.astype(jnp.int32)


def decode_tile(w_bytes: jax.Array, scale_rep: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Packed [tn, tk2] bytes + per-byte float32 scales [tn, tk2] -> (even, odd) weights in dtype.

    Products of an E2M1 value and a power of two are exact, so the cast to bf16 is exact too.
    """
    b = w_bytes.astype(jnp.int32)
    lo = nibble_to_f32(b & 0xF) * scale_rep
    hi = nibble_to_f32(b >> 4) * scale_rep
    return lo.astype(dtype), hi.astype(dtype)


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [n, k]^T with float32 accumulation: HIGHEST for f32 operands, DEFAULT (bf16
    products are exact in f32) otherwise, never the global default (see `expand_scales_onehot`)."""
    return lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT,
    )


def split_even_odd(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x[:, 0::2], x[:, 1::2]) in dtype, each [M, K/2]."""
    m, k = x.shape
    x2 = x.astype(dtype).reshape(m, k // 2, 2)
    return x2[:, :, 0], x2[:, :, 1]


# ------------------------------------------------------------------------------------------------
# grouped (MoE) metadata, computed in XLA from group_sizes
# ------------------------------------------------------------------------------------------------


def group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row ranges [start_e, end_e) of each group (sorted tokens)."""
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    return ends - gs, ends


def tile_group_ranges(group_sizes: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """For each M tile t (rows [t*tm, (t+1)*tm)): groups g_lo[t] <= g < g_hi[t] overlap it.

    Used by the GPU grouped kernel (one program per M tile loops over its groups). Empty groups
    inside the range contribute nothing (their row mask is empty).
    """
    starts, ends = group_bounds(group_sizes)
    num_tiles = -(-m // tm)
    a = jnp.arange(num_tiles, dtype=jnp.int32) * tm
    g_lo = jnp.searchsorted(ends, a, side="right").astype(jnp.int32)
    g_hi = jnp.searchsorted(starts, jnp.minimum(a + tm, m), side="left").astype(jnp.int32)
    g_hi = jnp.maximum(g_hi, g_lo)
    return g_lo, g_hi


def work_items(group_sizes: jax.Array, m: int, tm: int):
    """Flattened (M tile, group) work list for the TPU grouped kernel (megablox-style).

    Items are ordered by tile (non-decreasing) so that consecutive items sharing an output tile
    keep it resident. Every M tile appears at least once (tiles past sum(group_sizes) get the
    sentinel group E, an empty row range, so their output is zero-filled). Static length
    num_tiles + E - 1; the unused tail repeats the last tile with the sentinel group.

    Returns int32 arrays [L]: tile, group (E = none), first (1 at a tile's first item),
    wgroup (expert whose weights the item's BlockSpec fetches: its group, or the previous
    real one for sentinel items so the pipeline need not refetch).
    """
    e = group_sizes.shape[0]
    num_tiles = -(-m // tm)
    length = num_tiles + e - 1
    starts, ends = group_bounds(group_sizes)
    total = ends[-1]
    nonempty = group_sizes > 0
    t0 = starts // tm
    t1 = jnp.maximum(ends - 1, 0) // tm
    cnt = jnp.where(nonempty, t1 - t0 + 1, 0).astype(jnp.int32)
    cum = jnp.cumsum(cnt)
    n_group_items = cum[-1]
    i = jnp.arange(length, dtype=jnp.int32)
    g = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)  # group of item i (if real)
    g_c = jnp.minimum(g, e - 1)
    tile_g = t0[g_c] + (i - (cum[g_c] - cnt[g_c]))
    covered = -(-total // tm)  # tiles touched by some group
    tile_t = covered + (i - n_group_items)  # trailing, uncovered tiles
    is_group = i < n_group_items
    tile = jnp.where(is_group, tile_g, jnp.minimum(tile_t, num_tiles - 1)).astype(jnp.int32)
    group = jnp.where(is_group, g, e).astype(jnp.int32)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
    first = (tile != prev).astype(jnp.int32)
    last_real = jnp.maximum(jnp.minimum(n_group_items, length) - 1, 0)
    wgroup = jnp.where(is_group, g_c, jnp.where(n_group_items > 0, g_c[last_real], 0))
    return tile, group, first, wgroup.astype(jnp.int32)
