"""Per-chunk KDA math on 2-D tiles, written to lower inside Pallas kernels (Mosaic TPU, Triton).

Every function here takes and returns f32 *values* of one chunk of one (batch, head):
q, k, g: [C,K], v: [C,V], beta: [C,1], states S: [K,V]. Only 2-D dots, elementwise ops, `where`,
`exp`, keep-dim reductions and iotas are used (no value slicing, reshapes, concatenates or 3-D
tensors, which Triton and Mosaic handle poorly or not at all). Row blocks are picked out with
one-hot selection matmuls (exact), and the in-block loops are `lax.fori_loop`s.

Notation: G = in-chunk cumulative log-decay (G_i = sum_{s<=i} g_s, [C,K]); the chunk is split into
ns = C // c row blocks of c rows; P_a = G at the row before block a (0 for a = 0), E_b = G at the
last row of block b. All exponents that are evaluated are <= 0:
  - off-diagonal blocks (row block a > column block b): exp(G_i - G_j) =
    exp(G_i - P_a) * exp(P_a - G_j) for rows (RowC, forward) or exp(G_i - E_b) * exp(E_b - G_j)
    for columns (ColC), both factors in [0, 1];
  - diagonal blocks: exact exp(G_i - G_j), j <= i, one column (or row) per loop step.
So gates of -1700 per token are fine (underflow to 0 only where the true value is < 1e-38).
Every exponent is also computed as a direct window sum sum_{s in (j, i]} g_s (a masked matmul),
never as a difference of two cumulative sums: with |G| ~ 1e5 such a difference would lose all
the digits that matter when the window itself is small.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST
f32 = jnp.float32
NEG_INF = -jnp.inf


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def dot(a, b):  # a @ b
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=f32)


def dot_t(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=f32)


def tdot(a, b):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI, preferred_element_type=f32)


def col_to_row(x):  # [n,1] -> [1,n] without a transpose op
    n = x.shape[0]
    return jnp.sum(jnp.where(_iota((n, n), 0) == _iota((n, n), 1), x, 0.0), axis=0, keepdims=True)


def row_to_col(x):  # [1,n] -> [n,1]
    n = x.shape[1]
    return jnp.sum(jnp.where(_iota((n, n), 0) == _iota((n, n), 1), x, 0.0), axis=1, keepdims=True)


def _pick_row(x, i):  # row i (traced ok) of x [n,m] -> [1,m]
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _pick_col(x, j):  # column j of x [n,m] -> [n,1]
    return jnp.sum(jnp.where(_iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


def _select(a, c, C):  # [c,C] one-hot: row i -> column a*c + i
    return (_iota((c, C), 1) == _iota((c, C), 0) + a * c).astype(f32)


def _masked_exp(mask, x):
    return jnp.exp(jnp.where(mask, x, NEG_INF))


def cumsum_rows(g):
    """G = inclusive cumulative sum over rows, as a lower-triangular matmul. [C,K] -> [C,K]."""
    C = g.shape[0]
    tril = (_iota((C, C), 0) >= _iota((C, C), 1)).astype(f32)
    return dot(tril, g)


def rev_cumsum_rows(dG):
    """dg_t = sum_{i >= t} dG_i (the transpose of `cumsum_rows`)."""
    C = dG.shape[0]
    tril = (_iota((C, C), 0) >= _iota((C, C), 1)).astype(f32)
    return tdot(tril, dG)


def window_sum(g, lo, hi, rows, offset=0):
    """W[i] = sum_{s : lo_i < s <= hi_i} g_s for the `rows` rows i = offset.. (lo, hi: int maps
    of the [rows, C] iotas (i, s)). A masked matmul: a direct sum, no cancellation."""
    C = g.shape[0]
    i, s = _iota((rows, C), 0) + offset, _iota((rows, C), 1)
    return dot(((s > lo(i)) & (s <= hi(i))).astype(f32), g)


def _diag_decay(ga, j, c):
    """[c,K]: exp(sum_{s in (j, i]} g_s) for in-block rows i >= j (0 for i < j); ga: [c,K]."""
    i, s = _iota((c, c), 0), _iota((c, c), 1)
    win = dot(((s > j) & (s <= i)).astype(f32), ga)
    return _masked_exp(_iota((c, 1), 0) >= j, win)


def pair_matrices(rows, colv, g, c):
    """For each r in `rows`: M[i,j] = sum_d r_i[d] colv_j[d] exp(G_i[d] - G_j[d]) for j <= i
    (0 above), [C,C]. The decays are shared by all `rows`."""
    C = g.shape[0]
    rC, cC = _iota((C, 1), 0), _iota((1, C), 1)

    def block(a, outs):  # row block a
        s0 = a * c
        Sa = _select(a, c, C)
        ga, ca = dot(Sa, g), dot(Sa, colv)  # [c,K]
        ras = [dot(Sa, r) for r in rows]
        # rows: decay from the block start; columns j < s0: decay from j to the block start.
        rsc = jnp.exp(window_sum(g, lambda i: s0 - 1, lambda i: i, c, s0))
        cs = colv * _masked_exp(rC < s0, window_sum(g, lambda j: j, lambda j: s0 - 1, C))
        blks = tuple(dot_t(ra * rsc, cs) for ra in ras)  # [c,C] each

        def diag(j, accs):  # column s0 + j of the diagonal block, exact
            e = _pick_row(ca, j) * _diag_decay(ga, j, c)  # [c,K]
            onehot = (cC == s0 + j).astype(f32)
            return tuple(acc + jnp.sum(ra * e, axis=1, keepdims=True) * onehot
                         for acc, ra in zip(accs, ras, strict=True))

        blks = lax.fori_loop(0, c, diag, blks)
        return tuple(out + tdot(Sa, blk) for out, blk in zip(outs, blks, strict=True))

    zeros = tuple(jnp.zeros((C, C), f32) for _ in rows)
    return lax.fori_loop(0, C // c, block, zeros)


def row_contract(Ms, x, g, c):
    """For each M in `Ms`: out_i = sum_{j <= i} M[i,j] x_j exp(G_i - G_j); M: [C,C], x: [C,K]."""
    C = g.shape[0]
    rC = _iota((C, 1), 0)

    def block(a, outs):  # row block a
        s0 = a * c
        Sa = _select(a, c, C)
        ga, xa = dot(Sa, g), dot(Sa, x)  # [c,K]
        Mas = [dot(Sa, M) for M in Ms]  # [c,C]
        rsc = jnp.exp(window_sum(g, lambda i: s0 - 1, lambda i: i, c, s0))
        xs = x * _masked_exp(rC < s0, window_sum(g, lambda j: j, lambda j: s0 - 1, C))
        blks = tuple(dot(Ma, xs) * rsc for Ma in Mas)  # [c,K]
        Mdds = [dot_t(Ma, Sa) for Ma in Mas]  # [c,c] diagonal blocks

        def diag(j, accs):
            e = _pick_row(xa, j) * _diag_decay(ga, j, c)
            return tuple(acc + _pick_col(Mdd, j) * e for acc, Mdd in zip(accs, Mdds, strict=True))

        blks = lax.fori_loop(0, c, diag, blks)
        return tuple(out + tdot(Sa, blk) for out, blk in zip(outs, blks, strict=True))

    return lax.fori_loop(0, C // c, block, tuple(jnp.zeros(x.shape, f32) for _ in Ms))


def col_contract(pairs, g, c):
    """For each (M, x) in `pairs`: out_j = sum_{i >= j} M[i,j] x_i exp(G_i - G_j)."""
    C = g.shape[0]
    rC, rc = _iota((C, 1), 0), _iota((c, 1), 0)
    eye_c = (_iota((c, c), 0) == _iota((c, c), 1)).astype(f32)

    def block(b, outs):  # column block b
        s0, e0 = b * c, (b + 1) * c - 1  # first and last row of block b
        Sb = _select(b, c, C)
        gb = dot(Sb, g)
        # rows i > e0: decay from the block end to i; columns j in b: decay from j to the end.
        rsc = _masked_exp(rC > e0, window_sum(g, lambda i: e0, lambda i: i, C))
        csc = jnp.exp(window_sum(g, lambda j: j, lambda j: e0, c, s0))
        Mbs = [dot_t(M, Sb) for M, _ in pairs]  # [C,c] columns of block b
        xbs = [dot(Sb, x) for _, x in pairs]
        blks = tuple(tdot(Mb, x * rsc) * csc for Mb, (_, x) in zip(Mbs, pairs, strict=True))
        MddTs = [tdot(Mb, tdot(Sb, eye_c)) for Mb in Mbs]  # [c(j), c(i)] diagonal blocks^T

        def diag(i, accs):  # row s0 + i of the diagonal block feeds columns j <= i
            jj, s = _iota((c, c), 0), _iota((c, c), 1)
            win = dot(((s > jj) & (s <= i)).astype(f32), gb)  # sum_{s in (j, i]} g_s
            e = _masked_exp(rc <= i, win)
            return tuple(acc + _pick_col(MddT, i) * _pick_row(xb, i) * e
                         for acc, MddT, xb in zip(accs, MddTs, xbs, strict=True))

        blks = lax.fori_loop(0, c, diag, blks)
        return tuple(out + tdot(Sb, blk) for out, blk in zip(outs, blks, strict=True))

    return lax.fori_loop(0, C // c, block, tuple(jnp.zeros(x.shape, f32) for _, x in pairs))


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [C,C]: (I - A)(I + A^2)(I + A^4)..."""
    C = A.shape[0]
    eye = (_iota((C, C), 0) == _iota((C, C), 1)).astype(f32)
    T, P, m = eye - A, A, 2
    while m < C:
        P = dot(P, P)
        T = T + dot(T, P)
        m *= 2
    return T


def _masks(C):
    r, cc = _iota((C, C), 0), _iota((C, C), 1)
    return r >= cc, r > cc


def intra_forward(q, k, v, g, beta, c):
    """State-independent terms of one chunk.

    Returns A_qk [C,C] (inclusive lower), w [C,K], u [C,V], qg = q e^G [C,K],
    kd = k e^(G_C - G) [C,K], decay = e^(G_C) as a column [K,1].
    """
    C = q.shape[0]
    incl, strict = _masks(C)
    Aqk, Pk = pair_matrices((q, k), k, g, c)
    Aqk = jnp.where(incl, Aqk, 0.0)
    Akk = jnp.where(strict, Pk, 0.0) * beta
    T = unit_lower_inverse(Akk)
    eG = jnp.exp(cumsum_rows(g))  # e^(G_i)
    ed = jnp.exp(window_sum(g, lambda j: j, lambda j: C - 1, C))  # e^(G_C - G_j)
    glast = jnp.sum(g, axis=0, keepdims=True)  # [1,K] = G_C
    w = dot(T, beta * k * eG)
    u = dot(T, beta * v)
    return Aqk, w, u, q * eG, k * ed, row_to_col(jnp.exp(glast))


def state_forward(Aqk, w, u, qg, kd, decay, S, scale):
    """One chunk of the sequential pass: (o [C,V], S_next [K,V]) from the state S [K,V]."""
    delta = u - dot(w, S)  # [C,V]
    o = scale * (dot(qg, S) + dot(Aqk, delta))
    return o, decay * S + tdot(kd, delta)


def state_backward(Aqk, w, qg, kd, decay, do, dS_next, scale):
    """Reverse step: gradient w.r.t. the state entering the chunk, from the one leaving it."""
    ddelta = scale * tdot(Aqk, do) + dot(kd, dS_next)  # [C,V]
    return scale * tdot(qg, do) + decay * dS_next - tdot(w, ddelta)


def intra_backward(q, k, v, g, beta, S, dS_next, do, scale, c):
    """Gradients of one chunk w.r.t. (q, k, v, g, beta), given the state S entering it, the
    cotangent dS_next of the state leaving it and do of its outputs (recomputes the forward)."""
    C = q.shape[0]
    incl, strict = _masks(C)
    Aqk, Pk = pair_matrices((q, k), k, g, c)
    Aqk = jnp.where(incl, Aqk, 0.0)
    Pk = jnp.where(strict, Pk, 0.0)  # A_kk before the beta row scaling
    T = unit_lower_inverse(Pk * beta)
    eG = jnp.exp(cumsum_rows(g))
    glast = jnp.sum(g, axis=0, keepdims=True)  # [1,K]
    ed = jnp.exp(window_sum(g, lambda j: j, lambda j: C - 1, C))  # e^(G_C - G_j)
    kd = k * ed
    bk, bv = beta * k * eG, beta * v
    w, u = dot(T, bk), dot(T, bv)
    delta = u - dot(w, S)

    dqg = scale * dot_t(do, S)  # [C,K]
    dAq = jnp.where(incl, scale * dot_t(do, delta), 0.0)  # [C,C]
    ddelta = scale * tdot(Aqk, do) + dot(kd, dS_next)  # [C,V]
    dkd = dot_t(delta, dS_next)  # [C,K]
    ddecay = col_to_row(jnp.sum(S * dS_next, axis=1, keepdims=True))  # [1,K]
    dw = -dot_t(ddelta, S)
    dbv, dbk = tdot(T, ddelta), tdot(T, dw)
    dAk = jnp.where(strict, -(dot_t(dbv, u) + dot_t(dbk, w)), 0.0)
    dP = dAk * beta

    rq, rk = row_contract((dAq, dP), k, g, c)  # d/dq through A_qk, d/dk (rows) through A_kk
    cq, ck = col_contract(((dAq, q), (dP, k)), g, c)  # d/dk (columns) through A_qk and A_kk

    dq = eG * dqg + rq
    dk = beta * eG * dbk + ed * dkd + cq + rk + ck
    dv = beta * dbv
    dbeta = (jnp.sum(v * dbv, axis=1, keepdims=True) + jnp.sum(k * eG * dbk, axis=1, keepdims=True)
             + jnp.sum(dAk * Pk, axis=1, keepdims=True))  # [C,1]
    X = kd * dkd
    dG = eG * (beta * k * dbk + q * dqg) - X + q * rq - k * cq + k * rk - k * ck
    last = (_iota((C, 1), 0) == C - 1).astype(f32)
    dG = dG + last * (jnp.sum(X, axis=0, keepdims=True) + jnp.exp(glast) * ddecay)
    return dq, dk, dv, rev_cumsum_rows(dG), dbeta
