"""DeepSeek Sparse Attention layer: MLA (absorbed, MQA over a latent KV) + lightning indexer.

  q_a   = RMSNorm(W_qa x)                                  # [B,T,q_lora]
  q     = W_qb q_a -> q_nope [B,T,H,n], q_pe [B,T,H,r]      (RoPE on q_pe)
  c_kv  = W_kva x -> latent c [B,T,L] (RMSNorm) | k_pe [B,T,r] shared by heads (RoPE)
  MLA absorbed: q_lat = q_nope W_uk  (per head, [n] -> [L]);  kv = [c ; k_pe]  [B,S,L+r]
  indexer: q_I = W_Iq q_a [B,T,HI,DI], k_I = LayerNorm(W_Ik x) [B,S,DI] (partial RoPE on the first
           index_rope_dim channels), w = W_Iw x [B,T,HI] * HI^-1/2 * DI^-1/2
           I[t,s] = sum_j w[t,j] relu(q_I[t,j] . k_I[s]) ; top-k keys per query (causal)
  o_lat = sparse_attention(q=[q_lat; q_pe], kv, top-k indices)   # [B,T,H,L]
  out   = W_o (o_lat W_uv)                                 # W_uv: per head [L] -> [v_head_dim]

Options for checkpoints of other layouts (model/hf/): `q_lora_rank=0` projects q straight from x
(`q` [D, H*(n+r)], no q_a/q_b), `indexer=False` drops the indexer (plain MLA: every causal key,
no idx_* parameters, no k_idx cache), `latent_norm_eps` / `index_norm_eps` set the eps of the two
latent RMSNorms / of the indexer's key LayerNorm.

The decode cache (DSACache) holds only the latent row kv [B,S,L+r] and the indexer key [B,S,DI]
per token. Layer kind "D" (`KIND`, model/layers/registry.py): its config section `dsa` is
`DSAConfig` (validated here, including the kernel choice against the dsa ops' dispatch tables).

Indexer training (DeepSeek-V3.2): `indexer_stage="dense_warmup"` attends densely and trains the
indexer with KL(p || softmax(I)) over all causal keys, p = head-averaged main attention; the
"sparse" stage attends through the top-k selection and takes the KL over the selected keys only.
In both, p is a stop-gradient target and the indexer's inputs are detached, so the KL trains only
the indexer (freezing the rest during warm-up is the optimizer's job: mask the other params).

Positions (`dsa.positions`, `dsa.rope_scaling`; formulas in model/layers/rope.py):
  "rope"  q_pe, k_pe and the indexer's first index_rope_dim channels are rotated. With
          rope_scaling="yarn" all three use YaRN's frequencies; the MLA softmax scale (also used
          by the indexer KL's target p) is multiplied by mscale(s, mscale_all_dim)**2 and q_pe,
          k_pe by mscale(s, mscale)/mscale(s, mscale_all_dim), as in DeepSeek-V3. The indexer's
          scores get no mscale (DeepSeek-V3.2's indexer has none; a positive scale would not
          change its top-k anyway).
  "nope"  nothing is rotated (Kimi Linear's MLA layers: the KDA layers carry position, and there
          is no rotary frequency to extrapolate at long context). The q_pe/k_pe channels stay
          (same parameters and cache) as plain content channels. The indexer drops its rotation
          too: its KL target p is then a function of key content only, so a rotary term could
          only add a position-dependent error to its scores (and extrapolate badly past the
          trained length). A NoPE layer is position-free: its output depends on the visible keys'
          content and the causal mask, not on the position ids.
"""

import dataclasses
from typing import TypedDict

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.config_base import check_kernel, require
from model.layers.linear import dense
from model.layers.norms import LayerNorm, RMSNorm
from model.layers.registry import LayerKind
from model.layers.rope import YaRN, apply_rope
from pallas_kernels.dsa import ops as dsa_ops

INDEXER_STAGES = ("dense_warmup", "sparse")
DSA_POSITIONS = ("rope", "nope")
ROPE_SCALINGS = ("none", "yarn")  # model/layers/rope.py


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """MLA attention with the DeepSeek-V3.2 lightning indexer and top-k token selection
    (section `dsa`)."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_rope_dim: int
    index_topk: int
    rope_theta: float = 10000.0
    indexer_stage: str = "sparse"  # "dense_warmup": dense attention, KL over all causal keys
    indexer_loss_weight: float = 0.0  # 0 disables the indexer KL (and its cost)
    # > 0: the indexer KL of sequences longer than this runs in chunks of this many queries,
    # each recomputed in the backward (indexer_kl_chunked: less memory, more compute); 0: one
    # pass with [B,T,S] residuals
    indexer_kl_chunk: int = 0
    impl: str = "auto"  # kernel dispatch (pallas_kernels/dsa/ops.py: *_DISPATCH)
    # Positions (model/layers/dsa.py): "rope" rotates q_pe/k_pe and the indexer's rope channels;
    # "nope" rotates nothing (Kimi Linear's MLA layers; the indexer follows, see dsa.py).
    positions: str = "rope"
    # Long-context RoPE scaling (model/layers/rope.py: YaRN as in DeepSeek-V3): "none" | "yarn".
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # s: context extension factor (1 = plain RoPE)
    rope_original_max_position: int = 4096  # the pre-extension training length L
    rope_beta_fast: float = 32.0  # dims with > beta_fast rotations over L keep their frequency
    rope_beta_slow: float = 1.0  # dims with < beta_slow rotations over L are interpolated by 1/s
    rope_mscale: float = 1.0  # rotary channels scaled by mscale(s, this) / mscale(s, all_dim)
    rope_mscale_all_dim: float = 1.0  # softmax scale multiplied by mscale(s, this)**2
    # False: plain MLA, no lightning indexer (no idx_* parameters, no k_idx cache, every causal
    # key attended; the index_* fields are then unused and may be 0): Kimi Linear's MLA layers
    indexer: bool = True
    # eps of the q_a and kv_a latent RMSNorms; 0: the model's norm_eps (HF's Kimi Linear builds
    # them with 1e-6 whatever its rms_norm_eps)
    latent_norm_eps: float = 0.0
    # eps of the indexer's key LayerNorm; 0: the model's norm_eps (DeepSeek-V3.2 uses 1e-6)
    index_norm_eps: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # width of one cached token: latent KV + shared rope key
        return self.kv_lora_rank + self.qk_rope_head_dim

    def validate(self, model, section: str = "dsa") -> None:
        """Raise model.config.ConfigError naming the field (`model`: the ModelConfig)."""
        p = section
        positive = ["num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim"]
        if self.indexer:
            positive += ["q_lora_rank", "index_n_heads", "index_head_dim", "index_topk"]
        for f in positive:
            require(getattr(self, f) > 0, f"{p}.{f}", "must be positive")
        require(self.q_lora_rank >= 0, f"{p}.q_lora_rank",
                "must be >= 0 (0: queries straight from the input, no low-rank q; needs "
                f"{p}.indexer=False, whose queries read the q latent)")
        for f in ("latent_norm_eps", "index_norm_eps"):
            require(getattr(self, f) >= 0, f"{p}.{f}", "must be >= 0 (0: the model's norm_eps)")
        require(self.qk_rope_head_dim % 2 == 0, f"{p}.qk_rope_head_dim",
                "must be even (RoPE pairs)")
        if self.indexer:
            require(0 <= self.index_rope_dim <= self.index_head_dim
                    and self.index_rope_dim % 2 == 0,
                    f"{p}.index_rope_dim", f"must be even and <= {p}.index_head_dim")
        else:
            require(self.indexer_loss_weight == 0, f"{p}.indexer_loss_weight",
                    f"must be 0 with {p}.indexer=False (there is no indexer to train)")
        require(self.indexer_stage in INDEXER_STAGES, f"{p}.indexer_stage",
                f"must be one of {INDEXER_STAGES}")
        require(self.indexer_kl_chunk >= 0, f"{p}.indexer_kl_chunk",
                "must be >= 0 (0: the KL in one pass)")
        check_kernel(dsa_ops.INDEXER_DISPATCH, self.impl, f"{p}.impl", dtype=model.dtype)
        check_kernel(dsa_ops.SPARSE_DISPATCH, self.impl, f"{p}.impl", dtype=model.dtype,
                     v_dim=self.kv_lora_rank, D=self.latent_dim)
        self._validate_positions(model, p)

    def _validate_positions(self, model, p: str) -> None:
        require(self.positions in DSA_POSITIONS, f"{p}.positions",
                f"must be one of {DSA_POSITIONS} (rope: rotary positions; nope: none, as in "
                "Kimi Linear's MLA layers)")
        require(self.rope_scaling in ROPE_SCALINGS, f"{p}.rope_scaling",
                f"must be one of {ROPE_SCALINGS}")
        require(self.rope_theta > 0, f"{p}.rope_theta", "must be positive")
        if self.rope_scaling == "none":
            return
        require(self.positions == "rope", f"{p}.rope_scaling",
                f"{self.rope_scaling!r} scales rotary positions, but {p}.positions='nope' has "
                f"none: set {p}.rope_scaling='none' or {p}.positions='rope'")
        require(self.rope_factor >= 1.0, f"{p}.rope_factor",
                f"must be >= 1 (the context extension factor), got {self.rope_factor}")
        require(self.rope_original_max_position > 0, f"{p}.rope_original_max_position",
                "must be positive (the context length the model was trained at before scaling)")
        require(0 < self.rope_beta_slow < self.rope_beta_fast,
                f"{p}.rope_beta_fast/rope_beta_slow",
                f"need 0 < beta_slow < beta_fast, got beta_slow={self.rope_beta_slow}, "
                f"beta_fast={self.rope_beta_fast}")
        require(self.rope_mscale >= 0 and self.rope_mscale_all_dim >= 0,
                f"{p}.rope_mscale/rope_mscale_all_dim", "must be >= 0")
        reach = self.rope_factor * self.rope_original_max_position
        require(model.max_seq_len <= reach, "model.max_seq_len",
                f"{model.max_seq_len} is beyond what YaRN is configured for ({p}.rope_factor x "
                f"{p}.rope_original_max_position = {reach:g}): raise {p}.rope_factor")


class DSACache(TypedDict):
    """Decode cache of one DSA layer: a row per position < max_len."""

    kv: jax.Array  # [B, S, kv_lora_rank + qk_rope_head_dim] latent KV + shared rope key
    k_idx: jax.Array  # [B, S, index_head_dim] lightning-indexer keys (absent: indexer=False)


def write_rows(buf: jax.Array, new: jax.Array, offset: jax.Array) -> jax.Array:
    """buf [B,S,...] <- new [B,T,...] at rows offset[b] .. offset[b]+T (per batch row)."""
    return jax.vmap(lambda b, n, o: jax.lax.dynamic_update_slice_in_dim(b, n, o, axis=0))(
        buf, new.astype(buf.dtype), offset)


def causal_mask(T: int, S: int, q_offset: jax.Array) -> jax.Array:
    """[B,T,S] bool: key s visible to query t of row b iff s <= t + q_offset[b]."""
    t = jnp.arange(T)[None, :, None] + q_offset[:, None, None]
    return jnp.arange(S)[None, None, :] <= t


def indexer_kl(q, kv, scores, key_mask, valid_q, scale) -> jax.Array:
    """Mean over valid queries of KL(p || softmax(I)) over the keys in key_mask.

    q [B,T,H,D], kv [B,S,D], scores [B,T,S] (indexer logits), key_mask [B,T,S] bool.
    p = head-averaged main attention restricted to key_mask, a stop-gradient target.
    """
    kl = _query_kls(q, kv, scores, key_mask, scale)  # [B,T]
    n = jnp.maximum(jnp.sum(valid_q), 1)
    return jnp.sum(jnp.where(valid_q, kl, 0.0)) / n


def _query_kls(q, kv, scores, key_mask, scale):
    """Per query [B,T]: KL(p || softmax(scores)) over the keys in key_mask [B,T,S], p the
    head-averaged main attention there (a stop-gradient target)."""
    p = jax.lax.stop_gradient(head_mean_attention(q, kv, key_mask, scale))  # [B,T,S]
    log_q = jax.nn.log_softmax(jnp.where(key_mask, scores, -jnp.inf), axis=-1)
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def indexer_kl_chunked(q, kv, q_idx, k_idx, w_idx, valid_q, scale, *, q_offset, chunk: int,
                       idx=None, impl: str = "auto") -> jax.Array:
    """`indexer_kl` computed `chunk` queries at a time (dsa.indexer_kl_chunk), the indexer
    scores included, each chunk under jax.checkpoint: the backward keeps the inputs, not the
    [B,T,S] scores, log-probabilities and attention targets (nor the forward's [B,H,T,S]
    logits at once), and recomputes each chunk's forward. Same value and gradients as
    indexer_kl up to float summation order. Measured on one layer (CPU, B=1, 4 heads; README,
    "Long context"): compiled temporaries at T=8192 7.1 -> 3.0 GiB (dense stage) and 5.7 ->
    2.9 GiB (sparse), fwd+bwd 1.5-1.6x slower at T=2048.

    q [B,T,H,D], kv [B,S,D] (targets: stop-gradient), q_idx [B,T,HI,DI], k_idx [B,S,DI],
    w_idx [B,T,HI] (the indexer's inputs), valid_q [B,T], q_offset [B]; idx [B,T,k] (the
    sparse stage's selection, -1 = none) restricts the keys to the selected causal ones, None
    keeps every causal key (dense stage)."""
    B, T = valid_q.shape
    S = kv.shape[1]
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [B,T,...] -> [n,B,C,...] (padded queries are invalid)
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
        return jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 1, 0)

    kv = jax.lax.stop_gradient(kv)

    @jax.checkpoint
    def one(qc, qic, wc, vc, ic, t0):
        key_mask = causal_mask(C, S, q_offset + t0)  # [B,C,S]
        if ic is not None:
            key_mask = key_mask & selected_key_mask(ic, S)
        scores = dsa_ops.indexer_scores(qic, k_idx.astype(qic.dtype), wc, impl=impl)
        kl = _query_kls(qc, kv, scores, key_mask, scale)  # [B,C]
        return jnp.sum(jnp.where(vc, kl, 0.0))

    def body(total, xs):
        return total + one(*xs), None

    xs = (chunks(jax.lax.stop_gradient(q)), chunks(q_idx), chunks(w_idx), chunks(valid_q),
          chunks(idx), jnp.arange(n, dtype=jnp.int32) * C)
    total, _ = jax.lax.scan(body, jnp.float32(0.0), xs)
    return total / jnp.maximum(jnp.sum(valid_q), 1)


def rope_scaling(cfg: DSAConfig) -> YaRN | None:
    """The YaRN parameters of the layer, or None for plain RoPE / NoPE."""
    if cfg.positions != "rope" or cfg.rope_scaling != "yarn":
        return None
    return YaRN(cfg.rope_factor, cfg.rope_original_max_position, cfg.rope_beta_fast,
                cfg.rope_beta_slow, cfg.rope_mscale, cfg.rope_mscale_all_dim)


def softmax_scale(cfg: DSAConfig) -> float:
    """qk_head_dim**-0.5, times YaRN's mscale(s, mscale_all_dim)**2 when YaRN is on."""
    y = rope_scaling(cfg)
    return cfg.qk_head_dim ** -0.5 * (y.softmax_scale_factor() if y is not None else 1.0)


def topk_recall(p, scores, key_mask, valid_q, k: int) -> tuple[jax.Array, jax.Array]:
    """How many of the k keys with the most attention the indexer's top-k picks, per query.

    p [B,T,S] head-averaged attention probabilities, scores [B,T,S] indexer logits, key_mask
    [B,T,S] causal keys, valid_q [B,T]. Only queries with more than k causal keys count (with
    fewer, top-k selection keeps every key and recall is trivially 1). Returns (sum over those
    queries of |top_k(p) & top_k(I)| / k, number of those queries)."""
    S = p.shape[-1]
    k = min(k, S)
    top_p = jax.lax.top_k(jnp.where(key_mask, p, -1.0), k)[1]  # [B,T,k]
    top_i = jax.lax.top_k(jnp.where(key_mask, scores, -jnp.inf), k)[1]  # [B,T,k]
    hits = jnp.sum(jnp.any(top_i[..., :, None] == top_p[..., None, :], axis=-1), axis=-1)
    eligible = valid_q & (jnp.sum(key_mask, axis=-1) > k)  # [B,T]
    return (jnp.sum(jnp.where(eligible, hits / k, 0.0)),
            jnp.sum(eligible).astype(jnp.float32))


def selected_key_mask(idx: jax.Array, S: int) -> jax.Array:
    """[B,T,S] bool: key s is one of query t's top-k indices idx [B,T,K] (-1 slots select
    nothing)."""
    B, T, _ = idx.shape
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    sel = jnp.zeros((B, T, S + 1), bool).at[bi, ti, jnp.where(idx >= 0, idx, S)].set(True)
    return sel[..., :S]


def masked_dense_attention(q, kv, key_mask, scale, v_dim: int) -> jax.Array:
    """Softmax attention of q [B,T,H,D] over kv [B,S,D] restricted to key_mask [B,T,S] (values
    kv[..., :v_dim]; f32 softmax; a query with no key outputs 0) -> [B,T,H,v_dim] in q's dtype.
    With key_mask = causal & the top-k selection it equals sparse_attention over those indices
    (the same keys, the same softmax): the dense form of the token-sparse path."""
    f32 = jnp.float32
    logits = jnp.einsum("bthd,bsd->bths", q.astype(f32), kv.astype(f32)) * scale
    m4 = key_mask[:, :, None, :]  # [B,T,1,S]
    logits = jnp.where(m4, logits, -jnp.inf)
    mx = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.where(m4, jnp.exp(logits - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bths,bsv->bthv", p, kv[..., :v_dim].astype(f32))
    return (o / jnp.where(den > 0, den, 1.0)).astype(q.dtype)


# Training-path choice between the token-sparse gather and its dense equivalents (see
# `sparse_path`): on XLA's gather path, masked-dense scores beat the gather until the keys
# outnumber top-k by about 12 (`python scripts/bench.py rl`, its dsa_paths part; numbers in
# docs/speed.md). Masked-dense's [B,T,H,S] scores are bounded by MASKED_DENSE_MAX_SCORES
# elements (f32: 256 MiB; the indexer KL's target already holds scores of that size in training).
MASKED_DENSE_MAX_RATIO = 12
MASKED_DENSE_MAX_SCORES = 1 << 26
# With a cache longer than top-k, attend densely at run time (lax.cond) while every row holds at
# most top-k causal keys: the selection would be every key, so the indexer scores, the top-k and
# the selection mask are skipped: the same tokens and log-probs bit for bit, in less decode time
# (`python -m benchmarks.grpo_peer`; docs/speed.md). False selects at every step (tests compare
# the two).
RUNTIME_DENSE_DECODE = True


def sparse_path(S: int, topk: int, impl: str, dtype, v_dim: int, D: int,
                n_scores: int = 0) -> str:
    """How the sparse stage attends: the training forward (T = S queries over S causal keys) and
    the cached one (T new queries over the cache's S rows, the causal mask at each row's offset;
    decode at the matched benchmark's shapes, S 96, top-k 64: masked-dense 7% faster per
    generated token than the gather, tokens unchanged):
      "dense"   top-k covers every causal key (S <= topk): the selection is every key, so dense
                causal attention is the same computation, without top-k or gather;
      "masked"  dense scores restricted to causal & the top-k selection (the same keys and
                softmax as the gather) while S <= MASKED_DENSE_MAX_RATIO * topk, the scores
                (n_scores = B*T*H*S elements) fit MASKED_DENSE_MAX_SCORES, and the gather would
                run on XLA (the Pallas kernels keep the sparse path);
      "sparse"  the token-sparse gather otherwise."""
    if S <= topk:
        return "dense"
    resolved = dsa_ops.resolve_impl(impl, dsa_ops.SPARSE_DISPATCH, dtype=dtype,
                                    v_dim=int(v_dim), D=int(D))
    if (resolved == "xla" and S <= MASKED_DENSE_MAX_RATIO * topk
            and n_scores <= MASKED_DENSE_MAX_SCORES):
        return "masked"
    return "sparse"


def head_mean_attention(q, kv, key_mask, scale) -> jax.Array:
    """Head-averaged softmax attention [B,T,S] of q [B,T,H,D] over kv [B,S,D] within key_mask."""
    logits = jnp.einsum("bthd,bsd->bhts", q.astype(jnp.float32), kv.astype(jnp.float32)) * scale
    logits = jnp.where(key_mask[:, None], logits, -jnp.inf)
    return jnp.where(key_mask, jnp.mean(jax.nn.softmax(logits, axis=-1), axis=1), 0.0)


class DSALayer(nn.Module):
    cfg: DSAConfig
    d_model: int
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, valid, positions, cache=None, offset=None, step_caches=False):
        """x [B,T,D], valid [B,T], positions [B,T]; with a cache, offset [B] = tokens already in it.
        step_caches: the cache rows are per position, so one cache serves every prefix of the new
        tokens (rows past a row's committed length are rewritten before any query attends them).

        Returns (out [B,T,D], new cache or None, aux {"indexer_kl": scalar} when trained).
        """
        del step_caches
        c = self.cfg
        B, T, _ = x.shape
        H, L, R, N = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim
        HI, DI = c.index_n_heads, c.index_head_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        pkw = dict(eps=self.eps, param_dtype=self.param_dtype)

        lkw = dict(pkw, eps=c.latent_norm_eps or self.eps)  # the latent norms
        if c.q_lora_rank:
            q_a = RMSNorm(name="q_a_norm", **lkw)(
                dense(c.q_lora_rank, ("embed", "q_lora"), "q_a", **kw)(x))  # [B,T,q_lora]
            q = dense(H * (N + R), ("q_lora", "heads"), "q_b", **kw)(q_a)
        else:  # no low-rank q (validate: only without the indexer, which reads q_a)
            q_a = None
            q = dense(H * (N + R), ("embed", "heads"), "q", **kw)(x)
        q = q.reshape(B, T, H, N + R)
        ckv = dense(L + R, ("embed", "kv_lora"), "kv_a", **kw)(x)  # [B,T,L+R]
        latent = RMSNorm(name="kv_a_norm", **lkw)(ckv[..., :L])
        q_nope, q_pe, k_pe = q[..., :N], q[..., N:], ckv[..., L:]  # [B,T,H,N], [B,T,H,R], [B,T,R]
        rope = c.positions == "rope"
        yarn = rope_scaling(c)
        if rope:
            q_pe = apply_rope(q_pe, positions, c.rope_theta, scaling=yarn)
            k_pe = apply_rope(k_pe, positions, c.rope_theta, scaling=yarn)
        if yarn is not None and yarn.rope_magnitude() != 1.0:
            q_pe, k_pe = q_pe * yarn.rope_magnitude(), k_pe * yarn.rope_magnitude()
        kv_new = jnp.concatenate([latent, k_pe], axis=-1)  # [B,T,L+R]
        w_uk = self.param("w_uk", nn.with_logical_partitioning(
            nn.initializers.normal(N ** -0.5), ("heads", "head_dim", "kv_lora")), (H, N, L),
            self.param_dtype)
        w_uv = self.param("w_uv", nn.with_logical_partitioning(
            nn.initializers.normal(L ** -0.5), ("heads", "kv_lora", "head_dim")),
            (H, L, c.v_head_dim), self.param_dtype)
        q_lat = jnp.einsum("bthn,hnl->bthl", q_nope, w_uk.astype(q_nope.dtype))
        q_full = jnp.concatenate([q_lat, q_pe], axis=-1)  # [B,T,H,L+R]

        if c.indexer:
            # Lightning indexer (inputs detached: its KL loss trains only the indexer).
            xi, q_ai = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_a)
            q_idx = dense(HI * DI, ("q_lora", "heads"), "idx_q", **kw)(q_ai).reshape(
                B, T, HI, DI)
            ikw = dict(pkw, eps=c.index_norm_eps or self.eps)
            k_idx_new = LayerNorm(name="idx_k_norm", **ikw)(
                dense(DI, ("embed", "head_dim"), "idx_k", **kw)(xi))
            if rope:  # the indexer follows the layer's positions (module docstring)
                q_idx = apply_rope(q_idx, positions, c.rope_theta, c.index_rope_dim,
                                   scaling=yarn)
                k_idx_new = apply_rope(k_idx_new, positions, c.rope_theta, c.index_rope_dim,
                                       scaling=yarn)  # [B,T,DI]
            w_idx = dense(HI, ("embed", "heads"), "idx_w", **kw)(xi).astype(jnp.float32)
            w_idx = w_idx * (HI ** -0.5) * (DI ** -0.5)  # [B,T,HI]

        if cache is None:
            kv, q_offset = kv_new, jnp.zeros((B,), jnp.int32)
            k_idx = k_idx_new if c.indexer else None
            new_cache = None
        else:
            kv = write_rows(cache["kv"], kv_new, offset)  # [B,S,L+R]
            q_offset = offset.astype(jnp.int32)
            new_cache = {"kv": kv}
            if c.indexer:
                k_idx = write_rows(cache["k_idx"], k_idx_new, offset)  # [B,S,DI]
                new_cache["k_idx"] = k_idx

        scale = softmax_scale(c)
        S = kv.shape[1]
        # without an indexer every causal key is attended (plain MLA)
        dense_stage = c.indexer_stage == "dense_warmup" or not c.indexer
        # the cheapest of the equal computations; with a cache S is the cache's length and the
        # causal mask stops each row at its own offset
        path = ("dense" if dense_stage else
                sparse_path(S, c.index_topk, c.impl, q_full.dtype, L, kv.shape[-1],
                            n_scores=B * T * H * S))
        kv_q = kv.astype(q_full.dtype)

        def dense_attention():
            return dsa_ops.dense_causal_attention(q_full, kv_q, scale=scale, v_dim=L,
                                                  q_offset=q_offset)

        def index_scores():  # [B,T,S]
            return dsa_ops.indexer_scores(q_idx, k_idx.astype(q_idx.dtype), w_idx, impl=c.impl)

        # the indexer KL in query chunks (dsa.indexer_kl_chunk; indexer_kl_chunked)
        chunked_kl = (cache is None and c.indexer_loss_weight > 0
                      and 0 < c.indexer_kl_chunk < T)

        def selected_attention():  # -> (o_lat, scores, sel_mask or None, idx)
            scores = index_scores()
            idx = dsa_ops.select_topk(scores, c.index_topk, q_offset=q_offset)  # [B,T,k]
            sel_mask = None  # [B,T,S] causal & selected keys
            if path == "masked" or (cache is None and c.indexer_loss_weight > 0
                                    and not chunked_kl):
                sel_mask = causal_mask(T, S, q_offset) & selected_key_mask(idx, S)
            if path == "masked":
                o = masked_dense_attention(q_full, kv_q, sel_mask, scale, L)
            else:
                o = dsa_ops.sparse_attention(q_full, kv_q, idx, scale=scale, v_dim=L,
                                             impl=c.impl)
            return o, scores, sel_mask, idx

        scores = sel_mask = idx = None
        if path == "dense":  # dense warm-up, or top-k covers every causal key
            o_lat = dense_attention()
        elif cache is None:
            o_lat, scores, sel_mask, idx = selected_attention()
        elif RUNTIME_DENSE_DECODE:
            # A cache longer than top-k whose rows all hold at most top-k causal keys so far (a
            # decode's first steps): the selection is every causal key, as on the dense path,
            # so skip the indexer and the selection at run time.
            fits = jnp.max(q_offset) + T <= c.index_topk
            o_lat = jax.lax.cond(fits, dense_attention, lambda: selected_attention()[0])
        else:
            o_lat = selected_attention()[0]
        o = jnp.einsum("bthl,hlv->bthv", o_lat, w_uv.astype(o_lat.dtype))  # [B,T,H,v]
        out = dense(self.d_model, ("heads", "embed"), "out", **kw)(o.reshape(B, T, -1))

        aux = {}
        diagnostics = (cache is None and c.indexer
                       and self.is_mutable_collection("diagnostics"))
        if cache is None and scores is None and (
                (c.indexer_loss_weight > 0 and not chunked_kl) or diagnostics):
            scores = index_scores()  # the dense path attended without them
        if chunked_kl:  # over every causal key (dense paths), else the selection
            aux["indexer_kl"] = indexer_kl_chunked(
                q_full, kv, q_idx, k_idx, w_idx, valid, scale, q_offset=q_offset,
                chunk=c.indexer_kl_chunk, idx=None if path == "dense" else idx, impl=c.impl)
        elif cache is None and c.indexer_loss_weight > 0:
            # KL over the attended keys: every causal key (dense paths), else the selection
            key_mask = causal_mask(T, S, q_offset) if sel_mask is None else sel_mask
            aux["indexer_kl"] = indexer_kl(jax.lax.stop_gradient(q_full),
                                           jax.lax.stop_gradient(kv), scores, key_mask, valid,
                                           scale)
        if diagnostics:
            # Model.indexer_recall: recall of the true top-k attention keys by the indexer
            key_mask = causal_mask(T, S, q_offset)
            p = head_mean_attention(q_full, kv, key_mask, scale)
            self.sow("diagnostics", "indexer_recall",
                     topk_recall(p, scores, key_mask, valid, c.index_topk))
        return out, new_cache, aux

    @staticmethod
    def select_step_cache(step_cache: DSACache, n: jax.Array) -> DSACache:
        del n  # positional rows: nothing to choose (see step_caches above)
        return step_cache

    @staticmethod
    def init_cache(cfg: DSAConfig, batch: int, max_len: int, dtype) -> DSACache:
        """kv, and k_idx when the layer has an indexer."""
        cache = {"kv": jnp.zeros((batch, max_len, cfg.latent_dim), dtype)}
        if cfg.indexer:
            cache["k_idx"] = jnp.zeros((batch, max_len, cfg.index_head_dim), dtype)
        return cache


def _device_slice(cfg: DSAConfig, heads, kernels: str) -> DSAConfig:
    """One device's share under tensor parallelism (attention and indexer heads split) with the
    kernels impl=`kernels` runs on GPU/TPU."""
    return dataclasses.replace(cfg, num_heads=heads(cfg.num_heads),
                               index_n_heads=heads(cfg.index_n_heads) if cfg.indexer else 0,
                               impl=kernels)


KIND = LayerKind(
    name="dsa", section="dsa", layer=DSALayer, config=DSAConfig,
    cache_axes={"kv": ("batch", "length", None), "k_idx": ("batch", "length", None)},
    device_slice=_device_slice,
)
