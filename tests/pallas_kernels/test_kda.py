"""KDA: chunked reference (autodiff and hand-written backward) vs the recurrent oracle, decode
parity, Pallas kernels vs reference.

Shapes come from `pallas_kernels/kda/arg_specs.py`. Gradients are vector-Jacobian products with
fixed random cotangents for o and the final state (w.r.t. q, k, v, g, beta and, where given, the
initial state). Errors are relative RMS: sqrt(mean((x - ref)^2) / mean(ref^2)). Pallas runs in
interpret mode on CPU (the `interpret` fixture) and compiled on GPU/TPU; under interpret both
sequential forms ("grid" for TPU, "loop" for GPU) are exercised, off-CPU the backend's own.
Compiled functions are cached per (implementation, shapes) so each program compiles once (the
extreme-gate, moderate-gate and decode tests reuse the programs of the same shapes; compilation,
not running, is what costs time here). Gates: -50/token (default specs), about -1700 (extreme),
-0.1 and -1 (moderate: decay across sub-blocks and chunks matters), -5 (decode, bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import arg_specs, chunked_vjp, ops, pallas_kda, reference
from pallas_kernels.kda.arg_specs import make_args

f32 = jnp.float32
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel_rms(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2) / max(np.mean(ref**2), 1e-300)))


def _impl_fn(impl: str, spec, interpret: bool):
    if impl == "recurrent":
        return lambda q, k, v, g, b, h0: reference.kda_recurrent(
            q, k, v, g, b, initial_state=h0, output_final_state=True)
    if impl == "chunked":
        return lambda q, k, v, g, b, h0: reference.kda_chunked(
            q, k, v, g, b, initial_state=h0, output_final_state=True)
    if impl.startswith("chunked_vjp"):  # "chunked_vjp[_g<chunks per step>][_c<chunk>]"
        opts = dict(re.findall(r"_([gc])(\d+)", impl))
        steps = int(opts["g"]) if "g" in opts else None
        chunk = dict(chunk_size=int(opts["c"]), sub_chunk=4) if "c" in opts else {}
        return lambda q, k, v, g, b, h0: chunked_vjp.kda_chunked_vjp(
            q, k, v, g, b, initial_state=h0, output_final_state=True, chunks_per_step=steps,
            **chunk)
    cfg = pallas_kda.get_config(T=spec.T, K=spec.K, V=spec.V,
                                seq_mode=spec.seq_mode if interpret else None)
    return lambda q, k, v, g, b, h0: pallas_kda.kda_pallas(
        q, k, v, g, b, initial_state=h0, output_final_state=True, interpret=interpret,
        config=cfg)


def _compiled(impl: str, spec, interpret: bool, upcast: bool):
    key = (spec.B, spec.T, spec.H, spec.K, spec.V, spec.dtype, spec.initial_state, spec.seq_mode)
    return _compiled_for_shapes(impl, key, spec, interpret, upcast)


@functools.cache
def _compiled_for_shapes(impl: str, key, spec, interpret: bool, upcast: bool):
    """jit(value_and_grad) returning (o, final_state, grads) for one implementation and shape."""
    del key  # the cache key: `spec` only matters through its shapes
    fn = _impl_fn(impl, spec, interpret)
    argnums = (0, 1, 2, 3, 4, 5) if spec.initial_state else (0, 1, 2, 3, 4)

    def loss(q, k, v, g, b, h0, co, cs):
        if upcast:
            q, k, v, g, b = (x.astype(f32) for x in (q, k, v, g, b))
        o, s = fn(q, k, v, g, b, h0)
        return jnp.sum(o.astype(f32) * co) + jnp.sum(s * cs), (o, s)

    vg = jax.value_and_grad(loss, argnums=argnums, has_aux=True)

    @jax.jit
    def run(q, k, v, g, b, h0, co, cs):
        (_, (o, s)), grads = vg(q, k, v, g, b, h0, co, cs)
        return o, s, grads

    return run


def _evaluate(impl, spec, interpret=True, upcast=False, seed=0):
    a = make_args(spec, seed)
    kc = jax.random.split(jax.random.PRNGKey(seed + 100), 2)
    co = jax.random.normal(kc[0], a["v"].shape, f32)
    cs = jax.random.normal(kc[1], (spec.B, spec.H, spec.K, spec.V), f32)
    o, s, grads = _compiled(impl, spec, interpret, upcast)(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"], co, cs)
    return o, s, dict(zip(GRAD_NAMES, grads, strict=False))


def _assert_close(got, want, tol, what=""):
    o, s, gr = got
    o_r, s_r, gr_r = want
    errs = {"o": rel_rms(o, o_r), "final_state": rel_rms(s, s_r)}
    errs.update({n: rel_rms(gr[n], gr_r[n]) for n in gr_r})
    assert set(gr) == set(gr_r)
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{what}: relative RMS errors above {tol}: {bad} (all: {errs})"


# ----------------------------------------------------------------------------------------------
# Chunked reference vs the recurrent oracle.
# ----------------------------------------------------------------------------------------------


def test_chunked_matches_recurrent():
    """T = 130 (not a multiple of the chunk), V != K, gates near -50/token, initial state given:
    outputs, final state and all gradients (incl. dh0) within 1e-4 relative RMS, all finite.
    (Without initial state: `test_ops_impls_agree_without_initial_state`.)"""
    spec = arg_specs.REFERENCE[0]
    got, want = _evaluate("chunked", spec), _evaluate("recurrent", spec)
    assert got[0].shape == (spec.B, spec.T, spec.H, spec.V) and got[0].dtype == f32
    for x in (got[0], got[1], *got[2].values()):
        assert bool(jnp.all(jnp.isfinite(x)))
    _assert_close(got, want, 1e-4, spec.name)


def test_chunked_extreme_gates_finite_and_exact():
    """Gates of about -1700/token (exp underflows to 0 within one token): no NaN/inf in the
    forward or any gradient, and still equal to the oracle."""
    spec = arg_specs.EXTREME
    got = _evaluate("chunked", spec)
    for x in (got[0], got[1], *got[2].values()):
        assert bool(jnp.all(jnp.isfinite(x)))
    _assert_close(got, _evaluate("recurrent", spec), 1e-4, spec.name)


# Moderate gates (log-decay in [-2m, 0] per token, mean -m): decay across sub-blocks, chunks and
# scan steps stays visible (m = 0.1: e^-6 over a 64-token chunk), unlike the -50/token default.
MODERATE = (0.1, 1.0)


@pytest.mark.parametrize("gate", MODERATE)
def test_chunked_matches_recurrent_moderate_gates(gate):
    """The T = 130 oracle comparison (outputs, final state, all gradients) at moderate gates,
    where an off-by-one in any cross-block decay shows (it hides under -50/token gates)."""
    spec = dataclasses.replace(arg_specs.REFERENCE[0], name=f"ref_t130_gate{gate}", gate=gate)
    _assert_close(_evaluate("chunked", spec), _evaluate("recurrent", spec), 1e-4, spec.name)


def test_decode_steps_match_full_forward():
    """kda_step token by token (the decode path) == one chunked forward: outputs and state."""
    spec = arg_specs.DECODE
    a = make_args(spec)
    o_full, s_full, _ = _evaluate("chunked", spec)
    step = jax.jit(ops.kda_step)
    state, outs = a["initial_state"], []
    for t in range(spec.T):
        o_t, state = step(a["q"][:, t], a["k"][:, t], a["v"][:, t], a["g"][:, t],
                          a["beta"][:, t], state)
        assert o_t.shape == (spec.B, spec.H, spec.V) and state.dtype == f32
        outs.append(o_t)
    assert rel_rms(jnp.stack(outs, axis=1), o_full) < 1e-5
    assert rel_rms(state, s_full) < 1e-5


@pytest.mark.parametrize("gate", [0.05, 5.0, 1700.0])
def test_decode_step_equals_the_reference_step(gate):
    """ops.kda_step (both readouts from the incoming state, one update pass) == the oracle's
    textbook step (decay, read, update, read again) to f32 rounding, down to -1700/token gates;
    a step that dropped the decay from either readout or used the old state's q readout alone
    would be off by O(1) here."""
    B, H, K, V = 3, 2, 16, 8
    ks = jax.random.split(jax.random.key(1), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (unit(jax.random.normal(kk, (B, H, K))) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, H, V))
    g = -gate * jax.random.uniform(ks[3], (B, H, K), f32, 0.0, 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, H)))
    state = jax.random.normal(ks[5], (B, H, K, V))
    o, s = jax.jit(ops.kda_step)(q, k, v, g, beta, state)
    o_ref, s_ref = jax.jit(reference.kda_step)(q, k, v, g, beta, state)
    assert rel_rms(o, o_ref) < 1e-6 and rel_rms(s, s_ref) < 1e-6
    assert jnp.max(jnp.abs(o - o_ref)) < 1e-5 and jnp.max(jnp.abs(s - s_ref)) < 1e-5


def test_decode_step_output_in_v_dtype():
    """kda_step returns o in v's dtype (bf16 here) and the state in f32, as documented."""
    B, H, K, V = 2, 2, 8, 4
    q = k = g = jnp.full((B, H, K), -0.1, jnp.bfloat16)
    o, state = ops.kda_step(q, k, jnp.ones((B, H, V), jnp.bfloat16), g,
                            jnp.full((B, H), 0.5, jnp.float32), jnp.zeros((B, H, K, V), f32))
    assert o.dtype == jnp.bfloat16 and state.dtype == f32


def test_ops_impls_agree_without_initial_state(interpret):
    """ops.kda dispatch, no initial state, output_final_state=False (final_state is None):
    every impl equals the recurrent oracle (T = 130, V != K)."""
    spec = arg_specs.REFERENCE[1]
    a = make_args(spec)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    want, none = ops.kda(*args, impl="recurrent")
    assert none is None
    for impl in ("xla", "chunked", "chunked_vjp", "auto", "pallas"):
        o, s = ops.kda(*args, impl=impl, interpret=interpret if impl == "pallas" else None)
        assert s is None and o.shape == want.shape and o.dtype == want.dtype
        on_accel = impl == "pallas" or (impl == "auto" and jax.default_backend() != "cpu")
        assert rel_rms(o, want) < (5e-3 if on_accel else 1e-4), impl
    with pytest.raises(ValueError):
        ops.kda(*args, impl="triton-please")


# ----------------------------------------------------------------------------------------------
# The chunked form's hand-written backward (chunked_vjp.py) vs the oracle and the autodiff path.
# ----------------------------------------------------------------------------------------------

# (spec, impl): with initial state over 3 scan steps of 2 chunks (T = 130 padded to 192, the
# state cotangent carried across steps), without it in one step of 5 chunks (the default rule).
VJP_CASES = ((arg_specs.REFERENCE[0], "chunked_vjp_g2"), (arg_specs.REFERENCE[1], "chunked_vjp"))


@pytest.mark.parametrize("gate", (50.0, 1.0, 0.1, 1700.0))
@pytest.mark.parametrize("case", VJP_CASES, ids=lambda c: c[1])
def test_chunked_vjp_matches_oracle_and_autodiff(case, gate):
    """Outputs, final state and every gradient (dq, dk, dv, dg, dbeta, and dh0 where given) of
    the custom-VJP chunked form within 1e-4 relative RMS of jax.grad through the recurrent oracle
    and of the autodiff chunked path, all finite; T = 130 (not a multiple of the 32-token chunk),
    V != K; gates from -0.1 to -1700 per token (decay visible across chunks and scan steps, and
    exp underflowing to 0 within one token)."""
    spec, impl = case
    spec = dataclasses.replace(spec, name=f"{spec.name}_gate{gate}", gate=gate)
    got = _evaluate(impl, spec)
    for x in (got[0], got[1], *got[2].values()):
        assert bool(jnp.all(jnp.isfinite(x)))
    _assert_close(got, _evaluate("recurrent", spec), 1e-4, spec.name + " vs recurrent")
    _assert_close(got, _evaluate("chunked", spec), 1e-4, spec.name + " vs autodiff chunked")


def test_chunked_vjp_large_chunk_matches_oracle():
    """chunk 64 with sub-chunk 4: tree joins of blocks of s = 4, 8 (the small-block forms,
    reference._pair_dots and the broadcast-multiply-sums of the backward) and s = 16, 32 (the
    batched dots), against jax.grad through the recurrent oracle, with initial state; gates of
    -0.5 per token, so the cross blocks between tokens far apart count."""
    spec = dataclasses.replace(arg_specs.REFERENCE[0], name="ref_t130_h0_gate0.5", gate=0.5)
    got = _evaluate("chunked_vjp_c64", spec)
    _assert_close(got, _evaluate("recurrent", spec), 1e-4, spec.name + " chunk 64 vs recurrent")


def test_default_chunk_by_width_and_length():
    """The chunked forms' default chunk on CPU (`reference.cpu_chunk`): 32 for keys of at least
    96 channels over at least 256 tokens, else 16; ops.kda (the model's path) and the two
    chunked forms take it when no smaller chunk is asked for, and the result at chunk 32 is the
    oracle's."""
    assert reference.cpu_chunk(255, 128) == reference.cpu_chunk(2048, 64) == 16
    assert reference.cpu_chunk(256, 96) == reference.cpu_chunk(2048, 128) == 32
    for T, want in ((256, 32), (255, 16)):
        spec = arg_specs.KDASpec(f"wide_t{T}", B=1, T=T, H=1, K=96, V=32, initial_state=True)
        a = make_args(spec)
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
        kw = dict(initial_state=a["initial_state"], output_final_state=True)
        fixed = chunked_vjp.kda_chunked_vjp(*args, **kw, chunk_size=want)
        other = chunked_vjp.kda_chunked_vjp(*args, **kw, chunk_size=48 - want)
        for got in (chunked_vjp.kda_chunked_vjp(*args, **kw),
                    ops.kda(*args, **kw, impl="chunked_vjp"),
                    reference.kda_chunked(*args, **kw)):
            for x, y in zip(got, fixed):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=spec.name)
        assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(fixed, other))
        if T == 256:
            oracle = reference.kda_recurrent(*args, **kw)
            for x, y in zip(fixed, oracle):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


def test_chunked_vjp_numerical_gradients():
    """Reverse-mode gradients of the custom VJP against central finite differences
    (jax.test_util.check_grads, f32 tolerances) on a tiny shape, with initial state, T = 11
    (not a multiple of the chunk) over several scan steps, moderate gates."""
    from jax.test_util import check_grads  # noqa: PLC0415

    spec = arg_specs.KDASpec("vjp_tiny", B=1, T=11, H=1, K=4, V=3, gate=0.5)
    a = make_args(spec, seed=3)
    co = jax.random.normal(jax.random.PRNGKey(7), (1, 11, 1, 3), f32)

    def f(q, k, v, g, b, h0):
        o, s = chunked_vjp.kda_chunked_vjp(q, k, v, g, b, initial_state=h0,
                                          output_final_state=True, chunk_size=4, sub_chunk=2,
                                          chunks_per_step=1)
        return jnp.sum(o * co) + jnp.sum(s * s)

    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"])
    check_grads(f, args, order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_chunked_vjp_keeps_only_step_states_for_the_backward():
    """Reverse-mode memory: the residuals the custom VJP keeps are the (padded) inputs, one
    [B*H,K,V] state per scan step (O(T/C * K * V)) and each chunk's three [C,C] pair matrices
    (A_qk, A_kk, (I + beta A_kk)^-1: 3C floats per token and head, against the inputs' 3K+V+1),
    never a per-token state or the other chunk terms; the autodiff chunked path keeps several
    times more."""
    spec = arg_specs.REFERENCE[1]
    a = make_args(spec)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    B, H, K, V = spec.B, spec.H, spec.K, spec.V
    C, _, G, T_pad = reference.scan_plan(spec.T, B * H, reference.cpu_chunk(spec.T, K),
                                         reference.CPU_SUB_CHUNK, 2)
    assert (spec.T, C, G, T_pad) == (130, 16, 2, 160)  # 9 chunks of 16 -> 5 steps of 2 chunks
    steps = T_pad // (G * C)

    def residual_bytes(fn):
        _, vjp = jax.vjp(lambda *xs: fn(*xs)[0], *args)
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(vjp))

    allowed = 4 * (B * T_pad * H * (3 * K + V + 1 + 3 * C) + steps * B * H * K * V) + 1024
    got = residual_bytes(lambda *xs: chunked_vjp.kda_chunked_vjp(*xs, chunks_per_step=2))
    assert got <= allowed, (got, allowed)
    old = residual_bytes(lambda *xs: reference.kda_chunked(*xs, chunks_per_step=2))
    assert old > 2 * got, (old, got)


# ----------------------------------------------------------------------------------------------
# Pallas kernels (interpret on CPU) vs the reference.
# ----------------------------------------------------------------------------------------------


def test_config_heuristics():
    assert pallas_kda.get_config(T=1, K=16, V=16, backend="cpu").chunk_size == 16
    assert pallas_kda.get_config(T=130, K=64, V=64, backend="cpu").chunk_size == 64
    assert pallas_kda.get_config(T=130, K=64, V=64, backend="tpu").seq_mode == "grid"
    gpu = pallas_kda.get_config(T=4096, K=128, V=128, backend="gpu")
    assert gpu.seq_mode == "loop" and gpu.num_warps == 8
    with pytest.raises(ValueError):
        pallas_kda.KDAConfig(chunk_size=48)
    with pytest.raises(ValueError):
        pallas_kda.KDAConfig(chunk_size=16, sub_chunk=32)


@pytest.mark.parametrize("spec", arg_specs.PALLAS, ids=lambda s: s.name)
def test_pallas_matches_reference(spec, interpret):
    """Forward (o, final state) and dq, dk, dv, dg, dbeta (, dh0) within 5e-3 relative RMS, f32,
    T in {1, 63, 64, 130}, K = V in {16, 32, 64}, gates near -50/token."""
    got = _evaluate("pallas", spec, interpret)
    assert got[0].shape == (spec.B, spec.T, spec.H, spec.V) and got[0].dtype == f32
    _assert_close(got, _evaluate("recurrent", spec), 5e-3, spec.name)


@pytest.mark.parametrize("spec", [dataclasses.replace(s, name=s.name + "_gate0.1", gate=0.1)
                                  for s in arg_specs.PALLAS if s.T >= 64], ids=lambda s: s.name)
def test_pallas_matches_reference_moderate_gates(spec, interpret):
    """The Pallas kernels at gates of about -0.1/token: T = 64 (sub-blocks of one chunk, "grid"
    form) and T = 130 (decay carried across chunks, "loop" form)."""
    _assert_close(_evaluate("pallas", spec, interpret), _evaluate("recurrent", spec), 5e-3,
                  spec.name)


def test_pallas_bf16(interpret):
    """bf16 inputs: o comes back in bf16 and gradients in the input dtypes; values against the
    f32 oracle on the same (bf16-rounded) inputs within 3e-2 relative RMS."""
    spec = arg_specs.PALLAS_BF16
    got = _evaluate("pallas", spec, interpret)
    assert got[0].dtype == jnp.bfloat16
    assert all(got[2][n].dtype == jnp.bfloat16 for n in ("dq", "dk", "dv", "dg", "dbeta"))
    assert got[2]["dh0"].dtype == f32
    want = _evaluate("recurrent", spec, upcast=True)
    _assert_close(got, want, 3e-2, spec.name)
