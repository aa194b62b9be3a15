"""`python scripts/bench.py spec`: MTP speculative decoding with k = 1, 2, 3 drafts per trunk pass
vs plain decoding, side by side in one run.

The model: the demo's trained RL checkpoint when one exists (`DEMO_WORKDIR`, default
runs/demo, as written by `python3 scripts/demo.py`), prompted with held-out demo tasks (the test
split); otherwise the tiny preset trained here for a few hundred steps on counting sequences (a
task an MTP head can learn, so acceptance is high; said so in the output). Reported for batch 32
(8 with --quick, k = 1, 2 only) and batch 1 (8 prompts, 4 with --quick, one after another),
greedy and temperature 1, from medians of 5 alternating rounds (3 with --quick; every sampler
once per round, order rotated): tokens/s of each sampler and the speed-up over plain decoding;
per k the acceptance rate of each draft position (given the earlier ones were accepted), tokens
per row trunk pass, row trunk passes per generated token (plain decoding: 1; the number that predicts the
speed-up where a decode step is bound by memory bandwidth), the batch's loop iterations relative
to plain decoding, the measured time of one speculative loop iteration relative to one plain
decode iteration on this machine (prefill included in both), and the k
`rl.speculative.choose_draft_tokens` picks from the measured acceptance under two cost models
(memory-bound: verification free, a draft 1/num_layers of a trunk pass; and the step costs
measured here, fitted over every k by `rl.speculative.fit_step_cost` as a fixed overhead plus a
cost per draft). Greedy outputs must be identical to plain decoding (reported). The 1-minute load
average is recorded with the numbers.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t, out


def _demo_model(workdir: str, batch: int):
    from configs import rl as rl_configs
    from model.tokenizer import load_tokenizer
    from rl.pipeline import encode_prompts
    from train.data import balanced, load_task_splits
    from train.models import config_model
    from train.weights import load_rl_variables

    config = rl_configs.get_config("demo")
    config.workdir = workdir
    model, tok = config_model(config), load_tokenizer(config.tokenizer)
    variables = load_rl_variables(config, model)
    tasks = balanced([t for t, _ in load_task_splits(config)["test"]], batch)  # all domains
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


def run(quick: bool = False, batches: tuple[int, ...] | None = None) -> dict:
    """batches: the batch sizes to measure (default 1 and 32; 1 and 8 with quick)."""
    from rl.sampler import SampleOutput, Sampler, SamplingConfig
    from rl.speculative import choose_draft_tokens, draft_summary, fit_step_cost

    batch = 8 if quick else 32
    ks = (1, 2) if quick else (1, 2, 3)
    rounds = 3 if quick else 5
    single = 4 if quick else 8  # prompts run one by one for the batch-1 numbers
    workdir = os.environ.get("DEMO_WORKDIR", os.path.join("runs", "demo"))
    if not quick and os.path.isdir(os.path.join(workdir, "rl", "checkpoints")):
        model, variables, prompts, lengths, G, eos, source = _demo_model(workdir, batch)
    else:
        model, variables, prompts, lengths, G, eos, source = _counting_model(batch, quick)
    print(f"model: {source}; prompt width {prompts.shape[1]}, up to {G} new tokens", flush=True)
    res = {"source": source, "max_new_tokens": G, "rounds": rounds, "draft_tokens": list(ks),
           "batch1_prompts": single,
           "load_avg_start": os.getloadavg()[0]}
    modes = ["plain"] + [f"k{k}" for k in ks]
    for B in batches or sorted({1, batch}):
        for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
            samplers = {"plain": Sampler(model, SamplingConfig(max_new_tokens=G, temperature=temp,
                                                               eos_id=eos))}
            for k in ks:
                samplers[f"k{k}"] = Sampler(model, SamplingConfig(
                    max_new_tokens=G, temperature=temp, eos_id=eos, speculative="mtp",
                    draft_tokens=k))
            outs, times = {}, {m: [] for m in modes}

            def call(m, B=B, samplers=samplers):
                if B > 1:
                    return samplers[m].generate(variables, prompts[:B], lengths[:B],
                                                jax.random.key(1))
                # batch 1: the first `single` prompts one after another (one program)
                outs = [samplers[m].generate(variables, prompts[i:i + 1], lengths[i:i + 1],
                                             jax.random.key(1)) for i in range(single)]
                return SampleOutput(
                    tokens=jnp.concatenate([o.tokens for o in outs]),
                    logprobs=jnp.concatenate([o.logprobs for o in outs]),
                    mask=jnp.concatenate([o.mask for o in outs]),
                    lengths=jnp.concatenate([o.lengths for o in outs]),
                    finished=jnp.concatenate([o.finished for o in outs]),
                    draft_stats=(None if outs[0].draft_stats is None else
                                 sum(o.draft_stats for o in outs)))

            for m in modes:  # compile / warm
                _, outs[m] = _timed(lambda m=m: call(m))
            loads = []
            for r in range(rounds):
                order = modes[r % len(modes):] + modes[:r % len(modes)]
                for m in order:
                    t, outs[m] = _timed(lambda m=m: call(m))
                    times[m].append(t)
                loads.append(os.getloadavg()[0])
            med = {m: statistics.median(times[m]) for m in modes}
            plain_n = np.asarray(outs["plain"].lengths)
            # loop iterations of the plain sampler (batch 1: summed over the prompts)
            plain_iters = int(np.max(plain_n)) - 1 if B > 1 else int(np.sum(plain_n - 1))
            row = {"plain_tok_s": int(jnp.sum(outs["plain"].lengths)) / med["plain"],
                   "load_avg": statistics.median(loads)}
            for k in ks:
                m = f"k{k}"
                out = outs[m]
                summ = draft_summary(out.draft_stats, out.lengths)
                if B == 1:  # sequential calls: the batch is one row
                    summ["batch_passes_per_token"] = summ["passes_per_token"]
                tok_s = int(jnp.sum(out.lengths)) / med[m]
                # one speculative loop iteration vs one plain one, in time (prefill included)
                step_cost = (med[m] / max(summ["batch_passes"], 1)) / (med["plain"]
                                                                       / max(plain_iters, 1))
                row[m] = {"tok_s": tok_s, "speedup": tok_s / row["plain_tok_s"], **summ,
                          "step_cost": step_cost}
                if temp == 0.0:
                    row[m]["identical"] = bool(np.array_equal(np.asarray(outs["plain"].tokens),
                                                              np.asarray(out.tokens)))
                print(f"batch {B:3d} {name:8s} k={k} plain {row['plain_tok_s']:7.0f} tok/s | "
                      f"speculative {tok_s:7.0f} tok/s x{tok_s / row['plain_tok_s']:.2f} | "
                      f"acceptance/position {[round(a, 2) for a in summ['acceptance']]} | "
                      f"tokens/pass {summ['tokens_per_pass']:.2f} | passes/token "
                      f"{summ['passes_per_token']:.2f} (batch {summ['batch_passes_per_token']:.2f})"
                      f" | step cost x{step_cost:.2f}"
                      + (f" | identical {row[m]['identical']}" if temp == 0.0 else "")
                      + f" | load {row['load_avg']:.1f}", flush=True)
            acc = row[f"k{ks[-1]}"]["acceptance"]
            mem_k, mem_speed = choose_draft_tokens(acc, draft_cost=1 / model.cfg.num_layers)
            # measured here: the step costs at every k, fit 1 + overhead + c k (k >= 1)
            over, c = fit_step_cost(ks, [row[f"k{k}"]["step_cost"] for k in ks])
            cpu_k, cpu_speed = choose_draft_tokens(acc, draft_cost=c, step_overhead=over)
            row["choose_k"] = {"memory_bound": mem_k, "memory_bound_speedups": mem_speed,
                               "measured_cost": cpu_k, "measured_cost_per_draft": c,
                               "measured_cost_overhead": over,
                               "measured_cost_speedups": cpu_speed}
            print(f"batch {B:3d} {name:8s} choose k: memory-bound {mem_k} "
                  f"{[round(x, 2) for x in mem_speed]}; measured step cost (1 + {over:.2f} + "
                  f"{c:.2f} k) {cpu_k} {[round(x, 2) for x in cpu_speed]}", flush=True)
            res[f"batch{B}_{name}"] = row
    return res
