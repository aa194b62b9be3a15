"""Pure-JAX references for KDA (Kimi Delta Attention): the correctness oracle and the CPU default.

Recurrence (per batch b, head h; state S: [K,V] f32, alpha_t = exp(g_t) per key channel):

    S <- S * exp(g_t)[:, None]                       # fine-grained (per key channel) decay
    S <- S + (beta_t k_t) (v_t - k_t^T S)^T           # delta rule
    o_t = (scale q_t)^T S

Two implementations, same contract as `ops.kda`:

* `kda_recurrent`: one `lax.scan` step per token. Slow, obviously right: the oracle.
* `kda_chunked`: the chunked WY/UT form. Within a chunk of C tokens, with the in-chunk cumulative
  log-decay G_i = sum_{s<=i} g_s ([C,K]),

      A_kk[i,j] = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])        j < i
      A_qk[i,j] =        sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])        j <= i
      (I + A_kk) [w | u] = [beta * k * exp(G) | beta * v]                (unit lower-triangular solve)
      delta = u - w S0                                                   (the delta-rule residuals)
      o     = scale * ((q * exp(G)) S0 + A_qk delta)
      S1    = exp(G_C)[:, None] * S0 + (k * exp(G_C - G))^T delta

  Only the last three lines are sequential. A `lax.scan` walks over groups of chunks
  (`chunks_per_step`, about 32 (batch x head x chunk) tiles per step): the state-independent terms of a group are
  batched, the state recurrence over its chunks is unrolled. Working in groups keeps every
  intermediate cache-sized on CPU instead of materialising [B,H,T,*] temporaries (XLA:CPU pays
  page faults for every fresh buffer above ~32 MB).

Overflow safety. Gates in trained models reach about -1700 per token, so exp(-G_j) overflows
after one token and "factor the decay through one anchor per chunk" gives 0 * inf = NaN. Here
every evaluated exponent is <= 0 and every decay is exact (`chunk_terms`):
  - base blocks of c = `sub_chunk` tokens: pairwise exp(G_i - G_j), j <= i, with the window sum
    sum_{s in (j, i]} g_s accumulated directly;
  - above them a binary tree joins sibling blocks through the boundary m between them,
        exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j),
    both factors in [0, 1] and built as products of per-block decays (never ratios), so a product
    underflows to 0 only where the exact value is < 1e-38.
No exponent is ever a difference of two long cumulative sums: with |G| ~ 1e5 that difference
would keep none of the digits that matter when the window itself is short. Nothing that is
exponentiated is ever masked away afterwards, so gradients stay finite too (no 0 * inf).

Covered: any T (the tail is padded with k = v = q = 0, g = 0, beta = 0, which leaves the state
untouched), optional initial state, f32/bf16 inputs (math in f32, `o` in v's dtype), jax.grad /
jax.vjp by plain autodiff. Not covered: variable-length packed sequences (cu_seqlens); gates > 0
(the contract is g <= 0; positive gates would break the anchoring bound, not the recurrence).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST
CPU_CHUNK = 16  # default chunk of the chunked forms on XLA:CPU (`cpu_chunk`; ops.kda caps at it)
CPU_CHUNK_WIDE = 32  # ... for wide heads over long sequences (`cpu_chunk`)
WIDE_MIN_K, WIDE_MIN_T = 96, 256  # where CPU_CHUNK_WIDE was measured faster
CPU_SUB_CHUNK = 2  # default base sub-chunk of the chunked forms


def cpu_chunk(T: int, K: int) -> int:
    """The chunked forms' default chunk on XLA:CPU for T tokens of key width K: CPU_CHUNK_WIDE
    (32) when K >= 96 and T >= 256, else CPU_CHUNK (16): chunk 32 was faster for wide heads on
    long rows, even at K=V=64 and slower on short rows (forward + `chunked_vjp` backward;
    docs/speed.md: db60f62). Larger chunks make the [C,K] x [K,V]
    state products, which dominate at wide heads, larger matmuls; at few chunks per row they only add intra-chunk work."""
    return CPU_CHUNK_WIDE if K >= WIDE_MIN_K and T >= WIDE_MIN_T else CPU_CHUNK


def _check_shapes(q, k, v, g, beta, initial_state):
    B, T, H, K = q.shape
    if k.shape != (B, T, H, K) or g.shape != (B, T, H, K):
        raise ValueError(f"q, k, g must all be [B,T,H,K]; got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B,T,H,V] with B,T,H of q; got {v.shape} vs {q.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B,T,H]; got {beta.shape}")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B,H,K,V]={(B, H, K, V)}; got {initial_state.shape}")
    return B, T, H, K, V


# ----------------------------------------------------------------------------------------------
# Oracle: token-by-token recurrence.
# ----------------------------------------------------------------------------------------------


def kda_step(q, k, v, g, beta, state, *, scale=None):
    """One decode token. q, k, g: [B,H,K]; v: [B,H,V]; beta: [B,H]; state: [B,H,K,V] f32.

    Returns (o [B,H,V] in v's dtype, new state [B,H,K,V] f32).
    """
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    f32 = jnp.float32
    out_dtype = v.dtype
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    S = state.astype(f32) * jnp.exp(g)[..., None]  # [B,H,K,V]
    kS = jnp.einsum("bhk,bhkv->bhv", k, S, precision=_HI)  # [B,H,V]
    S = S + jnp.einsum("bhk,bhv->bhkv", beta[..., None] * k, v - kS, precision=_HI)
    o = jnp.einsum("bhk,bhkv->bhv", scale * q, S, precision=_HI)  # [B,H,V]
    return o.astype(out_dtype), S


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  remat_every=None):
    """The oracle: a `lax.scan` over tokens of `kda_step`. Shapes as in `ops.kda`.

    remat_every: if set, the scan runs over blocks of that many tokens and each block is
    rematerialised in the backward pass, so reverse-mode memory is T/remat_every states instead
    of T (the plain scan keeps one [B,H,K,V] state per token as a residual).
    """
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    S0 = (
        jnp.zeros((B, H, K, V), jnp.float32)
        if initial_state is None
        else initial_state.astype(jnp.float32)
    )

    def body(S, xs):
        qt, kt, vt, gt, bt = xs
        o, S = kda_step(qt, kt, vt, gt, bt, S, scale=scale)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))  # time-major
    if not remat_every:
        S, o = lax.scan(body, S0, xs)
    else:
        n = -(-T // remat_every)
        pad = n * remat_every - T  # zero tail (k = 0, beta = 0, g = 0) leaves the state alone
        xs = tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in xs)
        xs = tuple(x.reshape(n, remat_every, *x.shape[1:]) for x in xs)
        block = jax.checkpoint(lambda S, xb: lax.scan(body, S, xb))
        S, o = lax.scan(block, S0, xs)
        o = o.reshape(n * remat_every, *o.shape[2:])[:T]
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)  # [B,T,H,V]
    return o, (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# Chunked WY form.
# ----------------------------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def effective_chunk(T: int, chunk_size: int, sub_chunk: int) -> tuple[int, int]:
    """(C, c): the chunk actually used and the base sub-chunk, with C = c * 2^m.

    C is the smallest c * 2^m that reaches min(T, chunk_size) (so short inputs are not padded to
    a full chunk, and a chunk_size that is not c * 2^m is rounded up to one).
    """
    c = max(1, min(sub_chunk, chunk_size))
    C = c
    while C < min(T, chunk_size):
        C *= 2
    return C, c


def scan_plan(T: int, BH: int, chunk_size: int, sub_chunk: int,
              chunks_per_step: int | None) -> tuple[int, int, int, int]:
    """(C, c, G, T_pad) of the chunked forms: chunk and sub-chunk (`effective_chunk`), chunks
    per scan step G (None: every chunk when there are at most 4, else about 32 // BH; BH =
    batch x heads) and T padded to a multiple of G * C."""
    C, c = effective_chunk(T, chunk_size, sub_chunk)
    n_chunks = -(-T // C)
    if chunks_per_step is None:
        chunks_per_step = n_chunks if n_chunks <= 4 else max(1, 32 // BH)
    G = max(1, min(chunks_per_step, n_chunks))
    return C, c, G, _round_up(T, G * C)


def pad_time(x, T_pad: int):
    """x [B,T,...] with a zero tail to T_pad tokens (k = 0, beta = 0, g = 0 leave the state
    untouched)."""
    T = x.shape[1]
    return x if T_pad == T else jnp.pad(x, [(0, 0), (0, T_pad - T)] + [(0, 0)] * (x.ndim - 2))


SMALL_BLOCK = 8  # contractions / outputs of at most this many tokens run elementwise (below)


def row_sums(x):
    """x [..., K] -> [...] summed over K as a GEMV: faster than a reduce on XLA:CPU."""
    return x @ jnp.ones((x.shape[-1],), x.dtype)


def _mm(a, b):
    """Batched [..., n, m] @ [..., m, p]. Tiny blocks (m <= SMALL_BLOCK) as one
    broadcast-multiply-sum: XLA:CPU runs thousands of 4x4 dots far slower than one fused
    elementwise pass."""
    if a.shape[-1] <= SMALL_BLOCK:
        return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)
    return jnp.einsum("...ij,...jk->...ik", a, b, precision=_HI)


def _pair_dots(a, b):
    """[..., i, K] x [..., j, K] -> [..., i, j] = sum_k a_ik b_jk. Small blocks (i, j <=
    SMALL_BLOCK) as one multiply and a GEMV over K: XLA:CPU runs such batched dots with an s x s
    output at 1-5 GFLOP/s, against ~40 for the chunk's large dots."""
    if a.shape[-2] <= SMALL_BLOCK and b.shape[-2] <= SMALL_BLOCK:
        return row_sums(a[..., :, None, :] * b[..., None, :, :])
    return jnp.einsum("...ik,...jk->...ij", a, b, precision=_HI)


def _neumann_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [..., n, n]: (I - L)(I + L^2)(I + L^4)..."""
    n = L.shape[-1]
    T = jnp.eye(n, dtype=L.dtype) - L
    P, m = L, 2
    while m < n:
        P = _mm(P, P)
        T = T + _mm(T, P)
        m *= 2
    return T


class ChunkParts(NamedTuple):
    """`chunk_terms` and the intermediates its hand-written backward (`chunked_vjp.py`) reuses.

    A_qk [X,C,C], w [X,C,K], u [X,C,V], qg [X,C,K], kd [X,C,K], decay [X,K]: as `chunk_terms`;
    A_kk [X,C,C] the strictly-lower k_i.(k_j e^(G_i-G_j)) without beta; Tinv [X,C,C] the
    inverse of I + beta A_kk; eG [X,C,K] e^(G_i); eGc [X,C,K] e^(G_C - G_j); band_dec: per
    offset d = 1..c-1 the base-block decays exp(G_i - G_(i-d)) [X,nb,c-d,K]; levels: per tree
    join of blocks of size s = c, 2c, .. the pair (Rs5, Rc5) [X,np,2,s,K], the decay from each
    block's start to i and from j to its end.
    """

    A_qk: jax.Array
    w: jax.Array
    u: jax.Array
    qg: jax.Array
    kd: jax.Array
    decay: jax.Array
    A_kk: jax.Array
    Tinv: jax.Array
    eG: jax.Array
    eGc: jax.Array
    band_dec: tuple
    levels: tuple


def chunk_terms(q, k, v, g, beta, c):
    """Everything of one chunk that does not depend on the incoming state.

    q, k, g: [X, C, K], v: [X, C, V], beta: [X, C] (f32; X: any flattened batch of chunks);
    C = c * 2^m with c the base sub-chunk.
    Returns (A_qk [X,C,C], w [X,C,K], u [X,C,V], qg [X,C,K], kd [X,C,K], decay [X,K]):
      A_qk  inclusive-lower q_i.(k_j e^(G_i - G_j)),
      [w | u] = (I + A_kk)^-1 beta [k e^G | v], A_kk the strictly-lower k_i.(k_j e^(G_i-G_j)) beta_i,
      qg = q e^G (reads the incoming state), kd = k e^(G_C - G) (writes the outgoing one),
      decay = e^(G_C).

    Exactness for any gate: base sub-blocks of c tokens use pairwise exp(G_i - G_j), j <= i; above
    them a binary tree joins sibling blocks (left Lc, right Rc, boundary m) through
        exp(G_i - G_j) = exp(G_i - G_m) * exp(G_m - G_j),     i in Rc, j in Lc,
    both factors in [0, 1], obtained as products of per-block decays (never a ratio), so nothing
    overflows and underflow only hits values that are below 1e-38 anyway. The inverse
    (I + A_kk)^-1 is assembled along the same tree: inv([[A, 0], [B, D]]) = [[A', 0], [-D'BA', D']].
    """
    return chunk_parts(q, k, v, g, beta, c)[:6]


def chunk_parts(q, k, v, g, beta, c, pairs=None) -> ChunkParts:
    """`chunk_terms` with its intermediates (`ChunkParts`): the same operations, the same numbers.

    pairs: (A_qk, A_kk, Tinv) of these inputs, as an earlier call returned them (the hand-written
    backward keeps them from the forward): only the decays, w, u, qg and kd are then computed,
    not the pairwise products and the inverse (the same numbers either way)."""
    X, C, K = q.shape
    nb = C // c
    gb = g.reshape(X, nb, c, K)
    # Window sums are formed directly (never as differences of cumulative sums, which lose the
    # digits that matter once |G| is large).
    Gin = jnp.cumsum(gb, axis=2)  # [X,nb,c,K] log-decay from the block start to i (inclusive)
    Rs = jnp.exp(Gin)  # rows: decay from the start of i's block to i
    g_after = jnp.concatenate([gb[:, :, 1:, :], jnp.zeros_like(gb[:, :, :1, :])], axis=2)
    Rcs = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(g_after, 2), axis=2), 2))  # decay from j (excl.) to block end
    tot = Rs[:, :, -1, :]  # [X,nb,K] decay over each block

    band_dec = []  # base blocks: exp(G_i - G_{i-d}) for rows i = d..c-1, offset d = 1..c-1
    win = None
    for d in range(1, c):
        # win[i] = sum_{s in (i-d, i]} g_s for rows i = d..c-1, built one term at a time.
        win = gb[:, :, d:, :] if d == 1 else win[:, :, 1:, :] + gb[:, :, 1 : c - d + 1, :]
        band_dec.append(jnp.exp(win))  # [X,nb,c-d,K], exponent <= 0
    levels = []  # per sibling join of blocks of s = c, 2c, ..: (Rs5, Rc5)
    s = c
    while s < C:
        np_ = C // (2 * s)
        Rs5, Rc5 = Rs.reshape(X, np_, 2, s, K), Rcs.reshape(X, np_, 2, s, K)
        t2 = tot.reshape(X, np_, 2, K)
        levels.append((Rs5, Rc5))
        # Decays at the parent granularity (products only).
        Rs = jnp.concatenate([Rs5[:, :, 0], Rs5[:, :, 1] * t2[:, :, 0, None, :]], axis=2)
        Rcs = jnp.concatenate([Rc5[:, :, 0] * t2[:, :, 1, None, :], Rc5[:, :, 1]], axis=2)
        tot = t2[:, :, 0] * t2[:, :, 1]
        s *= 2

    if pairs is None:
        A_qk, A_kk, Tinv = _chunk_pairs(q, k, beta, c, band_dec, levels)
    else:
        A_qk, A_kk, Tinv = pairs
    eG = Rs.reshape(X, C, K)  # e^(G_i)
    eGc = Rcs.reshape(X, C, K)  # e^(G_C - G_j)
    kd = k * eGc  # k_j e^(G_C - G_j)
    decay = tot.reshape(X, K)  # e^(G_C)
    rhs = jnp.concatenate([k * eG, v], axis=-1) * beta[:, :, None]
    wu = jnp.einsum("xij,xjd->xid", Tinv, rhs, precision=_HI)  # [X,C,K+V]
    return ChunkParts(A_qk, wu[..., :K], wu[..., K:], q * eG, kd, decay, A_kk, Tinv, eG, eGc,
                      tuple(band_dec), tuple(levels))


def _chunk_pairs(q, k, beta, c, band_dec, levels):
    """(A_qk, A_kk, Tinv) [X,C,C] of `chunk_parts` from its decays: the base blocks' band, then
    the tree's sibling joins (cross blocks and the inverse's off-diagonal blocks)."""
    X, C, K = q.shape
    nb = C // c
    Z = jnp.stack([q, k], axis=1).reshape(X, 2, nb, c, K)  # row vectors: q for A_qk, k for A_kk
    kb = k.reshape(X, nb, c, K)
    # Base blocks: band by offset d, D[i, i-d] = z_i . k_{i-d} exp(Gin_i - Gin_{i-d}).
    cols = [row_sums(Z * kb[:, None])]
    for d in range(1, c):
        sd = row_sums(Z[:, :, :, d:, :] * (kb[:, :, : c - d, :] * band_dec[d - 1])[:, None])
        cols.append(jnp.pad(sd, [(0, 0), (0, 0), (0, 0), (d, 0)]))
    band = jnp.stack(cols, axis=-1)  # [X,2,nb,c(i),c(d)]
    ic = jnp.arange(c)
    onehot = (ic[:, None, None] - ic[None, :, None] == ic[None, None, :]).astype(q.dtype)
    A = jnp.einsum("xzaid,ijd->xzaij", band, onehot, precision=_HI)  # [X,2,nb,c,c]
    strict = (ic[:, None] > ic[None, :]).astype(q.dtype)
    bb = beta.reshape(X, nb, c)
    Tinv = _neumann_inverse(A[:, 1] * strict * bb[..., None])  # [X,nb,c,c] of I + A_kk blocks

    s = c
    for Rs5, Rc5 in levels:  # join sibling blocks of size s
        np_ = C // (2 * s)
        Z6 = Z.reshape(X, 2, np_, 2, s, K)
        k5 = kb.reshape(X, np_, 2, s, K)
        rows = Z6[:, :, :, 1] * Rs5[:, None, :, 1]  # [X,2,np,s,K] right child, decayed from m
        colv = k5[:, :, 0] * Rc5[:, :, 0]  # [X,np,s,K] left child, decayed to m
        cross = _pair_dots(rows, colv[:, None])  # [X,2,np,s,s]
        A6 = A.reshape(X, 2, np_, 2, s, s)
        zero = jnp.zeros_like(cross)
        A = jnp.concatenate(
            [jnp.concatenate([A6[:, :, :, 0], zero], -1),
             jnp.concatenate([cross, A6[:, :, :, 1]], -1)], axis=-2)  # [X,2,np,2s,2s]
        # Inverse of the k-block: [[T1, 0], [-T2 (beta B) T1, T2]].
        T5 = Tinv.reshape(X, np_, 2, s, s)
        Bk = cross[:, 1] * bb.reshape(X, np_, 2, s)[:, :, 1, :, None]
        T21 = -_mm(T5[:, :, 1], _mm(Bk, T5[:, :, 0]))
        Tinv = jnp.concatenate(
            [jnp.concatenate([T5[:, :, 0], jnp.zeros_like(T21)], -1),
             jnp.concatenate([T21, T5[:, :, 1]], -1)], axis=-2)  # [X,np,2s,2s]
        s *= 2
    A_qk = A[:, 0, 0]  # [X,C,C]
    A_kk = A[:, 1, 0] * (jnp.arange(C)[:, None] > jnp.arange(C)[None, :]).astype(q.dtype)
    return A_qk, A_kk, Tinv.reshape(X, C, C)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "output_final_state", "chunk_size", "sub_chunk", "chunks_per_step"),
)
def kda_chunked(
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
    sub_chunk=CPU_SUB_CHUNK,
    chunks_per_step=None,
):
    """Chunked WY form in pure JAX (f32 math). Same contract and results as `kda_recurrent`.

    A `lax.scan` walks over groups of `chunks_per_step` chunks; the state-independent math of a
    group is batched, the state recurrence over its chunks is unrolled. Working in groups keeps
    every intermediate small (cache-resident on CPU) instead of materialising [B,H,T,*] temps.
    chunks_per_step=None unrolls the whole sequence when it has at most 4 chunks and otherwise
    picks about 32 (batch x head x chunk) tiles per step (8 chunks at B*H=4, one chunk at B*H >=
    32: at chunk 16 the 6-8 chunks of training rows of 96-128 tokens were faster one per step
    than all in one step). The defaults (chunk_size None: `cpu_chunk(T, K)`, 16 or 32;
    sub-chunk 2) were faster than chunk 32 / sub-chunk 4 at the matched RL shape, the demo's
    SFT and RL shapes and B1 T2048 (forward + `chunked_vjp` backward; numbers in
    docs/speed.md); sub-chunk 1 and 4 at chunk 16 were slower.
    """
    B, T, H, K, V = _check_shapes(q, k, v, g, beta, initial_state)
    scale = K**-0.5 if scale is None else scale
    chunk_size = cpu_chunk(T, K) if chunk_size is None else chunk_size
    C, c, G, T_pad = scan_plan(T, B * H, chunk_size, sub_chunk, chunks_per_step)
    L = G * C  # tokens per scan step
    f32 = jnp.float32
    q, k, v, g, beta = (pad_time(x, T_pad) for x in (q, k, v, g, beta))
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

    nsteps = T_pad // L

    def group(x):  # [B,L,H,...] -> [B*H*G, C, ...] f32
        tail = x.shape[3:]
        x = jnp.moveaxis(x.astype(f32).reshape(B, G, C, H, *tail), 3, 1)  # [B,H,G,C,...]
        return x.reshape(B * H * G, C, *tail)

    def body(S, i):  # S: [B*H, K, V]
        sl = lambda x: lax.dynamic_slice_in_dim(x, i * L, L, axis=1)
        # Materialise the step's transposed inputs once (else XLA re-fuses the strided reads).
        xs = lax.optimization_barrier(tuple(group(sl(x)) for x in (q, k, v, g, beta)))
        A_qk, w, u, qg, kd, decay = chunk_terms(*xs, c)
        sh = lambda x: x.reshape(B * H, G, *x.shape[1:])  # [B*H, G, ...]
        A_qk, w, u, qg, kd, decay = map(sh, (A_qk, w, u, qg, kd, decay))
        outs = []
        for j in range(G):  # the only sequential part: state across the group's chunks
            X = jnp.einsum("xck,xkv->xcv", jnp.concatenate([w[:, j], qg[:, j]], 1), S,
                           precision=_HI)  # [B*H, 2C, V]
            delta = u[:, j] - X[:, :C]
            outs.append(X[:, C:] + jnp.einsum("xij,xjv->xiv", A_qk[:, j], delta, precision=_HI))
            S = decay[:, j, :, None] * S + jnp.einsum("xck,xcv->xkv", kd[:, j], delta,
                                                       precision=_HI)
        o = jnp.stack(outs, 1).reshape(B, H, L, V)
        return S, jnp.moveaxis(o, 1, 2)  # [B,L,H,V]

    S, o = lax.scan(body, S0.reshape(B * H, K, V), jnp.arange(nsteps))
    o = jnp.moveaxis(o, 0, 1).reshape(B, T_pad, H, V)[:, :T]  # [B,T,H,V]
    o = (scale * o).astype(v.dtype)
    return o, (S.reshape(B, H, K, V) if output_final_state else None)
