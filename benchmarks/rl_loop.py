"""`python scripts/bench.py rl`: sampler and RL-iteration timings on the tiny model (CPU).

Side by side in one run:
  * decode tokens/s with the KV/state cache vs recomputing the full prefix every step (ratio);
  * GRPO train-step time (32 sequences = 8 prompts x 4, prompt 32 + 64 generated tokens), side
    by side: with old log-probs from a separate pass, with old = the step's own log-probs (no
    old pass: rl.old_logp_pass="auto"), and with the MTP forward skipped (rl.mtp_loss_weight=0);
  * the DSA layer's training attention by length: token-sparse gather vs masked-dense vs dense
    (`dsa_paths`, the measurement behind model/layers/dsa.py's sparse_path rule);
  * one RL iteration split into generate / score / train, and the fraction of scoring time hidden
    behind generation of the next batch (the loop's lookahead).
MTP speculative decoding has its own benchmark (`scripts/bench.py spec`, benchmarks/speculative.py).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def _timeit(fn, reps=3):
    fn()  # compile / warm
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def run(quick: bool = False) -> dict:
    from configs import models
    from model.config import ModelConfig
    from model.transformer import Model
    from rl.algorithms import get_algorithm
    from rl.sampler import Sampler, SamplingConfig, pack
    from rl.train_step import init_train_state, make_logp_fn, make_optimizer

    cfg = ModelConfig.from_dict(models.get_config("test" if quick else "tiny"))
    model = Model(cfg)
    variables = model.init(jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(variables["params"]))
    B, P, G = (8, 16, 16) if quick else (32, 32, 64)
    prompts = jax.random.randint(jax.random.key(1), (B, P), 3, 250).astype(jnp.int32)
    lengths = jnp.full((B,), P, jnp.int32)
    sampler = Sampler(model, SamplingConfig(max_new_tokens=G, temperature=1.0, eos_id=-1))
    t_cache = _timeit(lambda: sampler.generate(variables, prompts, lengths,
                                               jax.random.key(2)).tokens)

    @jax.jit
    def recompute(variables, prompts, rng):
        buf = jnp.zeros((B, P + G), jnp.int32).at[:, :P].set(prompts)

        def body(t, carry):
            buf, rng = carry
            valid = jnp.arange(P + G)[None] < (P + t)
            logits = model.apply(variables, buf, jnp.broadcast_to(valid, buf.shape),
                                 with_mtp=False).logits[:, P + t - 1]
            rng, sub = jax.random.split(rng)
            tok = jax.random.categorical(sub, logits).astype(jnp.int32)
            return buf.at[:, P + t].set(tok), rng
        return jax.lax.fori_loop(0, G, body, (buf, rng))[0]

    t_recompute = _timeit(lambda: recompute(variables, prompts, jax.random.key(2)))
    res = {"params": int(n_params), "batch": B, "prompt": P, "generated": G,
           "decode_tok_s_cache": B * G / t_cache, "decode_tok_s_recompute": B * G / t_recompute,
           "cache_speedup": t_recompute / t_cache}

    # train step on a packed batch of the same shape
    out = sampler.generate(variables, prompts, lengths, jax.random.key(3))
    tokens, mask, rollout = pack(prompts, lengths, out.tokens, out.mask, width=P + G,
                                 extras=(out.logprobs,))
    logp = make_logp_fn(model)(variables, jnp.asarray(tokens), jnp.asarray(mask))
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.05)
    import ml_collections
    opt = make_optimizer(ml_collections.ConfigDict(dict(
        lr=1e-4, warmup_steps=1, total_steps=10, final_lr_frac=0.1, weight_decay=0.0, b1=0.9,
        b2=0.99, eps=1e-8, clip_norm=1.0)))
    state = init_train_state(variables, opt)
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask),
             "advantages": jnp.asarray(np.random.default_rng(0).normal(size=(B, 1)), jnp.float32),
             "old_logp": logp, "ref_logp": logp, "rollout_logp": jnp.asarray(rollout)}
    # the step's variants side by side (alternating, medians): the default (old log-probs from
    # a separate pass, the model's MTP weight), old = the step's own log-probs (no old pass,
    # rl.old_logp_pass="auto"), and the MTP forward skipped (rl.mtp_loss_weight=0)
    fused = {k: v for k, v in batch.items() if k != "old_logp"}
    variants = {"train_step_s": (dict(), batch),
                "train_step_old_current_s": (dict(old_logp="current"), fused)}
    if cfg.mtp.depth:
        variants["train_step_no_mtp_s"] = (dict(old_logp="current", mtp_loss_weight=0.0), fused)
    res.update(_alternating({k: _step_call(model, algo, opt, state, kw, b)
                             for k, (kw, b) in variants.items()}))
    logp_fn = make_logp_fn(model)
    res["logp_pass_s"] = _timeit(lambda: logp_fn(variables, batch["tokens"], batch["loss_mask"]))
    # old + ref passes with the default step; the ref pass alone without the old one
    res["rl_iteration_s_estimate"] = (t_cache + res["train_step_s"] + 2 * res["logp_pass_s"])
    res["rl_iteration_s_estimate_no_old_pass"] = (t_cache + res["train_step_old_current_s"]
                                                  + res["logp_pass_s"])
    res.update(_iteration_split(model, variables, quick))
    res.update(dsa_paths(quick))
    for k, v in res.items():
        print(f"  {k:<28} {v:.4g}" if isinstance(v, float) else f"  {k:<28} {v}")
    return res


def _step_call(model, algo, opt, state, kw, batch):
    """A compiled (warmed) call of make_train_step(**kw) on batch (state not donated)."""
    from rl.train_step import make_train_step

    step = make_train_step(model, algo, opt, donate=False, **kw)
    fn = lambda: step(state, batch)[1]["loss"]  # noqa: E731
    jax.block_until_ready(fn())
    return fn


def _alternating(fns: dict, rounds: int = 3) -> dict:
    """Median seconds of each warmed call, timed in alternation (rounds x each): side by side
    under the same foreign load."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}


def dsa_paths(quick: bool = False) -> dict:
    """The DSA layer's training attention, forward+backward, by key count S (T = S queries):
    the token-sparse gather (select_topk + sparse_attention, XLA on CPU), the masked-dense
    scores over the same selection (model/layers/dsa.py: masked_dense_attention) and dense
    causal attention (equal to both while S <= top-k), at the bench hybrid's DSA shapes (B32
    H4 D160 top-k 64). What model/layers/dsa.py's sparse_path rule (MASKED_DENSE_MAX_RATIO)
    rests on; prints ms and gather / masked."""
    from model.layers import dsa as dsa_layer
    from pallas_kernels.dsa import ops as dsa_ops

    B, H, L, R, K = (8, 2, 32, 16, 16) if quick else (32, 4, 128, 32, 64)
    D, out = L + R, {}
    for S in ([K, 2 * K, 4 * K] if quick else [K // 2, K, 3 * K // 2, 2 * K, 4 * K, 8 * K]):
        ks = jax.random.split(jax.random.key(S), 4)
        q, kv = jax.random.normal(ks[0], (B, S, H, D)), jax.random.normal(ks[1], (B, S, D))
        sc, g = jax.random.normal(ks[2], (B, S, S)), jax.random.normal(ks[3], (B, S, H, L))
        causal = dsa_layer.causal_mask(S, S, jnp.zeros((B,), jnp.int32))

        def gather(q, kv, sc):
            idx = dsa_ops.select_topk(sc, K)
            return dsa_ops.sparse_attention(q, kv, idx, scale=D ** -0.5, v_dim=L)

        def masked(q, kv, sc, causal=causal, S=S):
            m = causal & dsa_layer.selected_key_mask(dsa_ops.select_topk(sc, K), S)
            return dsa_layer.masked_dense_attention(q, kv, m, D ** -0.5, L)

        def dense(q, kv, sc):
            return dsa_ops.dense_causal_attention(q, kv, scale=D ** -0.5, v_dim=L)

        fns = {}
        for name, f in (("gather", gather), ("masked", masked), ("dense", dense)):
            fb = jax.jit(jax.grad(lambda q, kv, f=f, sc=sc, g=g: jnp.sum(f(q, kv, sc) * g),
                                  argnums=(0, 1)))
            jax.block_until_ready(fb(q, kv))
            fns[name] = lambda fb=fb, q=q, kv=kv: fb(q, kv)
        t = _alternating(fns)
        out[S] = {**{k + "_ms": 1e3 * v for k, v in t.items()},
                  "gather_over_masked": t["gather"] / t["masked"]}
        print(f"  dsa S={S:<5} (top-k {K}) " + "  ".join(f"{k} {v:.3g}" for k, v in
                                                        out[S].items()))
    return {"dsa_paths": out}


def _iteration_split(model, variables, quick: bool) -> dict:
    """generate / score / train split of real RL iterations on generated arithmetic + code tasks,
    with scoring of batch i overlapped with generation of batch i+1."""
    from model.tokenizer import ByteTokenizer
    from rl.pipeline import RolloutWorker
    from rl.sampler import SamplingConfig
    from sandbox import SandboxPool
    from sandbox.tasks.sampling import make_split
    from sandbox.verifiers import Verifier

    tasks = [t for f in ("arithmetic", "code", "terminal")
             for t, _ in make_split(f, "train", 16, 0)]
    tok = ByteTokenizer()
    with SandboxPool(workers=2) as pool:
        w = RolloutWorker(model, tok, SamplingConfig(max_new_tokens=32 if quick else 48),
                          Verifier(executor=pool), group_size=4, max_prompt_len=96)
        rng = jax.random.key(0)
        batches = [tasks[i::6][:8] for i in range(3)]
        pend = w.start(variables, batches[0], rng)  # warm-up compile
        pend.result()
        gen, wait, score = [], [], []
        pend = w.start(variables, batches[1], rng)
        nxt = w.start(variables, batches[2], rng)  # generated while batch 1 is scored
        g = pend.result()
        gen.append(nxt._group.gen_s)
        wait.append(g.score_wait_s)
        score.append(g.score_s)
        nxt.result()
    return {"iter_generate_s": float(np.mean(gen)), "iter_score_s": float(np.mean(score)),
            "iter_score_wait_s": float(np.mean(wait)),
            "score_hidden_frac": float(1 - np.mean(wait) / max(np.mean(score), 1e-9))}
