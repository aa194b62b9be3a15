"""MXFP4: quantization rule vs an independent numpy OCP implementation, exact decode, layout,
matmul kernels (XLA reference and both Pallas kernel families in interpret mode) vs
x @ dequantize(w).T, grouped (MoE) matmuls vs per-expert loops, STE fake-quant gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import (
    MXFP4,
    BlockConfig,
    arg_specs,
    block_config,
    check_finite,
    config,
    dequantize,
    fake_quant,
    grouped_mxfp4_matmul,
    mxfp4_matmul,
    nonfinite_blocks,
    pallas_gpu,
    pallas_tpu,
    quantize,
)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------------------------------------
# independent numpy oracle of OCP MX v1.0 (float64 arithmetic, no bit tricks)
# ------------------------------------------------------------------------------------------------


def np_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., n] (any float dtype) -> (blocks uint8 [..., n/32, 16], scales uint8 [..., n/32])."""
    x = np.asarray(x, np.float64)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    finite = np.isfinite(xb).all(-1)
    amax = np.where(np.isfinite(xb), np.abs(xb), 0).max(-1)
    _, e = np.frexp(amax)  # amax = f * 2**e, f in [0.5, 1): floor(log2 amax) = e - 1
    shared = np.where(amax > 0, e - 1 - 2, -127)
    shared = np.clip(shared, -127, 127)
    y = np.abs(np.where(np.isfinite(xb), xb, 0)) / np.ldexp(1.0, shared)[..., None]
    dist = np.abs(y[..., None] - E2M1)  # [..., 32, 8]
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    # nearest; on a tie the even code (mantissa bit 0) wins
    code = np.where(
        tied.sum(-1) > 1, np.argmax(tied & (np.arange(8) % 2 == 0), -1), np.argmax(tied, -1)
    )
    code = code + 8 * np.signbit(xb)
    code = np.where(finite[..., None], code, 0).astype(np.uint8)
    scales = np.where(finite, shared + 127, 255).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales


def np_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 values [..., n]; NaN for scale 0xFF."""
    blocks = np.asarray(blocks)
    codes = np.stack([blocks & 0xF, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)
    mag = E2M1[codes & 7] * np.where(codes >= 8, -1.0, 1.0)  # code 8 -> -0.0
    s = np.asarray(scales).astype(np.int64)
    vals = mag * np.ldexp(1.0, s - 127)[..., None]
    vals = np.where((s == 255)[..., None], np.nan, vals)
    return vals.reshape(*vals.shape[:-2], -1)


def assert_same_quant(x):
    t = quantize(jnp.asarray(x))
    blocks, scales = np_quantize(np.asarray(jnp.asarray(x).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(t.scales), scales)
    np.testing.assert_array_equal(np.asarray(t.blocks), blocks)
    return t


# ------------------------------------------------------------------------------------------------
# quantize / dequantize
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["bits", "table"])
def test_dequantize_exact_every_code_and_scale_byte(path):
    # all 16 codes x all 256 scale bytes ("bits" path), or only the bytes the table path takes
    scales = np.arange(256, dtype=np.uint8)
    if path == "table":
        scales = scales[(scales >= 2) & ((scales <= 252) | (scales == 255))]
    codes = np.arange(32, dtype=np.uint8) % 16
    blocks = np.broadcast_to(codes[0::2] | (codes[1::2] << 4), (len(scales), 16)).astype(np.uint8)
    t = MXFP4(blocks=jnp.asarray(blocks[:, None, :]), scales=jnp.asarray(scales[:, None]))
    want = np_dequantize(blocks[:, None, :], scales[:, None])  # [S, 32] float64
    with np.errstate(over="ignore"):
        want32 = want.astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(dequantize(t, dtype).astype(jnp.float32))
        assert got.shape == (len(scales), 32)
        nan = np.isnan(want32)
        np.testing.assert_array_equal(np.isnan(got), nan)
        # bitwise (keeps -0.0, subnormals at 2**-127 / 2**-128, +-inf beyond float32)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want32[~nan].view(np.uint32))


def test_lane_dense_form_matches_bit_decoder_on_every_byte():
    # TPU form (every intermediate [..., K]) vs the bit-level decoder: all 256 bytes under each
    # scale byte, bitwise; the table path on the bytes it takes, the bits path and dispatch on all
    from pallas_kernels import backend
    from pallas_kernels.mxfp4 import reference as ref

    scales = np.arange(256, dtype=np.uint8)
    blocks = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 16, 16))
    t = MXFP4(blocks=jnp.asarray(blocks), scales=jnp.asarray(np.repeat(scales[:, None], 16, 1)))
    table = (scales >= 2) & ((scales <= 252) | (scales == 255))
    u = {jnp.float32: jnp.uint32, jnp.bfloat16: jnp.uint16}
    for dtype in (jnp.float32, jnp.bfloat16):
        bits = jax.lax.bitcast_convert_type  # NaN payloads compared too
        want = bits(ref._bits_to_dtype(ref.decode_bits_f32(ref.unpack_codes(t.blocks),
                                                           t.scales[..., None]), dtype), u[dtype])
        want = np.asarray(want).reshape(256, 512)
        got_bits = ref._dequantize_bits_lane_dense(t, dtype)
        got_lut = ref._dequantize_lut_lane_dense(t, dtype)
        assert got_bits.shape == got_lut.shape == (256, 512)  # [..., K], no pair axis
        np.testing.assert_array_equal(np.asarray(bits(got_bits, u[dtype])).reshape(256, 512), want)
        np.testing.assert_array_equal(
            np.asarray(bits(got_lut, u[dtype])).reshape(256, 512)[table], want[table])
        with backend.target_platform("tpu"):
            got = dequantize(t, dtype)
        np.testing.assert_array_equal(np.asarray(bits(got, u[dtype])).reshape(256, 512), want)


def test_grid_round_trip_is_exact_and_canonical():
    rng = np.random.default_rng(0)
    nblk = 512
    codes = rng.integers(0, 16, size=(nblk, 32)).astype(np.uint8)
    codes[np.arange(nblk), rng.integers(0, 32, nblk)] = 0  # some zeros
    codes[np.arange(nblk), rng.integers(0, 32, nblk)] = rng.choice([6, 7, 14, 15], nblk)
    scales = rng.integers(2, 253, size=(nblk,)).astype(np.uint8)  # quantize's output range
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    t = MXFP4(
        blocks=jnp.asarray(blocks.reshape(8, 64, 16)), scales=jnp.asarray(scales.reshape(8, 64))
    )
    for dtype in (jnp.float32, jnp.bfloat16):
        x = dequantize(t, dtype)
        t2 = quantize(x)
        # a block holding a code of magnitude 4 or 6 pins the scale: same bytes back
        np.testing.assert_array_equal(np.asarray(t2.scales), np.asarray(t.scales))
        np.testing.assert_array_equal(np.asarray(t2.blocks), np.asarray(t.blocks))
        np.testing.assert_array_equal(
            np.asarray(dequantize(t2, jnp.float32)), np.asarray(x.astype(jnp.float32))
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_quantize_random_matches_numpy_oracle(dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4, 128)) * np.exp2(rng.integers(-20, 20, (6, 4, 1)))
    if dtype == "float16":
        x = x * 2.0**-10
    t = assert_same_quant(jnp.asarray(x, dtype))
    assert t.blocks.shape == (6, 4, 4, 16) and t.scales.shape == (6, 4, 4)
    assert t.shape == (6, 4, 128) and t.nbytes == 6 * 4 * 4 * 17


def _block(vals, fill=0.0):
    b = np.full(32, fill, np.float64)
    b[: len(vals)] = vals
    return b


def test_quantize_adversarial_blocks_match_numpy_oracle():
    ties = [2.5, 5.0, 0.25, 0.75, 1.25, 1.75, 3.5, -2.5, -5.0, -0.25, 6.0]
    blocks = [
        np.zeros(32),  # all zero
        _block([-0.0, 0.0, -0.0]),  # signed zeros only
        _block([1e30, 1.0, -3e29, 7e28]),  # one huge value: small ones flush to 0
        _block(ties),  # amax 6 -> scale 2**0: exact ties
        _block(np.array(ties) * 2.0**-60),  # same ties at another scale
        _block([7.5, 6.9, 7.99, -7.0, 5.01, 4.99]),  # saturation beyond 6 * scale, near 5
        _block([0.24, 0.26, 0.74, 0.76, 4.0]),  # around the 0.25 / 0.75 midpoints
        # amax normal, the rest subnormal: exact although XLA:CPU flushes subnormal floats
        _block([2.0**-126 * 1.5, 2.0**-127, 2.0**-128, -(2.0**-149)]),
        _block([2.0**-130, -(2.0**-140), 2.0**-149]),  # all subnormal: scale clamps to 2**-127
        _block([2.0**-124, 2.0**-126, 2.0**-127 * 3]),  # E8M0 lower clamp edge
        _block([3.4e38, -3.0e38, 1e38]),  # near float32 max
        _block([np.nan, 1.0]),
        _block([1.0, np.inf]),
        _block([-np.inf, 0.0]),
        np.full(32, -1.0),
    ]
    x = np.stack(blocks).astype(np.float32)
    t = assert_same_quant(jnp.asarray(x))
    s = np.asarray(t.scales)[:, 0]
    # spell out the documented rules (not just agreement with the oracle)
    assert s[0] == 0 and s[1] == 0 and s[8] == 0  # zero / subnormal amax: 2**-127
    assert s[3] == 127 and list(s[11:14]) == [255, 255, 255]
    deq = np.asarray(dequantize(t, jnp.float32))
    np.testing.assert_array_equal(deq[3, :11], [2, 4, 0, 1, 1, 2, 4, -2, -4, -0.0, 6])
    np.testing.assert_array_equal(deq[5, :6], [6, 6, 6, -6, 6, 4])
    assert np.signbit(deq[1, :3]).tolist() == [True, False, True]
    assert np.isnan(deq[11:14]).all() and int(nonfinite_blocks(t)) == 3
    np.testing.assert_array_equal(deq[2, :4], [2.0**99 * 1.5, 0, -(2.0**98), 2.0**96])
    np.testing.assert_array_equal(deq[7, :4], np.float32([3 * 2.0**-127, 2.0**-127, 2.0**-128, 0]))
    assert s[7] == 0 and np.signbit(deq[7, 3])


def test_quantize_under_jit_and_axis():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 3, 5)).astype(np.float32)
    t = jax.jit(lambda a: quantize(a, axis=0))(x)
    assert t.shape == (3, 5, 64)  # the blocked axis moved last
    b, s = np_quantize(np.moveaxis(x, 0, -1))
    np.testing.assert_array_equal(np.asarray(t.blocks), b)
    np.testing.assert_array_equal(np.asarray(t.scales), s)
    back = dequantize(t, jnp.float32, axis=0)
    assert back.shape == x.shape
    np.testing.assert_array_equal(np.asarray(back), np.moveaxis(np_dequantize(b, s), -1, 0))


def test_layout_low_nibble_is_even_element():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 31] = 1.0, 2.0, -0.5, -6.0  # amax 6 -> scale byte 127
    t = quantize(jnp.asarray(x))
    b = np.asarray(t.blocks)[0, 0]
    assert int(np.asarray(t.scales)[0, 0]) == 127
    assert b[0] == 0x42  # element 0: 1.0 = code 2 (low), element 1: 2.0 = code 4 (high)
    assert b[1] == 0x09  # element 2: -0.5 = code 9 (low), element 3: 0
    assert b[15] == 0xF0  # element 30: 0 (low), element 31: -6 = code 15 (high)
    hand = MXFP4(
        blocks=jnp.asarray(np.array([[[0x21] + [0] * 15]], np.uint8)),
        scales=jnp.asarray(np.array([[128]], np.uint8)),
    )
    np.testing.assert_array_equal(np.asarray(dequantize(hand, jnp.float32))[0, :3], [1.0, 2.0, 0])


def test_input_errors_and_check_finite():
    with pytest.raises(ValueError, match="pad"):
        quantize(jnp.ones((4, 48)))
    with pytest.raises(TypeError):
        quantize(jnp.ones((4, 32), jnp.int32))
    check_finite(jnp.ones((2, 32)))
    with pytest.raises(ValueError, match="non-finite"):
        check_finite(jnp.ones((2, 32)).at[1, 3].set(jnp.inf))
    w = quantize(jnp.ones((8, 64)))
    with pytest.raises(ValueError, match="contraction"):
        mxfp4_matmul(jnp.ones((2, 32)), w, impl="xla")


# ------------------------------------------------------------------------------------------------
# matmuls
# ------------------------------------------------------------------------------------------------

IMPLS = [("xla", None), ("pallas", "gpu"), ("pallas", "tpu")]


def _interp(interpret, kernel):
    # a kernel family foreign to the platform runs interpreted (no skips on GPU/TPU machines)
    return interpret or (kernel is not None and kernel != jax.default_backend())


def _cfg(cfg, kernel, interpret):
    """The spec's pinned tiles, or None (heuristics) where they cannot compile: the pinned tiles
    are sized for interpret mode (Mosaic wants block_k == K or a multiple of 4096)."""
    if cfg is None or interpret:
        return cfg
    family = kernel or ("tpu" if jax.default_backend() == "tpu" else "gpu")
    try:
        config.check_config(cfg, backend=family)
    except ValueError:
        return None
    return cfg if family == "gpu" else None


def _oracle(x, w):
    wf = np_dequantize(np.asarray(w.blocks), np.asarray(w.scales))
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    return xf @ wf.T, np.abs(xf) @ np.abs(wf).T


def _check(y, x, ref, bound):
    assert y.dtype == x.dtype
    y = np.asarray(y.astype(jnp.float32), np.float64)
    # f32 accumulation error plus (bf16 outputs) one rounding of the result
    out_eps = 2.0**-8 if x.dtype == jnp.bfloat16 else 0.0
    np.testing.assert_array_less(np.abs(y - ref), 1e-5 * bound + out_eps * np.abs(ref) + 1e-30)


@pytest.mark.parametrize("impl,kernel", IMPLS)
@pytest.mark.parametrize("spec", arg_specs.MATMUL_SPECS, ids=lambda s: s.name)
def test_mxfp4_matmul(spec, impl, kernel, interpret):
    x, w = arg_specs.make_matmul_args(spec)
    y = mxfp4_matmul(
        x, w, impl=impl, kernel=kernel, interpret=_interp(interpret, kernel),
        config=_cfg(spec.config, kernel, _interp(interpret, kernel)),
    )
    assert y.shape == (*spec.lead, spec.m, spec.n)
    ref, bound = _oracle(x, w)
    _check(y, x, ref, bound)


@pytest.mark.parametrize("impl,kernel", IMPLS)
def test_mxfp4_matmul_nan_block_propagates(impl, kernel, interpret):
    x = jnp.ones((8, 64), jnp.float32)
    wf = jnp.ones((32, 64)).at[5, 40].set(jnp.nan)
    y = np.asarray(
        mxfp4_matmul(
            x, quantize(wf), impl=impl, kernel=kernel, interpret=_interp(interpret, kernel)
        )
    )
    assert np.isnan(y[:, 5]).all() and np.isfinite(np.delete(y, 5, axis=1)).all()


@pytest.mark.parametrize("impl,kernel", IMPLS)
def test_mxfp4_matmul_grad_x(impl, kernel, interpret):
    x, w = arg_specs.make_matmul_args(arg_specs.MatmulSpec("g", m=8, n=32, k=64, dtype="float32"))
    c = jnp.asarray(np.random.default_rng(3).standard_normal((8, 32)), jnp.float32)
    f = lambda a: jnp.sum(
        c * mxfp4_matmul(a, w, impl=impl, kernel=kernel, interpret=_interp(interpret, kernel))
    )
    g = np.asarray(jax.jit(jax.grad(f))(x))
    wf = np_dequantize(np.asarray(w.blocks), np.asarray(w.scales))
    np.testing.assert_allclose(g, np.asarray(c, np.float64) @ wf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,kernel", IMPLS)
@pytest.mark.parametrize("spec", arg_specs.GROUPED_SPECS, ids=lambda s: s.name)
def test_grouped_mxfp4_matmul(spec, impl, kernel, interpret):
    x, w, gs = arg_specs.make_grouped_args(spec)
    y = grouped_mxfp4_matmul(
        x, w, gs, impl=impl, kernel=kernel, interpret=_interp(interpret, kernel),
        config=_cfg(spec.config, kernel, _interp(interpret, kernel)),
    )
    assert y.shape == (spec.m, spec.n) and y.dtype == x.dtype
    # per-expert loop in numpy (float64)
    xf = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    wf = np_dequantize(np.asarray(w.blocks), np.asarray(w.scales))
    ref = np.zeros((spec.m, spec.n))
    bound = np.zeros_like(ref)
    start = 0
    for e, g in enumerate(spec.group_sizes):
        ref[start : start + g] = xf[start : start + g] @ wf[e].T
        bound[start : start + g] = np.abs(xf[start : start + g]) @ np.abs(wf[e]).T
        start += g
    _check(y, x, ref, bound)
    np.testing.assert_array_equal(np.asarray(y[sum(spec.group_sizes) :], np.float32), 0)


def test_grouped_grad_x_pallas_matches_xla(interpret):
    spec = arg_specs.GROUPED_SPECS[1]
    x, w, gs = arg_specs.make_grouped_args(spec)
    c = jnp.asarray(np.random.default_rng(4).standard_normal((spec.m, spec.n)), jnp.float32)

    def grad(impl):
        f = lambda a: jnp.sum(
            c * grouped_mxfp4_matmul(a, w, gs, impl=impl, interpret=interpret,
                                     config=_cfg(spec.config, None, interpret))
        )
        return np.asarray(jax.grad(f)(x))

    np.testing.assert_allclose(grad("pallas"), grad("xla"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_accelerators(platform):
    """Compiled (non-interpret) kernels lower to Triton / Mosaic IR with the heuristic tiles,
    cross-platform from this host; decode- and prefill-shaped, ragged K (2880 = 5.6 x 512)."""
    mod = pallas_gpu if platform == "cuda" else pallas_tpu
    backend = "gpu" if platform == "cuda" else "tpu"
    for m, n, k, e in [(8, 512, 2880, 4), (512, 256, 1024, 4)]:
        cfg = block_config(m, n, k, backend=backend)
        x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
        b = jax.ShapeDtypeStruct((n, k // 32, 16), jnp.uint8)
        s = jax.ShapeDtypeStruct((n, k // 32), jnp.uint8)
        traced = mod.matmul.trace(x, b, s, cfg=cfg, interpret=False)
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "mxfp4_matmul" in text
        b = jax.ShapeDtypeStruct((e, n, k // 32, 16), jnp.uint8)
        s = jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8)
        g = jax.ShapeDtypeStruct((e,), jnp.int32)
        traced = mod.grouped_matmul.trace(x, b, s, g, cfg=cfg, interpret=False)
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "grouped_mxfp4_matmul" in text


def test_block_config_heuristics():
    dec = block_config(8, 2048, 2048, backend="gpu")
    pre = block_config(2048, 2048, 2048, backend="gpu")
    assert dec == config.CONFIGS["gpu"]["decode"] and pre == config.CONFIGS["gpu"]["prefill"]
    config.check_config(dec, backend="gpu")
    config.check_config(pre, backend="gpu")
    tpu = block_config(8, 2048, 2048, backend="tpu")
    assert (tpu.block_m, tpu.block_k) == (8, 2048)
    assert block_config(2048, 4096, 16384, backend="tpu").block_k == 4096
    with pytest.raises(ValueError):
        config.check_config(BlockConfig(8, 16, 32), backend="gpu")


# ------------------------------------------------------------------------------------------------
# QAT fake quant
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [-1, 0])
def test_fake_quant_forward_and_straight_through_gradient(axis):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((64, 96)) * 3.0, jnp.float32)
    c = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    y = fake_quant(x, axis)
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(dequantize(quantize(x, axis=axis), jnp.float32, axis=axis))
    )
    assert not np.array_equal(np.asarray(y), np.asarray(x))
    g = jax.jit(jax.grad(lambda a: jnp.sum(c * fake_quant(a, axis))))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))  # identity, not quantized
    gb = jax.grad(
        lambda a: jnp.sum(c.astype(jnp.bfloat16) * fake_quant(a, axis)).astype(jnp.float32)
    )(x.astype(jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gb), np.asarray(c.astype(jnp.bfloat16)))
