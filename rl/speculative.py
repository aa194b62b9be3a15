"""MTP self-speculative decoding: the draft-verify-commit loop behind
`SamplingConfig(speculative="mtp")` (rl.sampler.Sampler picks it; one compiled program per batch
shape, like the plain sampler).

    sampler = Sampler(model, SamplingConfig(max_new_tokens=64, speculative="mtp"))
    out = sampler.generate(variables, prompts, lengths, rng)  # out.draft_stats: [verified, accepted]

The first MTP module drafts one token from the trunk's last hidden state; one trunk pass
(`Model.verify`) checks the current token and the draft; `verify_draft` accepts by the exact
speculative-sampling rule, so greedy output equals the plain sampler's token for token and
sampled output has its distribution; `Model.commit` keeps the accepted prefix of the trunk cache.
Not covered: drafts longer than one token, tree drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model import sharding as shd
from model.transformer import Model
from rl.sampler import SampleOutput, SamplingConfig, _hits_stop, _sample, process_logits


def _sample_rows(logp, rng, greedy):
    """One token per row from log-probs [B,V] (argmax when greedy): [B] int32."""
    drawn = jax.random.categorical(rng, logp, axis=-1).astype(jnp.int32)
    return jnp.where(greedy, jnp.argmax(logp, axis=-1).astype(jnp.int32), drawn)


def _take(x, idx):
    """x [B,V], idx [B] -> x[b, idx[b]]."""
    return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]


def verify_draft(p, q, draft, rng, greedy):
    """Speculative sampling for one draft token per row.

    p, q [B,V] target and draft log-probs; draft [B] drawn from q. Greedy: accept iff draft ==
    argmax p, else emit argmax p. Sampled: accept with probability min(1, p(d)/q(d)), else emit
    a draw from normalise(max(p - q, 0)); the emitted token is then distributed as p exactly.
    Returns (token [B] int32, accepted [B] bool)."""
    k_acc, k_res = jax.random.split(rng)
    u = jax.random.uniform(k_acc, draft.shape)
    accept = jnp.where(greedy, jnp.argmax(p, -1) == draft,
                       jnp.log(u) < _take(p, draft) - _take(q, draft))
    resid = jnp.maximum(jnp.exp(p) - jnp.exp(q), 0.0)
    # p == q everywhere: rejection has probability 0; keep the draw well defined anyway
    resid_logp = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, jnp.log(resid), p)
    rejected = jnp.where(greedy, jnp.argmax(p, -1).astype(jnp.int32),
                         jax.random.categorical(k_res, resid_logp, axis=-1).astype(jnp.int32))
    return jnp.where(accept, draft, rejected), accept


def generate_speculative_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths,
                               rng, temperature):
    """MTP self-speculative decoding (DeepSeek-V3 style), one draft token per step.

    Invariant at the top of each step, per row: the trunk and draft caches hold positions < n,
    `tok` = x_n is sampled but not yet fed, and the MTP head (run at position n-1 on
    [h_{n-1}; emb(x_n)]) proposed the draft d for x_{n+1} with distribution q. One verify pass
    feeds [x_n, d] and gives p_n (for x_{n+1}) and p_{n+1} (for x_{n+2}).
    Greedy: d is accepted iff d == argmax p_n. Sampled: accepted with probability
    min(1, p_n(d)/q(d)); on rejection x_{n+1} is drawn from normalise(max(p_n - q, 0)); either
    way x_{n+1} ~ p_n exactly (speculative sampling, Leviathan et al. 2023), so the outputs have
    the plain sampler's distribution. On acceptance x_{n+2} ~ p_{n+1} comes for free. The
    reported log-probs are log p (after temperature/top-k/top-p) of the emitted tokens, as in
    the plain sampler. The trunk cache keeps 1 + accepted tokens (`Model.commit`); the draft
    cache then runs the MTP block on the committed positions and drafts the next token.
    """
    B, P = prompts.shape
    G = cfg.max_new_tokens
    S = P + G  # verification writes x_n, d at rows n, n+1 <= P+G-1 (n_gen <= G-1 while active)
    greedy = temperature <= 0
    temp = jnp.maximum(temperature, 1e-6)
    rows = jnp.arange(B)

    def logp_of(logits):
        return process_logits(logits, cfg, temp)

    cache = shd.constrain_cache(model.init_cache(B, S))
    logits, cache, hidden = model.prefill(variables, prompts, lengths, cache,
                                          chunk=cfg.prefill_chunk)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    rng, sub = jax.random.split(rng)
    tok, lp = _sample(last, sub, cfg, temperature)
    # draft prefill: MTP input at position t is [h_t; emb(x_{t+1})], x_L the token just sampled
    nxt = jnp.pad(prompts[:, 1:], ((0, 0), (0, 1))).at[rows, lengths - 1].set(tok)  # [B,P]
    pvalid = jnp.arange(P)[None] < lengths[:, None]
    dlogits, dcache = model.mtp_draft(variables, hidden, nxt, pvalid,
                                      shd.constrain_cache(model.init_draft_cache(B, S)))
    q = logp_of(jnp.take_along_axis(dlogits, (lengths - 1)[:, None, None], axis=1)[:, 0])
    rng, sub = jax.random.split(rng)
    draft = _sample_rows(q, sub, greedy)

    W = G + 2  # room for two writes past a row's last slot (sliced off below)
    buf = jnp.zeros((B, W), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, W), jnp.float32).at[:, 0].set(lp)
    done = (tok == cfg.eos_id) | _hits_stop(buf, 0, cfg) | (G <= 1)
    n_gen = jnp.ones((B,), jnp.int32)
    stats = jnp.zeros((2,), jnp.int32)  # [drafts verified, drafts accepted] over active rows

    def cond(carry):
        return ~jnp.all(carry[5])

    def body(carry):
        tok, draft, q, buf, lps, done, n_gen, cache, dcache, rng, stats = carry
        active = ~done
        logits, step_cache, hid = model.verify(variables, jnp.stack([tok, draft], 1), cache,
                                               active)
        p0, p1 = logp_of(logits[:, 0]), logp_of(logits[:, 1])  # [B,V]
        rng, k_ver, k_next = jax.random.split(rng, 3)
        x1, accept = verify_draft(p0, q, draft, k_ver, greedy)
        x2 = _sample_rows(p1, k_next, greedy)
        # emit x1 at slot n_gen, then x2 unless x1 ended the row or the draft was rejected
        buf = buf.at[rows, n_gen].set(jnp.where(active, x1, 0))
        lps = lps.at[rows, n_gen].set(jnp.where(active, jnp.where(greedy, 0.0, _take(p0, x1)),
                                                0.0))
        end1 = (x1 == cfg.eos_id) | _hits_stop(buf, n_gen, cfg) | (n_gen + 1 >= G)
        two = active & accept & ~end1
        buf = buf.at[rows, n_gen + 1].set(jnp.where(two, x2, buf[rows, n_gen + 1]))
        lps = lps.at[rows, n_gen + 1].set(
            jnp.where(two, jnp.where(greedy, 0.0, _take(p1, x2)), lps[rows, n_gen + 1]))
        end2 = (x2 == cfg.eos_id) | _hits_stop(buf, n_gen + 1, cfg) | (n_gen + 2 >= G)
        new_done = done | (active & jnp.where(two, end2, end1))
        n_new = jnp.where(active, 1 + two.astype(jnp.int32), 0)
        # the trunk keeps x_n, plus d (= x_{n+1}) when accepted; next to feed: x_{n+1} or x_{n+2}
        cache = model.commit(step_cache, jnp.where(active, 1 + accept.astype(jnp.int32), 0))
        # draft cache: MTP on [h_n; emb(x_{n+1})] and, when accepted, [h_{n+1}; emb(x_{n+2})]
        dvalid = jnp.stack([active, active & accept], 1)
        dlogits, dcache = model.mtp_draft(variables, hid, jnp.stack([x1, x2], 1), dvalid, dcache)
        nq = logp_of(jnp.where(accept[:, None], dlogits[:, 1], dlogits[:, 0]))
        rng, k_draft = jax.random.split(rng)
        ndraft = _sample_rows(nq, k_draft, greedy)
        ntok = jnp.where(accept, x2, x1)
        stats = stats + jnp.stack([jnp.sum(active), jnp.sum(active & accept)]).astype(jnp.int32)
        # finished rows keep their carry
        return (jnp.where(active, ntok, tok), jnp.where(active, ndraft, draft),
                jnp.where(active[:, None], nq, q), buf, lps, new_done, n_gen + n_new, cache,
                dcache, rng, stats)

    carry = (tok, draft, q, buf, lps, done, n_gen, cache, dcache, rng, stats)
    _, _, _, buf, lps, done, n_gen, _, _, _, stats = jax.lax.while_loop(cond, body, carry)
    finished = ended_by_token(buf, n_gen, cfg)  # every row is done: by a token or by G
    mask = jnp.arange(G)[None] < n_gen[:, None]
    return SampleOutput(tokens=jnp.where(mask, buf[:, :G], 0),
                        logprobs=jnp.where(mask, lps[:, :G], 0.0), mask=mask, lengths=n_gen,
                        finished=finished, draft_stats=stats)


def ended_by_token(buf, n_gen, cfg: SamplingConfig):
    """Whether each row's last token (slot n_gen-1) is EOS or completes a stop sequence."""
    last = n_gen - 1
    return (buf[jnp.arange(buf.shape[0]), last] == cfg.eos_id) | _hits_stop(buf, last, cfg)
