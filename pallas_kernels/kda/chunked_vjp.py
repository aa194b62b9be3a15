"""The chunked KDA with a hand-written backward (`jax.custom_vjp`), for training on XLA.

    kda_chunked_vjp(q, k, v, g, beta, *, scale=None, initial_state=None,
                    output_final_state=False, chunk_size=None, sub_chunk=2, chunks_per_step=None)

Same contract, layouts and forward numbers as `reference.kda_chunked`: not differentiated, the
call IS `reference.kda_chunked`; under differentiation the forward is the same grouped scan over
the same `reference.chunk_parts`, also keeping the state entering each scan step and each chunk's
pair matrices. What differs is reverse mode: instead of autodiff through the chunk terms and
the scan, the backward

  1. keeps as residuals the state entering each scan step (a group of `chunks_per_step`
     chunks), [T/(C*G), B*H, K, V] f32, i.e. O(T/C * K * V), never a per-token state, and each
     chunk's pair matrices A_qk, A_kk and (I + beta A_kk)^-1 ([C,C] each: 3C floats per token
     and head, against the inputs' 3K+V+1). Keeping those three skips the exact-decay tree's
     pairwise products in the backward: forward + backward 1.18x faster at B1 H4 K=V=128
     T=2048 and 1.04x at the matched RL shape (B32 T96 H4 K=V=64), the same bits (paired
     medians of 15 alternating rounds in one process). Keeping the deltas too was slower
     (0.94x: writing them out costs more than the one [C,K] x [K,V] product that recomputes
     them);
  2. walks the groups in reverse (`lax.scan(reverse=True)`); per group it recomputes the other
     chunk terms (`reference.chunk_parts(..., pairs=...)`: the decays, w, u, qg, kd) and the
     per-chunk states from the saved group state, runs the
     only sequential part (per chunk, with dO = scale * do and dS the state cotangent)
         dDelta = A_qk^T dO + kd dS
         dS    <- qg^T dO - w^T dDelta + e^(G_C) * dS
     and then the rest (the state products per chunk, as S0 [dO | -dDelta]^T and dS1 delta^T
     with the small results transposed; dA_qk batched over the group's chunks):
         dA_qk = tril(dO delta^T), d(qg) = dO S0^T, dw = -dDelta S0^T, du = dDelta,
         d(kd) = delta dS1^T, d(e^(G_C)) = rowsum(S0 * dS1);
  3. maps those to q, k, v, g, beta through the chunk terms (`_chunk_terms_bwd`):
         [dr_w | dr_u] = Tinv^T [dw | du],  dA_kk = -tril_strict([dr_w | dr_u] [w | u]^T),
     and the pairwise terms A[i,j] = z_i . (k_j e^(G_i - G_j)) (z = q inclusive, z = k strict,
     times beta_i) pulled back along the same exact-decay tree as the forward (base bands of
     `sub_chunk` tokens, then sibling joins through their boundary, every factor in [0, 1]):
         dz_i = sum_j dA_ij k_j e^(G_i - G_j),   dk_j = sum_i dA_ij z_i e^(G_i - G_j),
         dG  += z * dz - k * dk   (d/dG_i of e^(G_i - G_j) is +, of G_j is -),
     dg = reverse cumulative sum of dG within the chunk (G = inclusive cumsum of g).
Initial state: its cotangent is the dS left after the first group. Any T (zero tail, sliced off).

Covered: f32/bf16 inputs (math in f32; gradients come back in the input dtypes), with or without
initial state / final state, any T, gates down to about -1700/token (no exponent is positive, so
no overflow and no 0 * inf). Not covered: higher-order derivatives (the backward is not itself
differentiable w.r.t. its residuals: jax.custom_vjp), forward-mode (jvp) differentiation,
variable-length packed sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda import reference
from pallas_kernels.kda.reference import _HI, _check_shapes, pad_time, scan_plan

f32 = jnp.float32


def _bmm(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_HI)


# ----------------------------------------------------------------------------------------------
# Backward of the state-independent chunk terms.
# ----------------------------------------------------------------------------------------------


def _chunk_terms_bwd(q, k, v, beta, P: reference.ChunkParts, dA_qk, dw, du, dqg, dkd, ddecay):
    """Pull the cotangents of `chunk_terms`' outputs back to (dq, dk, dv, dg, dbeta).

    q, k: [X,C,K], v: [X,C,V], beta: [X,C] (f32); P: `reference.chunk_parts` of them;
    dA_qk [X,C,C] (lower incl.), dw, dqg, dkd [X,C,K], du [X,C,V], ddecay [X,K].
    """
    X, C, K = q.shape
    ic = jnp.arange(C)
    strict = (ic[:, None] > ic[None, :]).astype(f32)
    incl = (ic[:, None] >= ic[None, :]).astype(f32)
    bk = beta[:, :, None]

    # (I + beta A_kk)^-1 [k e^G | v] beta: the triangular solve's backward.
    wu = jnp.concatenate([P.w, P.u], axis=-1)  # [X,C,K+V]
    drhs = _bmm("xji,xjd->xid", P.Tinv, jnp.concatenate([dw, du], axis=-1))  # Tinv^T [dw|du]
    dM = -_bmm("xid,xjd->xij", drhs, wu) * strict  # [X,C,C] cotangent of beta_i A_kk[i,j]
    drw, dru = drhs[..., :K], drhs[..., K:]
    kG = k * P.eG
    dbeta = jnp.sum(drw * kG, -1) + jnp.sum(dru * v, -1) + jnp.sum(dM * P.A_kk, -1)  # [X,C]
    dv = dru * bk
    dq = dqg * P.eG
    dk = drw * bk * P.eG + dkd * P.eGc
    # Gate terms outside the pairwise products: e^G in rhs_w and qg, e^(G_C - G) in kd, e^(G_C).
    dG = (drw * bk * kG) + dqg * P.qg - dkd * P.kd  # [X,C,K]
    dGC = jnp.sum(dkd * P.kd, axis=1) + ddecay * P.decay  # [X,K] onto G_C (the last row)
    dG = dG.at[:, -1].add(dGC)

    # Pairwise terms, z = q (A_qk, inclusive) and z = k (beta_i A_kk, strict).
    dA = jnp.stack([dA_qk * incl, dM * bk], axis=1)  # [X,2,C,C]
    Z = jnp.stack([q, k], axis=1)  # [X,2,C,K]
    Pz = jnp.zeros((X, 2, C, K), f32)  # sum_j dA_ij k_j e^(G_i - G_j)
    Pk = jnp.zeros((X, C, K), f32)  # sum_{z,i} dA_ij z_i e^(G_i - G_j)
    dAl = dA[:, :, None]  # [X,2,1,C,C]
    for Rs5, Rc5 in reversed(P.levels):  # top-down: the cross block of each sibling pair
        np_, s = Rs5.shape[1], Rs5.shape[3]
        dA7 = dAl.reshape(X, 2, np_, 2, s, 2, s)
        dcross = dA7[:, :, :, 1, :, 0, :]  # [X,2,np,s,s] rows in the right child, cols in left
        Rr = Rs5[:, :, 1]  # [X,np,s,K] decay from the boundary m to i
        Rl = Rc5[:, :, 0]  # [X,np,s,K] decay from j to m
        rows = Z.reshape(X, 2, np_, 2, s, K)[:, :, :, 1] * Rr[:, None]  # [X,2,np,s,K]
        colv = k.reshape(X, np_, 2, s, K)[:, :, 0] * Rl  # [X,np,s,K]
        if s <= reference.SMALL_BLOCK:  # contractions over s: broadcast-multiply-sums
            drows = reference._mm(dcross, colv[:, None]) * Rr[:, None]
            dcolv = jnp.sum(dcross[..., None] * rows[..., :, None, :], axis=(1, 3)) * Rl
        else:
            drows = _bmm("xzpij,xpjk->xzpik", dcross, colv) * Rr[:, None]
            dcolv = _bmm("xzpij,xzpik->xpjk", dcross, rows) * Rl
        zero = jnp.zeros_like(drows)
        Pz = Pz + jnp.stack([zero, drows], axis=3).reshape(X, 2, C, K)
        Pk = Pk + jnp.stack([dcolv, jnp.zeros_like(dcolv)], axis=2).reshape(X, C, K)
        dAl = jnp.stack([dA7[:, :, :, 0, :, 0, :], dA7[:, :, :, 1, :, 1, :]], axis=3)
        dAl = dAl.reshape(X, 2, 2 * np_, s, s)
    # Base blocks of c tokens: band by offset d, entry (i, i - d) with decay exp(G_i - G_(i-d)).
    nb, c = dAl.shape[2], dAl.shape[3]
    onehot = (jnp.arange(c)[:, None, None] - jnp.arange(c)[None, :, None]
              == jnp.arange(c)[None, None, :]).astype(f32)
    band = jnp.einsum("xzaij,ijd->xzaid", dAl, onehot, precision=_HI)  # [X,2,nb,c(i),c(d)]
    Zb = Z.reshape(X, 2, nb, c, K)
    kb = k.reshape(X, nb, c, K)
    # d = 0 (no decay) moves q and k only: its +z.dz and -k.dk gate terms cancel exactly, so it
    # stays out of dG (summing them would only add rounding of O(1) terms to a tiny dg).
    dz0 = (band[..., 0, None] * kb[:, None]).reshape(X, 2, C, K)
    dk0 = jnp.sum(band[..., 0, None] * Zb, axis=1).reshape(X, C, K)
    Pzb = jnp.zeros_like(Zb)
    Pkb = jnp.zeros_like(kb)
    for d in range(1, c):
        dec = P.band_dec[d - 1]  # [X,nb,c-d,K]
        coef = band[:, :, :, d:, d, None]  # [X,2,nb,c-d,1] rows i = d..c-1
        pz = coef * (kb[:, :, : c - d] * dec)[:, None]  # onto rows i
        pk = jnp.sum(coef * Zb[:, :, :, d:], axis=1) * dec  # onto cols i - d
        Pzb = Pzb + jnp.pad(pz, [(0, 0), (0, 0), (0, 0), (d, 0), (0, 0)])
        Pkb = Pkb + jnp.pad(pk, [(0, 0), (0, 0), (0, d), (0, 0)])
    Pz = Pz + Pzb.reshape(X, 2, C, K)
    Pk = Pk + Pkb.reshape(X, C, K)

    dG = dG + q * Pz[:, 0] + k * (Pz[:, 1] - Pk)
    dq = dq + Pz[:, 0] + dz0[:, 0]
    dk = dk + Pz[:, 1] + Pk + dz0[:, 1] + dk0
    # G_i = sum_{s<=i} g_s, so dg_s = sum_{i>=s} dG_i: one triangular matmul (XLA:CPU runs a
    # cumulative sum over C as a reduce-window, several times slower here), batched over X with
    # the [C,C] matrix broadcast: against an unbatched matrix XLA:CPU folded X into the rows and
    # first transposed dG (with the elementwise work producing it) to [X,K,C] (docs/speed.md).
    dg = _bmm("xsi,xik->xsk", jnp.broadcast_to(incl.T, (X, C, C)), dG)
    return dq, dk, dv, dg, dbeta


# ----------------------------------------------------------------------------------------------
# Forward (grouped scan, as reference.kda_chunked) and the custom VJP.
# ----------------------------------------------------------------------------------------------


def _layout(B, H, G, C):
    """(group, ungroup): [B,L,H,...] <-> [B*H*G, C, ...] for one scan step of L = G*C tokens."""

    def group(x):
        tail = x.shape[3:]
        x = jnp.moveaxis(x.reshape(B, G, C, H, *tail), 3, 1)  # [B,H,G,C,...]
        return x.reshape(B * H * G, C, *tail)

    def ungroup(x):
        tail = x.shape[2:]
        x = jnp.moveaxis(x.reshape(B, H, G * C, *tail), 1, 2)  # [B,L,H,...]
        return x

    return group, ungroup


def _forward(cfg, xs, h0):
    """xs = (q, k, v, g, beta) f32, padded to a multiple of G*C tokens. Returns
    (o [B,T,H,V] already scaled, S_final [B*H,K,V], the backward's residuals: the states
    entering each step [T/L, B*H, K, V] and the pairs (A_qk, A_kk, Tinv), [T/L, B*H*G, C, C])."""
    scale, C, c, G = cfg
    q = xs[0]
    B, T, H, K = q.shape
    V = xs[2].shape[-1]
    L = G * C
    group, ungroup = _layout(B, H, G, C)

    def body(S, i):  # S: [B*H, K, V]
        sl = lambda x: lax.dynamic_slice_in_dim(x, i * L, L, axis=1)
        gx = lax.optimization_barrier(tuple(group(sl(x)) for x in xs))
        P = reference.chunk_parts(*gx, c)
        pairs = (P.A_qk, P.A_kk, P.Tinv)  # [B*H*G, C, C] each: kept for the backward
        sh = lambda x: x.reshape(B * H, G, *x.shape[1:])  # [B*H, G, ...]
        A_qk, w, u, qg, kd, decay = map(sh, (P.A_qk, P.w, P.u, P.qg, P.kd, P.decay))
        S_in, outs = S, []
        for j in range(G):
            X = _bmm("xck,xkv->xcv", jnp.concatenate([w[:, j], qg[:, j]], 1), S)  # [B*H,2C,V]
            delta = u[:, j] - X[:, :C]
            outs.append(X[:, C:] + _bmm("xij,xjv->xiv", A_qk[:, j], delta))
            S = decay[:, j, :, None] * S + _bmm("xck,xcv->xkv", kd[:, j], delta)
        o = ungroup(jnp.stack(outs, 1).reshape(B * H * G, C, V))  # [B,L,H,V]
        return S, (o, S_in, pairs)

    S, ys = lax.scan(body, h0.reshape(B * H, K, V), jnp.arange(T // L))
    o, states, pairs = ys
    o = jnp.moveaxis(o, 0, 1).reshape(B, T, H, V)
    return scale * o, S, (states, pairs)


def _backward(cfg, xs, res, do, dS_final):
    """res = (states [T/L,B*H,K,V], pairs): `_forward`'s residuals."""
    scale, C, c, G = cfg
    B, T, H, K = xs[0].shape
    V = xs[2].shape[-1]
    L = G * C
    BH = B * H
    group, ungroup = _layout(B, H, G, C)
    ic = jnp.arange(C)
    incl = (ic[:, None] >= ic[None, :]).astype(f32)

    def body(dS, inp):  # dS: [B*H, K, V] cotangent of the state leaving this step
        i, S, pairs = inp
        sl = lambda x: lax.dynamic_slice_in_dim(x, i * L, L, axis=1)
        gx = lax.optimization_barrier(tuple(group(sl(x)) for x in (*xs, do)))
        q, k, v, g, beta, dO = gx
        dO = scale * dO
        P = reference.chunk_parts(q, k, v, g, beta, c, pairs=pairs)  # decays, w, u: recomputed
        sh = lambda x: x.reshape(BH, G, *x.shape[1:])
        A_qk, w, u, qg, kd, decay, dOs = map(sh, (P.A_qk, P.w, P.u, P.qg, P.kd, P.decay, dO))
        S0s, deltas = [], []
        for j in range(G):  # states and residuals of the group's chunks (recomputed)
            S0s.append(S)
            deltas.append(u[:, j] - _bmm("xck,xkv->xcv", w[:, j], S))
            if j + 1 < G:
                S = decay[:, j, :, None] * S + _bmm("xck,xcv->xkv", kd[:, j], deltas[j])
        dS1s, dDs = [None] * G, [None] * G
        for j in reversed(range(G)):  # the sequential part of the backward
            dS1s[j] = dS
            dD = _bmm("xji,xjv->xiv", A_qk[:, j], dOs[:, j]) + _bmm("xck,xkv->xcv", kd[:, j], dS)
            dDs[j] = dD
            dS = (_bmm("xck,xcv->xkv", jnp.concatenate([qg[:, j], w[:, j]], 1),
                       jnp.concatenate([dOs[:, j], -dD], 1))
                  + decay[:, j, :, None] * dS)
        flat = lambda xs_: jnp.stack(xs_, 1).reshape(BH * G, *xs_[0].shape[1:])
        # Per chunk, the state products contracted over V with the state as the left operand and
        # the [C,V] rows as the right one, then the small [K,C] results transposed: XLA:CPU runs
        # X @ S^T with a materialised S^T (a 2 MB transposing copy per group) or as A @ B^T
        # slower (numbers in docs/speed.md).
        dqwT, dkdT, ddecay = [], [], []
        for j in range(G):
            dqwT.append(_bmm("xkv,xcv->xkc", S0s[j],
                             jnp.concatenate([dOs[:, j], -dDs[j]], 1)))  # [BH,K,2C]
            dkdT.append(_bmm("xkv,xcv->xkc", dS1s[j], deltas[j]))  # [BH,K,C]
            ddecay.append(reference.row_sums(S0s[j] * dS1s[j]))  # [BH,K]
        dqw = jnp.swapaxes(flat(dqwT), 1, 2)  # [X,2C,K]
        dkd = jnp.swapaxes(flat(dkdT), 1, 2)  # [X,C,K]
        ddecay = flat(ddecay)
        delta, dD = flat(deltas), flat(dDs)
        dA_qk = _bmm("xiv,xjv->xij", dO, delta) * incl
        grads = _chunk_terms_bwd(q, k, v, beta, P, dA_qk, dqw[:, C:], dD, dqw[:, :C], dkd,
                                 ddecay)
        return dS, tuple(ungroup(x) for x in grads)

    nsteps = T // L
    dS, grads = lax.scan(body, dS_final.reshape(BH, K, V), (jnp.arange(nsteps), *res),
                         reverse=True)
    grads = tuple(jnp.moveaxis(x, 0, 1).reshape(B, T, *x.shape[3:]) for x in grads)
    return grads, dS.reshape(B, H, K, V)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, g, beta, h0):
    # not differentiated (inference, log-prob passes): the reference's forward, which skips the
    # intermediates the backward reuses, so it runs faster (`python -m benchmarks.kda`)
    scale, C, c, G = cfg
    o, S = reference.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=h0,
                                 output_final_state=True, chunk_size=C, sub_chunk=c,
                                 chunks_per_step=G)
    return o, S  # o already scaled, f32 (the inputs are f32 here)


def _core_fwd(cfg, q, k, v, g, beta, h0):
    xs = (q, k, v, g, beta)
    o, S, kept = _forward(cfg, xs, h0)
    B, _, H, K = q.shape
    return (o, S.reshape(B, H, K, v.shape[-1])), (xs, kept)


def _core_bwd(cfg, res, cts):
    xs, kept = res
    do, dS = cts
    (dq, dk, dv, dg, dbeta), dh0 = _backward(cfg, xs, kept, do.astype(f32), dS.astype(f32))
    return dq, dk, dv, dg, dbeta, dh0


_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "output_final_state", "chunk_size", "sub_chunk", "chunks_per_step"),
)
def kda_chunked_vjp(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    chunk_size=None,
    sub_chunk=reference.CPU_SUB_CHUNK,
    chunks_per_step=None,
):
    """`reference.kda_chunked` with the hand-written backward (module docstring). Same contract:
    q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H], initial_state [B,H,K,V] or None ->
    (o [B,T,H,V] in v's dtype, final state [B,H,K,V] f32 or None)."""
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    chunk_size = reference.cpu_chunk(T, K) if chunk_size is None else chunk_size
    C, c, G, T_pad = scan_plan(T, B * H, chunk_size, sub_chunk, chunks_per_step)
    xs = tuple(pad_time(x.astype(f32), T_pad) for x in (q, k, v, g, beta))
    h0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)
    o, S = _core((float(scale), C, c, G), *xs, h0)
    o = o[:, :T].astype(v.dtype)
    return o, (S if output_final_state else None)
