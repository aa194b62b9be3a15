"""Layer math against independent numpy references: RoPE, the MoE layer's routed scaling, the
DSA layer's causal masks at both indexer stages, KDA's short conv and the norms' gradients.

Covered:
  RoPE (`apply_rope`, default arguments): equal to rotating each channel pair (i, i + d/2) as a
    complex number by position * theta^(-2i/d), for [B,T,H,D] and [B,T,D] inputs, full and
    partial rope_dim (the tail bit-for-bit untouched); norms preserved; q_m . k_n depends only
    on m - n; position 0 is the identity.
  MoE (`MoE` module): routed + shared output with routed_scaling_factor 2.827 (the presets'
    value) against a dense einsum reference, for the sigmoid router (renormalised top-k, bias
    steering selection only) with dropless dispatch and the softmax router (not renormalised)
    with capacity dispatch at ample capacity, each also through the all-experts path (every
    expert on every token, `moe.all_experts_max_rows`; the jaxpr shows which path ran); padding
    tokens get only the shared expert. `takes_all_experts`: the row budget, the no-drop
    condition and the E/k guard.
  DSA: `causal_mask` with per-row query offsets; `indexer_kl` against a numpy KL; and the layer
    itself at indexer_stage "dense_warmup" and "sparse": changing the tokens after the last
    counted query changes neither the indexer KL nor the earlier outputs (no query sees a later
    key).
  KDA's short conv (`causal_depthwise_conv`, hand-written backward): output and the cotangents
    of x, each tap's weight and the carried window against numpy, T = 1 and W = 1 included;
    with bf16 / f32 mixes each cotangent keeps its primal's dtype;
    rms_norm / LayerNorm (scale and bias applied on the [rows, C] view): values and gradients.
Not covered here: YaRN scaling, capacity drops (tests/model/test_model.py), expert parallelism
(tests/model/test_sharding.py), the DSA kernels (tests/pallas_kernels/test_dsa.py).
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ModelConfig
from model.layers import dsa as dsa_lib
from model.layers.moe import MoE
from model.layers.rope import apply_rope


def _cfg(**over) -> ModelConfig:
    return models.build("test", **over)


# ----------------------------------------------------------------------------- RoPE
def ref_rope(x, positions, theta, rope_dim=None):
    """float64: channel pairs (i, i + d/2) rotated as complex numbers x_i + j x_{i+d/2}."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1] if rope_dim is None else rope_dim
    freq = theta ** (-np.arange(d // 2) * 2.0 / d)  # [d/2]
    ang = np.asarray(positions, np.float64)[..., None] * freq  # [B,T,d/2]
    if x.ndim == 4:
        ang = ang[:, :, None, :]
    c = (x[..., : d // 2] + 1j * x[..., d // 2: d]) * np.exp(1j * ang)
    return np.concatenate([c.real, c.imag, x[..., d:]], axis=-1)


RNG = np.random.default_rng(0)
X4 = RNG.normal(size=(2, 5, 3, 16)).astype(np.float32)  # [B,T,H,D]
X3 = RNG.normal(size=(2, 5, 12)).astype(np.float32)  # [B,T,D] (MLA's shared rope key)
POS = np.array([[0, 1, 2, 7, 90], [3, 200, 41, 5, 1000]], np.int32)  # [B,T], any order


@pytest.mark.parametrize("x,rope_dim", [(X4, None), (X4, 8), (X3, None), (X3, 4)],
                         ids=["BTHD", "BTHD_partial", "BTD", "BTD_partial"])
def test_rope_matches_complex_rotation(x, rope_dim):
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(POS), 10000.0, rope_dim))
    np.testing.assert_allclose(got, ref_rope(x, POS, 10000.0, rope_dim), atol=2e-5, rtol=0)
    d = x.shape[-1] if rope_dim is None else rope_dim
    np.testing.assert_array_equal(got[..., d:], x[..., d:])  # partial RoPE: tail untouched


def test_rope_preserves_norms_and_position_zero_is_identity():
    far = np.full_like(POS, 3000) + POS
    for pos in (POS, far):
        got = np.asarray(apply_rope(jnp.asarray(X4), jnp.asarray(pos), 10000.0))
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(X4, axis=-1),
                                   rtol=1e-5)
    zero = apply_rope(jnp.asarray(X4), jnp.zeros_like(jnp.asarray(POS)), 10000.0)
    np.testing.assert_allclose(np.asarray(zero), X4, atol=1e-7)


def test_rope_scores_depend_only_on_relative_position():
    q, k = RNG.normal(size=(2, 32)).astype(np.float32)
    m, n = np.array([5, 9, 17, 33]), np.array([2, 9, 30, 0])  # offsets 3, 0, -13, 33
    shifts = np.array([0, 1, 64, 500])

    def rotated(v, pos):  # v at positions pos [S,P] -> [S,P,32]
        return np.asarray(apply_rope(jnp.broadcast_to(jnp.asarray(v), pos.shape + (32,)),
                                     jnp.asarray(pos, jnp.int32), 10000.0))

    qs = rotated(q, m[None] + shifts[:, None])  # [shifts, pairs, 32]
    ks = rotated(k, n[None] + shifts[:, None])
    dots = np.sum(qs * ks, axis=-1)  # [shifts, pairs]
    np.testing.assert_allclose(dots, np.broadcast_to(dots[0], dots.shape), atol=2e-4)
    assert np.ptp(dots[0]) > 0.1  # and they do depend on the offset m - n


# ----------------------------------------------------------------------------- MoE
SCALE = 2.827  # routed_scaling_factor of the shipped presets (DeepSeek-V3's value)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def ref_moe(x, valid, params, bias, *, router, top_k, norm_topk_prob, scaling):
    """float64: x [N,D], valid [N] -> routed (top-k of the router, weights scaled) + shared."""
    f = lambda a: np.asarray(a, np.float64)
    x = f(x)
    logits = x @ f(params["router"])  # [N,E]
    if router == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
        select_by = scores
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        select_by = scores + f(bias)  # the bias steers selection only
    sel = np.argsort(-select_by, axis=-1, kind="stable")[:, :top_k]  # [N,k]
    w = np.take_along_axis(scores, sel, -1)  # [N,k]
    if norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)
    w = w * scaling * np.asarray(valid, np.float64)[:, None]
    h = np.einsum("nd,edf->enf", x, f(params["w_gate"]))
    u = np.einsum("nd,edf->enf", x, f(params["w_up"]))
    y_e = np.einsum("enf,efd->end", _silu(h) * u, f(params["w_down"]))  # [E,N,D] every expert
    routed = np.einsum("nk,nkd->nd", w, y_e[sel, np.arange(x.shape[0])[:, None]])
    sh = params["shared"]
    shared = (_silu(x @ f(sh["gate"]["kernel"])) * (x @ f(sh["up"]["kernel"]))) @ f(
        sh["down"]["kernel"])
    return routed + shared


@pytest.mark.parametrize("router,norm_topk,dispatch,all_experts_max", [
    ("sigmoid", True, "dropless", 0), ("sigmoid", True, "dropless", 48),
    ("softmax", False, "capacity", 0), ("softmax", False, "capacity", 48)])
def test_moe_routed_scaling_factor_matches_reference(router, norm_topk, dispatch,
                                                     all_experts_max):
    """all_experts_max 0: the dispatch sorts and groups (dropless) or fills capacity buffers;
    48 (the 2 x 6 tokens x 4 experts, and a capacity of 48 cannot drop): every expert on every
    token (moe.all_experts_max_rows)."""
    cfg = _cfg(**{"moe.router": router, "moe.norm_topk_prob": norm_topk,
                  "moe.dispatch": dispatch, "moe.capacity_factor": 8.0,
                  "moe.routed_scaling_factor": SCALE,
                  "moe.all_experts_max_rows": all_experts_max})
    m = cfg.moe
    mod = MoE(m, cfg.d_model)
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.d_model))
    valid = jnp.ones((2, 6), bool).at[1, 4:].set(False)
    variables = nn.meta.unbox(jax.jit(lambda k: mod.init(k, x, valid=valid))(jax.random.key(2)))
    bias = jnp.linspace(-0.2, 0.2, m.num_experts)
    variables["router_state"]["bias"] = bias
    y, aux = jax.jit(lambda v: mod.apply(v, x, valid=valid))(variables)
    # the path taken: the grouped one sorts, the capacity one counts slots with a cumsum
    jaxpr = str(jax.make_jaxpr(lambda v: mod.apply(v, x, valid=valid))(variables))
    assert (" sort[" in jaxpr or " cumsum[" in jaxpr) == (all_experts_max == 0)
    want = ref_moe(np.asarray(x).reshape(-1, cfg.d_model), np.asarray(valid).reshape(-1),
                   variables["params"], bias, router=router, top_k=m.num_experts_per_tok,
                   norm_topk_prob=norm_topk, scaling=SCALE)
    np.testing.assert_allclose(np.asarray(y).reshape(want.shape), want, rtol=1e-4, atol=1e-5)
    assert float(aux["router"]["dropped_fraction"]) == 0.0


def _while_body_text(hlo: str) -> str:
    """The optimized HLO a module's outer while loop (the one in its entry computation) runs
    each iteration: its body and every computation the body calls, transitively."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%(\S+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(2)
            entry = name if m.group(1) else entry
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    (body,) = [re.search(r"body=%([\w.\-]+)", line).group(1)
               for line in comps[entry] if " while(%" in line]
    seen, todo = set(), [body]
    while todo:
        c = todo.pop()
        if c not in seen and c in comps:
            seen.add(c)
            todo += [n for line in comps[c] for n in re.findall(r"%([\w.\-]+)", line)]
    return "\n".join(line for c in seen for line in comps[c])


def test_all_experts_weights_stay_out_of_a_decode_loop():
    """In a loop over decode steps (the sampler's), the all-experts path reads gate and up in
    the matmul's layout prepared once before the loop: no instruction inside the loop touches
    an expert weight in its stored [E,D,F] layout (left to the dot, XLA copies every expert
    weight into its layout on every step: 12 ms of the matched benchmark's 290 ms rollout).
    The loop's result equals the same steps run one by one."""
    cfg = _cfg(**{"moe.expert_dim": 32})  # F != D, so [E,D,F] names gate / up only
    m = cfg.moe
    mod = MoE(m, cfg.d_model)
    x = jax.random.normal(jax.random.key(1), (4, 1, cfg.d_model))  # [B,T=1,D]: a decode step
    valid = jnp.ones((4, 1), bool)
    variables = nn.meta.unbox(jax.jit(lambda k: mod.init(k, x, valid=valid))(jax.random.key(2)))

    def steps(v, x):
        return jax.lax.fori_loop(0, 3, lambda i, h: h + mod.apply(v, h, valid=valid)[0], x)

    hlo = jax.jit(steps).lower(variables, x).compile().as_text()
    body = _while_body_text(hlo)
    stored = f"f32[{m.num_experts},{cfg.d_model},{m.expert_dim}]"
    assert "dot(" in body and stored in hlo
    assert stored not in body, [ln for ln in body.splitlines() if stored in ln][:3]
    h = x
    for _ in range(3):
        h = h + jax.jit(lambda v, h: mod.apply(v, h, valid=valid)[0])(variables, h)
    np.testing.assert_allclose(np.asarray(jax.jit(steps)(variables, x)), np.asarray(h),
                               rtol=1e-5, atol=1e-5)


def test_takes_all_experts_rule():
    """Every expert on every token only for few tokens (tokens x E within the row budget), where
    nothing can be dropped, and with at most 8 experts per selected one."""
    from model.config import MoEConfig
    from model.layers.moe import takes_all_experts

    m = MoEConfig(num_experts=8, num_experts_per_tok=2, expert_dim=16)  # dropless, 2048 rows
    assert takes_all_experts(m, 1) and takes_all_experts(m, 256)
    assert not takes_all_experts(m, 257)
    assert not takes_all_experts(dataclasses.replace(m, all_experts_max_rows=0), 1)
    # capacity: C = ceil(cf * n * k / E) >= n exactly when cf * k / E >= 1
    assert takes_all_experts(dataclasses.replace(m, dispatch="capacity", capacity_factor=4.0), 32)
    assert not takes_all_experts(dataclasses.replace(m, dispatch="capacity"), 32)
    # many experts per selected one (the reference preset's 1000 / 8): never
    wide = dataclasses.replace(m, num_experts=1000, num_experts_per_tok=8, all_experts_max_rows=10**9)
    assert not takes_all_experts(wide, 1)
    assert takes_all_experts(dataclasses.replace(m, num_experts=32, num_experts_per_tok=4), 64)


# ----------------------------------------------------------------------------- DSA
def test_causal_mask_with_query_offsets():
    T, S = 3, 7
    off = np.array([0, 4])
    got = np.asarray(dsa_lib.causal_mask(T, S, jnp.asarray(off)))
    want = np.arange(S)[None, None, :] <= (np.arange(T)[None, :, None] + off[:, None, None])
    np.testing.assert_array_equal(got, want)
    assert got.shape == (2, T, S) and got[0, 0].tolist() == [True] + [False] * 6


def ref_indexer_kl(q, kv, scores, key_mask, valid_q, scale):
    """float64 mean over valid queries of KL(p || softmax(scores)) over the keys in key_mask,
    p = the per-head attention softmax(q.kv * scale) over those keys, averaged over heads."""
    q, kv, scores = (np.asarray(a, np.float64) for a in (q, kv, scores))
    B, T, H, _ = q.shape
    total, n = 0.0, 0
    for b in range(B):
        for t in range(T):
            if not valid_q[b, t]:
                continue
            keys = np.flatnonzero(key_mask[b, t])
            logits = q[b, t] @ kv[b, keys].T * scale  # [H, n_keys]
            a = np.exp(logits - logits.max(-1, keepdims=True))
            p = (a / a.sum(-1, keepdims=True)).mean(0)
            s = scores[b, t, keys]
            log_q = s - s.max() - np.log(np.sum(np.exp(s - s.max())))
            total += np.sum(p * (np.log(p) - log_q))
            n += 1
    return total / n


def test_indexer_kl_matches_numpy():
    B, T, S, H, D = 2, 5, 5, 3, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, H, D))
    kv = jax.random.normal(ks[1], (B, S, D))
    scores = jax.random.normal(ks[2], (B, T, S))
    key_mask = np.array(dsa_lib.causal_mask(T, S, jnp.zeros((B,), jnp.int32)))
    key_mask[1, 3:, 1] = False  # a sparse-stage style selection on top of causality
    valid = np.ones((B, T), bool)
    valid[0, 4] = False
    got = jax.jit(dsa_lib.indexer_kl)(q, kv, scores, jnp.asarray(key_mask), jnp.asarray(valid),
                                      0.3)
    np.testing.assert_allclose(float(got), ref_indexer_kl(q, kv, scores, key_mask, valid, 0.3),
                               rtol=1e-5)


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_dsa_layer_indexer_kl_and_output_are_causal(stage):
    """Queries 0..M-1 count for the KL (valid); tokens M.. are then replaced. Neither the KL
    nor the outputs at 0..M-1 may change: a mask that lets query t see key t+1 changes both."""
    cfg = _cfg(**{"dsa.indexer_stage": stage, "dsa.indexer_loss_weight": 1.0,
                  "dsa.index_topk": 4})
    layer = dsa_lib.DSALayer(cfg.dsa, cfg.d_model)
    B, T, M = 2, 10, 6
    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (B, T, cfg.d_model))
    x2 = x.at[:, M:].set(jax.random.normal(ks[1], (B, T - M, cfg.d_model)))
    valid = jnp.broadcast_to(jnp.arange(T)[None] < M, (B, T))
    positions = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    variables = jax.jit(lambda k, x: layer.init(k, x, valid=valid, positions=positions))(ks[2], x)
    run = jax.jit(lambda v, x: layer.apply(v, x, valid=valid, positions=positions))
    out, _, aux = run(variables, x)
    out2, _, aux2 = run(variables, x2)
    kl, kl2 = float(aux["indexer_kl"]), float(aux2["indexer_kl"])
    assert np.isfinite(kl) and kl > 0
    assert kl2 == pytest.approx(kl, rel=1e-6, abs=1e-7), f"{stage}: the KL saw a later key"
    np.testing.assert_allclose(np.asarray(out2[:, :M]), np.asarray(out[:, :M]), rtol=1e-6,
                               atol=1e-6)
    assert float(jnp.max(jnp.abs(out2[:, M:] - out[:, M:]))) > 1e-3  # the change is real


@pytest.mark.parametrize("B,T,C,W", [(2, 7, 6, 4), (3, 1, 5, 4), (2, 5, 4, 1)])
def test_causal_conv_value_and_grads_match_numpy(B, T, C, W):
    """KDA's short conv (`causal_depthwise_conv`, hand-written backward): outputs and the
    cotangents of x, w and the carried window equal a numpy loop over taps, for T = 1 (decode)
    and W = 1 too; each tap's weight gradient is checked separately, so a backward that swapped
    or dropped a tap, or summed only part of the rows, fails."""
    from model.layers.kda import causal_depthwise_conv

    rng = np.random.default_rng(T * 10 + W)
    x, window = rng.normal(size=(B, T, C)), rng.normal(size=(B, W - 1, C))
    w, dy = rng.normal(size=(W, C)), rng.normal(size=(B, T, C))
    xp = np.concatenate([window, x], axis=1)
    y_ref = sum(xp[:, j:j + T] * w[j] for j in range(W))
    dxp_ref = np.zeros_like(xp)
    for j in range(W):
        dxp_ref[:, j:j + T] += dy * w[j]
    dw_ref = np.stack([np.sum(xp[:, j:j + T] * dy, axis=(0, 1)) for j in range(W)])

    def f(x, w, window):
        return causal_depthwise_conv(x, w, window, jnp.full((B,), T))[0]

    args = [jnp.asarray(a, jnp.float32) for a in (x, w, window)]
    y, vjp = jax.vjp(f, *args)
    dx, dw, dwin = vjp(jnp.asarray(dy, jnp.float32))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dxp_ref[:, W - 1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dwin, dxp_ref[:, :W - 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_causal_conv_cotangents_keep_their_dtypes():
    """Mixed dtypes (bf16 activations, f32 taps, and the reverse): each cotangent has its
    primal's dtype, as autodiff gives, and the bf16 run stays close to the f32 one."""
    from model.layers.kda import causal_depthwise_conv

    rng = np.random.default_rng(1)
    x, w, window = rng.normal(size=(2, 6, 8)), rng.normal(size=(4, 8)), rng.normal(size=(2, 3, 8))
    lengths = jnp.array([6, 4])

    def grads(xd, wd):
        def f(x, w, window):
            y, _ = causal_depthwise_conv(x, w, window, lengths)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        args = (jnp.asarray(x, xd), jnp.asarray(w, wd), jnp.asarray(window, xd))
        return args, jax.grad(f, argnums=(0, 1, 2))(*args)

    _, exact = grads(jnp.float32, jnp.float32)
    for xd, wd in ((jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                   (jnp.bfloat16, jnp.bfloat16)):
        args, gs = grads(xd, wd)
        assert [g.dtype for g in gs] == [a.dtype for a in args], (xd, wd)
        for g, e in zip(gs, exact):
            np.testing.assert_allclose(np.asarray(g, np.float32), e, rtol=0.1,
                                       atol=0.05 * float(jnp.max(jnp.abs(e))))


def test_norm_scale_grads_match_numpy():
    """rms_norm and LayerNorm multiply their scale (and add the bias) on the [rows, C] view
    (`scale_rows`): values and every gradient equal numpy's for a [B,T,C] input."""
    from model.layers.norms import LayerNorm, rms_norm

    rng = np.random.default_rng(0)
    x, w, b, dy = (rng.normal(size=s) for s in ((3, 5, 8), (8,), (8,), (3, 5, 8)))
    xh = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    y, vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6), jnp.asarray(x, jnp.float32),
                     jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(y, xh * w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vjp(jnp.asarray(dy, jnp.float32))[1],
                               np.sum(xh * dy, axis=(0, 1)), rtol=1e-4, atol=1e-5)

    ln = LayerNorm()
    params = {"params": {"scale": jnp.asarray(w, jnp.float32), "bias": jnp.asarray(b, jnp.float32)}}
    xc = x - x.mean(-1, keepdims=True)
    xn = xc / np.sqrt(np.mean(xc * xc, -1, keepdims=True) + 1e-6)
    y, vjp = jax.vjp(lambda p: ln.apply(p, jnp.asarray(x, jnp.float32)), params)
    np.testing.assert_allclose(y, xn * w + b, rtol=1e-5, atol=1e-5)
    g = vjp(jnp.asarray(dy, jnp.float32))[0]["params"]
    np.testing.assert_allclose(g["scale"], np.sum(xn * dy, axis=(0, 1)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g["bias"], np.sum(dy, axis=(0, 1)), rtol=1e-4, atol=1e-5)
