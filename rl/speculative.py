"""MTP self-speculative decoding: the draft-verify-commit loop behind
`SamplingConfig(speculative="mtp", draft_tokens=k)` (rl.sampler.Sampler picks it; one compiled
program per batch shape, like the plain sampler).

    sampler = Sampler(model, SamplingConfig(max_new_tokens=64, speculative="mtp", draft_tokens=2))
    out = sampler.generate(variables, prompts, lengths, rng)
    draft_summary(out.draft_stats, out.lengths)  # acceptance per position, trunk passes per token

Each step of the compiled while_loop: the first MTP module drafts k tokens (the first from the
trunk's hidden state, each further one from the module's own hidden output and the token just
drafted, one position on); one trunk pass (`Model.verify`) checks the current token and the k
drafts; `verify_draft` accepts drafts in order by the exact speculative-sampling rule until the
first rejection (then a draw from the residual) or all k (then a free token from the last
position), so greedy output equals the plain sampler's token for token and sampled output has its
distribution; `Model.commit` keeps 1 + accepted tokens of the trunk cache (KDA state and conv
window after that prefix); the MTP cache then runs on the committed positions.
`choose_draft_tokens` picks k from measured acceptance rates and a per-step cost model
(`fit_step_cost` fits it to measured step costs).
Not covered: chaining the deeper MTP modules of a model with mtp.depth > 1 (only the first module
drafts, recursively), tree drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd
from model.transformer import Model
from rl.draws import (
    SampleOutput,
    SamplingConfig,
    argmax_last,
    categorical_last,
    hits_stop,
    process_logits,
    row_keys,
    sample_tokens,
)


def _sample_rows(logp, rng, greedy):
    """One token per row from log-probs [B,V] (argmax when greedy, a traced scalar; the random
    draw is skipped then): [B] int32."""
    return jax.lax.cond(greedy, lambda: argmax_last(logp), lambda: categorical_last(rng, logp))


def _take(x, idx):
    """x [B,V], idx [B] -> x[b, idx[b]]."""
    return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]


def verify_draft(p, q, draft, rng, greedy):
    """Speculative sampling, one draft token per row (the loop passes every (row, draft
    position) pair as a row, each with its own p and q; it keeps the first rejection per row).

    p, q [B,V] target and draft log-probs; draft [B] drawn from q. Greedy: accept iff draft ==
    argmax p, else emit argmax p. Sampled: accept with probability min(1, p(d)/q(d)), else emit
    a draw from normalise(max(p - q, 0)); the emitted token is then distributed as p exactly.
    Returns (token [B] int32, accepted [B] bool). `greedy` is a traced scalar: a `lax.cond`,
    so greedy steps skip the random draws and the residual."""
    def greedy_rule():
        top = argmax_last(p)
        return top, top == draft

    def sampled_rule():
        k_acc, k_res = jax.random.split(rng)
        u = jax.random.uniform(k_acc, draft.shape)
        accept = jnp.log(u) < _take(p, draft) - _take(q, draft)
        resid = jnp.maximum(jnp.exp(p) - jnp.exp(q), 0.0)
        # p == q everywhere: rejection has probability 0; keep the draw well defined anyway
        resid_logp = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, jnp.log(resid), p)
        return categorical_last(k_res, resid_logp), accept

    rejected, accept = jax.lax.cond(greedy, greedy_rule, sampled_rule)
    return jnp.where(accept, draft, rejected), accept


def _draft_chain(model: Model, variables, q1, g, dcache, rng, greedy, k: int, active, logp_of):
    """k draft tokens per row from the first MTP module.

    q1 [B,V] the draft log-probs for x_{n+1} (the MTP output at position n-1), g [B,D] the MTP
    block's hidden output there, dcache the draft cache holding positions < n. Draft j+1 runs
    the module at position n+j-1 on [g; emb(d_j)] (its own output standing in for the trunk's
    hidden state, which the trunk has not computed yet). The chain's cache writes are dropped
    (dcache is not returned): the committed positions are rerun on the trunk's hidden states.
    Returns (drafts [B,k] int32, their draft log-probs [B,k,V])."""
    keys = jax.random.split(rng, k)
    d = _sample_rows(q1, keys[0], greedy)
    drafts, qs = [d], [q1]
    for j in range(1, k):
        logits, dcache, h = model.mtp_draft(variables, g[:, None], d[:, None], active[:, None],
                                            dcache)
        g, q = h[:, 0], logp_of(logits[:, 0])
        d = _sample_rows(q, keys[j], greedy)
        drafts.append(d)
        qs.append(q)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1)


def generate_speculative_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths,
                               rng, temperature):
    """MTP self-speculative decoding (DeepSeek-V3 style), k = cfg.draft_tokens drafts per step.

    Invariant at the top of each step, per row: the trunk and draft caches hold positions < n,
    `tok` = x_n is sampled but not yet fed, and the MTP head (run at position n-1 on
    [h_{n-1}; emb(x_n)]) gives q_1 (log-probs for x_{n+1}) and its hidden output g.
    The step drafts d_1..d_k (`_draft_chain`, d_j ~ q_j given d_<j), feeds [x_n, d_1..d_k] in one
    trunk pass for p_0..p_k (p_j for x_{n+j+1} given x_n, d_1..d_j) and accepts d_1, d_2, ... in
    order: greedy while d_j == argmax p_{j-1}; sampled each with probability
    min(1, p_{j-1}(d_j)/q_j(d_j)). At the first rejection j the emitted token is a draw from
    normalise(max(p_{j-1} - q_j, 0)); when all k are accepted, a draw from p_k follows for free.
    Either way each emitted token has the target distribution given the tokens before it
    (speculative sampling, Leviathan et al. 2023), so the outputs have the plain sampler's
    distribution. The reported log-probs are log p (after temperature/top-k/top-p) of the emitted
    tokens, as in the plain sampler. A row stops at its first EOS / stop sequence / max_new_tokens
    even inside an accepted run. The trunk cache keeps x_n and the a accepted drafts
    (`Model.commit`); the draft cache then runs the MTP block on the positions n..n+a with the
    trunk's hidden states, which gives q_1 and g of the next step.

    draft_stats [k+2] int32: [0] row-steps (trunk passes summed over active rows), [j] for
    1 <= j <= k row-steps whose first j drafts were all accepted, [k+1] trunk passes of the batch
    (loop iterations); `draft_summary` turns them into rates.
    """
    B, P = prompts.shape
    G = cfg.max_new_tokens
    k = cfg.draft_tokens
    # verification writes rows n..n+k (n <= P+G-2 while a row is active); the draft chain less
    S = P + G + k
    greedy = temperature <= 0
    temp = jnp.maximum(temperature, 1e-6)
    rows = jnp.arange(B)

    def logp_of(logits):
        return process_logits(logits, cfg, temp)

    def at_row(x, idx):  # x [B,T,...], idx [B] -> x[b, idx[b]]
        return x[rows, idx]

    cache = shd.constrain_cache(model.init_cache(B, S))
    logits, cache, hidden = model.prefill(variables, prompts, lengths, cache,
                                          chunk=cfg.prefill_chunk)
    last = at_row(logits, lengths - 1)  # [B,V]
    # the first token: the plain sampler's draw for each row (rl.sampler.row_keys)
    tok, lp = sample_tokens(last, row_keys(rng, jnp.full((B,), -1, jnp.int32)), lengths, cfg,
                      temperature)
    rng, _ = jax.random.split(rng)
    # draft prefill: MTP input at position t is [h_t; emb(x_{t+1})], x_L the token just sampled
    nxt = jnp.pad(prompts[:, 1:], ((0, 0), (0, 1))).at[rows, lengths - 1].set(tok)  # [B,P]
    pvalid = jnp.arange(P)[None] < lengths[:, None]
    dlogits, dcache, dhid = model.mtp_draft(variables, hidden, nxt, pvalid,
                                            shd.constrain_cache(model.init_draft_cache(B, S)))
    q1 = logp_of(at_row(dlogits, lengths - 1))  # [B,V]
    g = at_row(dhid, lengths - 1)  # [B,D]

    W = G + k + 1  # room for k+1 writes past a row's last slot (sliced off below)
    buf = jnp.zeros((B, W), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, W), jnp.float32).at[:, 0].set(lp)
    done = (tok == cfg.eos_id) | hits_stop(buf, 0, cfg) | (G <= 1)
    n_gen = jnp.ones((B,), jnp.int32)
    stats = jnp.zeros((k + 2,), jnp.int32)
    pos = jnp.arange(k + 1)

    def cond(carry):
        return ~jnp.all(carry[5])

    def body(carry):
        tok, q1, g, buf, lps, done, n_gen, cache, dcache, rng, stats = carry
        active = ~done
        rng, k_draft, k_ver, k_bonus = jax.random.split(rng, 4)
        drafts, qs = _draft_chain(model, variables, q1, g, dcache, k_draft, greedy, k, active,
                                  logp_of)  # [B,k], [B,k,V]
        fed = jnp.concatenate([tok[:, None], drafts], 1)  # [B,k+1]
        logits, step_cache, hid = model.verify(variables, fed, cache, active)
        p = logp_of(logits)  # [B,k+1,V]
        V = p.shape[-1]
        vt, acc = verify_draft(p[:, :k].reshape(B * k, V), qs.reshape(B * k, V),
                               drafts.reshape(B * k), k_ver, greedy)
        vt, acc = vt.reshape(B, k), acc.reshape(B, k)
        bonus = _sample_rows(p[:, k], k_bonus, greedy)
        emitted = jnp.concatenate([vt, bonus[:, None]], 1)  # [B,k+1]: x_{n+1}.. (first a+1 kept)
        n_acc = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)  # [B] 0..k
        emitted_lp = jnp.where(greedy, 0.0, jnp.take_along_axis(p, emitted[..., None], -1)[..., 0])
        ended, n_new = done, jnp.zeros((B,), jnp.int32)
        for j in range(k + 1):  # emit in order; a row stops at its first end
            emit = ~ended & (j <= n_acc)
            slot = n_gen + j
            buf = buf.at[rows, slot].set(jnp.where(emit, emitted[:, j], buf[rows, slot]))
            lps = lps.at[rows, slot].set(jnp.where(emit, emitted_lp[:, j], lps[rows, slot]))
            end = (emitted[:, j] == cfg.eos_id) | hits_stop(buf, slot, cfg) | (slot + 1 >= G)
            ended = ended | (emit & end)
            n_new = n_new + emit.astype(jnp.int32)
        cache = model.commit(step_cache, jnp.where(active, 1 + n_acc, 0))
        # draft cache: MTP on [h_{n+j}; emb(x_{n+j+1})] for the committed j = 0..a
        dvalid = active[:, None] & (pos[None] <= n_acc[:, None])  # [B,k+1]
        dlogits, dcache, dhid = model.mtp_draft(variables, hid, emitted, dvalid, dcache)
        nq1, ng = logp_of(at_row(dlogits, n_acc)), at_row(dhid, n_acc)
        ntok = at_row(emitted, n_acc)
        reached = active[:, None] & (n_acc[:, None] >= jnp.arange(1, k + 1)[None])  # [B,k]
        stats = stats + jnp.concatenate([jnp.sum(active)[None], jnp.sum(reached, 0),
                                         jnp.ones((1,), jnp.int32)]).astype(jnp.int32)
        # finished rows keep their carry
        a1 = active[:, None]
        return (jnp.where(active, ntok, tok), jnp.where(a1, nq1, q1), jnp.where(a1, ng, g), buf,
                lps, ended, n_gen + n_new, cache, dcache, rng, stats)

    carry = (tok, q1, g, buf, lps, done, n_gen, cache, dcache, rng, stats)
    _, _, _, buf, lps, done, n_gen, _, _, _, stats = jax.lax.while_loop(cond, body, carry)
    finished = ended_by_token(buf, n_gen, cfg)  # every row is done: by a token or by G
    mask = jnp.arange(G)[None] < n_gen[:, None]
    return SampleOutput(tokens=jnp.where(mask, buf[:, :G], 0),
                        logprobs=jnp.where(mask, lps[:, :G], 0.0), mask=mask, lengths=n_gen,
                        finished=finished, draft_stats=stats)


def ended_by_token(buf, n_gen, cfg: SamplingConfig):
    """Whether each row's last token (slot n_gen-1) is EOS or completes a stop sequence."""
    last = n_gen - 1
    return (buf[jnp.arange(buf.shape[0]), last] == cfg.eos_id) | hits_stop(buf, last, cfg)


def draft_summary(draft_stats, lengths) -> dict:
    """Rates from a speculative SampleOutput: draft_stats [k+2] (see generate_speculative_impl),
    lengths [B] generated tokens per row (the first one comes from prefill, not a trunk pass).

    Returns {"acceptance": [k] acceptance rate of draft j given drafts 1..j-1 were accepted (the
    alpha_j of `expected_tokens_per_pass`), "accepted_per_pass": mean accepted drafts per
    row-step, "tokens_per_pass": decode tokens per row trunk pass (1 + accepted, less the tokens
    cut by an end), "passes_per_token": its inverse (plain decoding: 1), "batch_passes": loop
    iterations, "batch_passes_per_token": iterations over the longest row's decode tokens (the
    plain sampler's iteration count; < 1 is fewer trunk passes for the batch)}."""
    s = np.asarray(draft_stats, np.int64)
    n = np.asarray(lengths, np.int64)
    k = s.shape[0] - 2
    if k < 1:
        raise ValueError(f"draft_stats must have k + 2 >= 3 entries, got shape {s.shape}")
    steps, reached, iters = s[0], s[1:k + 1], s[k + 1]
    decoded = int(np.sum(n) - n.shape[0])  # tokens from trunk passes (the first: prefill)
    prev = np.concatenate([[steps], reached[:-1]])
    return {"acceptance": [float(r / p) if p else float("nan") for r, p in zip(reached, prev)],
            "accepted_per_pass": float(np.sum(reached) / max(steps, 1)),
            "tokens_per_pass": decoded / max(int(steps), 1),
            "passes_per_token": int(steps) / max(decoded, 1),
            "batch_passes": int(iters),
            "batch_passes_per_token": int(iters) / max(int(np.max(n)) - 1, 1)}


def expected_tokens_per_pass(acceptance: Sequence[float], k: int) -> float:
    """Expected tokens emitted per trunk pass with k drafts: 1 + sum_{j<=k} prod_{i<=j} alpha_i,
    alpha_i = acceptance[i-1] the rate of draft i given drafts 1..i-1 were accepted (the bonus or
    residual token is the 1). Assumes the rates do not depend on k (the first j drafts of a
    k-draft step are drafted exactly as in a j-draft step)."""
    if not 0 <= k <= len(acceptance):
        raise ValueError(f"k={k} needs acceptance rates for positions 1..k; have "
                         f"{len(acceptance)} (measure with draft_tokens >= {k})")
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rates must be in [0, 1], got {list(acceptance)}")
        run *= a
        total += run
    return total


def choose_draft_tokens(acceptance: Sequence[float], *, draft_cost: float,
                        verify_cost: float = 0.0, step_overhead: float = 0.0
                        ) -> tuple[int, list[float]]:
    """Pick k (0 = plain decoding) maximising expected tokens per unit of decode cost.

    acceptance: measured per-position rates alpha_1..alpha_m (`draft_summary(...)["acceptance"]`
    of a run with draft_tokens = m; k is chosen among 0..m). Cost of one step with k drafts,
    relative to one plain decode step (a trunk pass over one token per row):
        cost(k) = 1 + step_overhead + k * (draft_cost + verify_cost)   (k >= 1; cost(0) = 1)
    draft_cost: one MTP-block call relative to a trunk pass (about 1 / num_layers of the trunk
    plus the vocabulary head when decoding is bound by memory bandwidth); verify_cost: the extra
    cost of each further token in the trunk pass (about 0 when decoding is bound by memory
    bandwidth, as on accelerators at small batch; up to about 1 when bound by compute, as on a
    small CPU); step_overhead: what a speculative step costs beyond that whatever k (the MTP
    block over the committed positions, acceptance, commit; `fit_step_cost` measures it).
    Returns (k, [speed-up over plain decoding for k = 0..m])."""
    if draft_cost < 0 or verify_cost < 0 or step_overhead < 0:
        raise ValueError(f"costs must be >= 0, got draft_cost={draft_cost}, "
                         f"verify_cost={verify_cost}, step_overhead={step_overhead}")
    speed = [expected_tokens_per_pass(acceptance, k)
             / (1.0 + (k > 0) * (step_overhead + k * (draft_cost + verify_cost)))
             for k in range(len(acceptance) + 1)]
    return int(np.argmax(speed)), speed


def fit_step_cost(ks: Sequence[int], costs: Sequence[float]) -> tuple[float, float]:
    """(step_overhead, per_draft) of `choose_draft_tokens`' cost model from measured step costs
    (one speculative loop iteration with k drafts relative to one plain one) at the draft counts
    ks: the least-squares line cost = 1 + step_overhead + per_draft * k over the measured points,
    both parts clamped at 0. One point: per_draft = (cost - 1) / k, no overhead (the two cannot be
    told apart). A line through k = m alone (1 + c k) underrates small k: on the demo checkpoint
    (2 cores, batch 32, acceptance 1.00 / 0.38 / 0.26) the costs 2.34 / 3.07 / 3.74 at k = 1 / 2 / 3
    fit 1 + 0.65 + 0.70 k, which predicts 0.85x at k = 1 (measured 0.84x) and picks k = 0, where
    the line 1 + 0.91 k through k = 3 predicted 1.04x and picked k = 1."""
    ks = np.asarray(ks, np.float64)
    costs = np.asarray(costs, np.float64)
    if ks.ndim != 1 or ks.shape != costs.shape or ks.size == 0 or np.any(ks < 1):
        raise ValueError(f"ks (each >= 1) and costs must be equal-length 1-D sequences, got "
                         f"{ks.tolist()} and {costs.tolist()}")
    if np.unique(ks).size == 1:
        return 0.0, float(max(np.mean(costs) - 1.0, 0.0) / ks[0])
    slope = max(float(np.polyfit(ks, costs, 1)[0]), 0.0)
    overhead = max(float(np.mean(costs - slope * ks)) - 1.0, 0.0)  # refit with the clamped slope
    return overhead, slope
