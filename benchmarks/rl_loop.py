"""`python scripts/bench.py rl`: sampler and RL-iteration timings on the tiny model (CPU).

Side by side in one run:
  * decode tokens/s with the KV/state cache vs recomputing the full prefix every step (ratio);
  * GRPO train-step time (32 sequences = 8 prompts x 4, prompt 32 + 64 generated tokens);
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
    from rl.train_step import init_train_state, make_logp_fn, make_optimizer, make_train_step

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
    step = make_train_step(model, algo, opt, donate=False)
    state = init_train_state(variables, opt)
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask),
             "advantages": jnp.asarray(np.random.default_rng(0).normal(size=(B, 1)), jnp.float32),
             "old_logp": logp, "ref_logp": logp}
    res["train_step_s"] = _timeit(lambda: step(state, batch)[1]["loss"])
    logp_fn = make_logp_fn(model)
    res["logp_pass_s"] = _timeit(lambda: logp_fn(variables, batch["tokens"], batch["loss_mask"]))
    res["rl_iteration_s_estimate"] = (t_cache + res["train_step_s"] + 2 * res["logp_pass_s"])
    res.update(_iteration_split(model, variables, quick))
    for k, v in res.items():
        print(f"  {k:<28} {v:.4g}" if isinstance(v, float) else f"  {k:<28} {v}")
    return res


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
