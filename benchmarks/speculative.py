"""`python scripts/bench.py spec`: MTP speculative vs plain decoding, side by side in one run.

The model: the demo's trained RL checkpoint when one exists (`SPEC_BENCH_WORKDIR`, default
runs/demo, as written by `python3 scripts/demo.py`), prompted with held-out demo tasks; otherwise
the tiny preset trained here for a few hundred steps on counting sequences (a task an MTP head
can learn, so acceptance is high; said so in the output). Reported for batch 1 and 32 (8 with
--quick): tokens/s of both samplers (greedy and temperature 1), draft acceptance rate, the
speed-up, and whether greedy outputs are identical (they must be).
Not covered: longer drafts (chaining MTP modules).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def _best(fn, reps=3):
    out = fn()  # compile / warm
    jax.block_until_ready(out.tokens)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out.tokens)
        best = min(best, time.perf_counter() - t)
    return best, out


def _demo_model(workdir: str, batch: int):
    from configs import rl as rl_configs
    from model.tokenizer import load_tokenizer
    from rl.loop import _model, load_rl_variables, load_task_splits
    from rl.pipeline import encode_prompts

    config = rl_configs.get_config("demo")
    config.workdir = workdir
    model, tok = _model(config), load_tokenizer(config.tokenizer)
    variables = load_rl_variables(config, model)
    tasks = [t for t, _ in load_task_splits(config)["test"]][:batch]
    prompts, lengths = encode_prompts(tok, [t.prompt for t in tasks], config.rl.max_prompt_len)
    return (model, variables, jnp.asarray(prompts), jnp.asarray(lengths),
            config.rl.max_new_tokens, tok.eos_id, f"demo RL checkpoint ({workdir})")


def _counting_model(batch: int, quick: bool):
    from configs import models
    from model.config import ModelConfig
    from model.objectives import counting_tokens, fit_lm_on_batch
    from model.transformer import Model

    model = Model(ModelConfig.from_dict(models.get_config("test" if quick else "tiny")))
    variables, history = fit_lm_on_batch(model, model.init(jax.random.key(0)),
                                         counting_tokens(jax.random.key(5), 32, 96),
                                         steps=60 if quick else 300, lr=3e-3)
    met = history[-1]
    prompts = counting_tokens(jax.random.key(9), batch, 16)
    return (model, variables, prompts, jnp.full((batch,), 16, jnp.int32),
            24 if quick else 64, -1,
            f"{'test' if quick else 'tiny'} preset trained here on counting "
            f"(ce {float(met['ce']):.3f}, mtp_ce {float(met['mtp_ce']):.3f})")


def run(quick: bool = False) -> dict:
    from rl.sampler import Sampler, SamplingConfig

    batch = 8 if quick else 32
    workdir = os.environ.get("SPEC_BENCH_WORKDIR", os.path.join("runs", "demo"))
    if not quick and os.path.isdir(os.path.join(workdir, "rl", "checkpoints")):
        model, variables, prompts, lengths, G, eos, source = _demo_model(workdir, batch)
    else:
        model, variables, prompts, lengths, G, eos, source = _counting_model(batch, quick)
    print(f"model: {source}; prompt width {prompts.shape[1]}, up to {G} new tokens", flush=True)
    res = {"source": source, "max_new_tokens": G}
    for B in sorted({1, batch}):
        for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
            row, outs = {}, {}
            for mode in ("none", "mtp"):
                s = Sampler(model, SamplingConfig(max_new_tokens=G, temperature=temp,
                                                  eos_id=eos, speculative=mode))
                t, out = _best(lambda s=s, B=B: s.generate(variables, prompts[:B], lengths[:B],
                                                           jax.random.key(1)))
                row[f"{mode}_tok_s"] = int(jnp.sum(out.lengths)) / t
                outs[mode] = out
            stats = np.asarray(outs["mtp"].draft_stats)
            row["acceptance"] = float(stats[1] / max(stats[0], 1))
            row["speedup"] = row["mtp_tok_s"] / row["none_tok_s"]
            if name == "greedy":
                row["greedy_identical"] = bool(np.array_equal(np.asarray(outs["none"].tokens),
                                                              np.asarray(outs["mtp"].tokens)))
            res[f"batch{B}_{name}"] = row
            print(f"batch {B:3d} {name:8s} plain {row['none_tok_s']:7.0f} tok/s | speculative "
                  f"{row['mtp_tok_s']:7.0f} tok/s | x{row['speedup']:.2f} | acceptance "
                  f"{row['acceptance']:.2f}" + (f" | identical {row['greedy_identical']}"
                                                if name == "greedy" else ""), flush=True)
    return res
