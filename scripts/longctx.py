"""Long-context retrieval benchmark: which attention layout keeps retrieval past its training
length, what its decode state costs, and how fast it prefills and decodes.

    python scripts/longctx.py --config configs/longctx.py          # run times: README
    python scripts/longctx.py --config configs/longctx.py:smoke    # the same, smaller
    python scripts/longctx.py --config configs/longctx.py --dry_run # validate the config only

Steps (config: configs/longctx.py):
  1. tasks, generated from seeds (numpy; `mqar`, `needle`), vocabulary `Vocab`:
       mqar    BOS, a context of noise tokens hiding `mqar_pairs` key-value pairs, QUERY, then
               `mqar_queries` of the keys, each followed by its value (the targets);
       needle  BOS, a context made entirely of key-value pairs whose keys repeat, except one
               (the needle, at a controlled depth), QUERY, the needle key, its value (target).
     A query's answer is only in the context; the number of distractors grows with the length.
  2. training: one model per layout and seed, same steps / batch / lr / data stream at
     train.length; the seeds are vmapped in one program. The first train.copy_frac of the steps
     train on `copy_task` (a random segment repeated: dense next-token targets that need the
     induction circuit), the rest on half mqar, half needle at uniform depths. Without the copy
     phase two attention layers do not form that circuit from the tasks' sparse answer targets in
     this budget (dense MLA, 1 seed at L=32: MQAR 0.34 / needle 0.15 after 600 steps, 0.49 / 0.20
     after 2400; with 600 copy steps then 900 task steps: 1.00 / 1.00), while a KDA layer's short
     convolution hands it the previous token for free.
     Loss: cross-entropy on the answers + the DSA indexer KL (model/objectives.py). DSA layouts
     train on the dense path with the indexer KL for train.dense_warmup_frac of the steps, then
     on the sparse top-k path (the indexer keeps training through its KL).
  3. accuracy at every eval length (train length up to 16x), answers read from the logits of a
     chunked prefill (Model.prefill chunk=eval.prefill_chunk); argmax over the whole vocabulary.
     Per cell: per-seed accuracy, the mean over seeds and its 95% Student-t interval over seeds.
  4. per layout and length: decode-state bytes per sequence read from the live cache after a
     prefill (sum of nbytes of the cache pytree / batch) next to model/plan.py's
     decode_state_bytes for the same config and length; prefill tokens/s (chunked) and decode
     tokens/s (a compiled loop of decode steps), compile excluded, the best of speed.repeats.
  5. memory: the compiled memory analysis (XLA temp + arguments + outputs) of a
     memory.length-token prefill of the memory.model preset, with memory.chunk-token chunks vs
     one shot (nothing that large is executed one-shot), and the chunked prefill's wall time.
Writes <out_dir>/longctx.json (every cell) and <out_dir>/longctx.png, prints a markdown table.

Not covered: natural-language retrieval, lengths past what 2 CPU cores evaluate in minutes
(512 for accuracy, 2048 for speed; the memory section compiles and runs 16K), MoE layers (the layouts
differ only in attention), training at one length and fine-tuning at another (YaRN).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from runtime.xla_env import configure_xla_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
configure_xla_env()

import numpy as np  # noqa: E402

# ----------------------------------------------------------------------------- vocabulary
PAD, BOS, QUERY = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Token ids: 0 PAD, 1 BOS, 2 QUERY, then n_keys keys, n_values values, noise up to size."""

    n_keys: int
    n_values: int
    size: int

    def __post_init__(self):
        if self.n_keys < 2 or self.n_values < 2 or self.noise0 >= self.size:
            raise ValueError(f"vocabulary {self}: needs >= 2 keys, >= 2 values and room for "
                             f"noise tokens (size > {self.noise0})")

    @property
    def key0(self) -> int:
        return 3

    @property
    def val0(self) -> int:
        return 3 + self.n_keys

    @property
    def noise0(self) -> int:
        return 3 + self.n_keys + self.n_values


def vocab_of(config) -> Vocab:
    return Vocab(config.task.n_keys, config.task.n_values, config.model.vocab_size)


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # [L] int32
    targets: np.ndarray  # [L] bool: tokens that are answers (predicted from position t-1)


def mqar(rng: np.random.Generator, voc: Vocab, length: int, n_pairs: int,
         n_queries: int) -> Example:
    """Multi-query associative recall: n_pairs key-value pairs at random non-overlapping spots
    among noise, then QUERY and n_queries distinct keys of them, each followed by its value."""
    ctx = length - 2 - 2 * n_queries  # BOS + context + QUERY + queries
    if ctx < 2 * n_pairs or n_queries > n_pairs or n_pairs > voc.n_keys:
        raise ValueError(f"mqar: length {length} cannot hold {n_pairs} pairs and {n_queries} "
                         f"queries (needs length >= {2 * n_pairs + 2 * n_queries + 2}, "
                         f"queries <= pairs <= {voc.n_keys})")
    toks = np.empty(length, np.int64)
    toks[0] = BOS
    toks[1:1 + ctx] = rng.integers(voc.noise0, voc.size, ctx)
    keys = rng.choice(voc.n_keys, n_pairs, replace=False) + voc.key0
    vals = rng.integers(0, voc.n_values, n_pairs) + voc.val0
    shift = int(rng.integers(0, 2)) if ctx % 2 else 0  # pairs start at either parity
    slots = np.sort(rng.choice(ctx // 2, n_pairs, replace=False))
    for s, k, v in zip(slots, keys, vals):
        toks[1 + shift + 2 * s], toks[2 + shift + 2 * s] = k, v
    q = 1 + ctx
    toks[q] = QUERY
    targets = np.zeros(length, bool)
    for i, j in enumerate(rng.choice(n_pairs, n_queries, replace=False)):
        toks[q + 1 + 2 * i], toks[q + 2 + 2 * i] = keys[j], vals[j]
        targets[q + 2 + 2 * i] = True
    return Example(toks.astype(np.int32), targets)


def needle(rng: np.random.Generator, voc: Vocab, length: int, depth: float) -> Example:
    """One needle pair among distractor pairs: the context is (length-4)//2 key-value pairs; the
    needle key appears once, at pair index round(depth * (pairs-1)); every other pair's key is
    any other key (they repeat), its value random. Then QUERY, the needle key, its value."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    ctx = length - 4  # BOS + context + QUERY key value
    n = ctx // 2
    if n < 1:
        raise ValueError(f"needle: length {length} too short (needs >= 6)")
    toks = np.empty(length, np.int64)
    toks[0] = BOS
    key = int(rng.integers(0, voc.n_keys))
    others = rng.integers(0, voc.n_keys - 1, n)
    others = others + (others >= key)  # every key but the needle's
    pair_keys = others + voc.key0
    pair_vals = rng.integers(0, voc.n_values, n) + voc.val0
    at = int(round(depth * (n - 1)))
    pair_keys[at] = key + voc.key0
    toks[1:1 + 2 * n:2], toks[2:2 + 2 * n:2] = pair_keys, pair_vals
    if ctx % 2:
        toks[1 + 2 * n] = int(rng.integers(voc.noise0, voc.size))
    toks[-3:] = QUERY, key + voc.key0, pair_vals[at]
    targets = np.zeros(length, bool)
    targets[-1] = True
    return Example(toks.astype(np.int32), targets)


def copy_task(rng: np.random.Generator, voc: Vocab, length: int) -> Example:
    """Induction warm-up (training only): BOS, a segment of n distinct non-special tokens (n
    uniform in [4, (length-1)//2]), repeated cyclically to the end. Targets: every token of the
    repeats from the second on, each predictable only by finding its predecessor's earlier
    occurrence and copying what followed it (the induction circuit mqar and needle need)."""
    top = (length - 1) // 2
    if top < 4:
        raise ValueError(f"copy_task: length {length} too short (needs >= 9)")
    n = int(rng.integers(4, top + 1))
    seg = rng.choice(np.arange(voc.key0, voc.size), n, replace=False)
    toks = np.concatenate([[BOS], seg[np.arange(length - 1) % n]])
    targets = np.zeros(length, bool)
    targets[n + 2:] = True
    return Example(toks.astype(np.int32), targets)


def copy_batch(rng: np.random.Generator, voc: Vocab, batch: int, length: int) -> tuple:
    """(tokens [batch,length] int32, targets bool) of copy_task examples."""
    exs = [copy_task(rng, voc, length) for _ in range(batch)]
    return np.stack([e.tokens for e in exs]), np.stack([e.targets for e in exs])


def train_batch(rng: np.random.Generator, voc: Vocab, batch: int, length: int, task) -> tuple:
    """Half mqar, half needle at uniform depths: (tokens [batch,length] int32, targets bool)."""
    exs = [mqar(rng, voc, length, task.mqar_pairs, task.mqar_queries) if i % 2 == 0
           else needle(rng, voc, length, float(rng.uniform())) for i in range(batch)]
    return np.stack([e.tokens for e in exs]), np.stack([e.targets for e in exs])


def eval_set(voc: Vocab, task_name: str, length: int, n: int, task,
             depth: float | None = None, seed: int = 0) -> tuple:
    """The fixed evaluation examples of one cell (the same for every layout and training seed;
    seeded apart from training, which draws from seed-indexed streams)."""
    key = [10_007, length, seed, 0 if depth is None else int(round(depth * 1000)),
           0 if task_name == "mqar" else 1]
    rng = np.random.default_rng(key)
    exs = [mqar(rng, voc, length, task.mqar_pairs, task.mqar_queries) if task_name == "mqar"
           else needle(rng, voc, length, depth) for _ in range(n)]
    return np.stack([e.tokens for e in exs]), np.stack([e.targets for e in exs])


# ----------------------------------------------------------------------------- statistics
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228}


def seed_interval(values) -> tuple[float, float, float]:
    """(mean, lo, hi): the 95% Student-t interval of the mean over seeds, clipped to [0, 1];
    NaN bounds with one seed."""
    v = np.asarray(values, np.float64)
    m = float(v.mean())
    if v.size < 2:
        return m, math.nan, math.nan
    half = _T975.get(v.size - 1, 1.96) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return m, max(0.0, m - half), min(1.0, m + half)


# ----------------------------------------------------------------------------- models
def layout_configs(config) -> dict:
    """name -> (sparse-stage ModelConfig, dense-warm-up ModelConfig or None)."""
    from model.config import ModelConfig

    base = ModelConfig.from_dict(config.model)
    out = {}
    for name, spec in config.layouts.items():
        pattern, _, over = spec.partition(";")
        fields = {}
        for kv in filter(None, over.split(",")):
            k, _, v = kv.partition("=")
            cur = getattr(base.dsa, k)
            fields[k] = type(cur)(v) if not isinstance(cur, str) else v
        dsa = dataclasses.replace(base.dsa, **fields)
        cfg = base.replace(layer_pattern=pattern, dsa=dsa, name=f"longctx_{name}")
        warm = None
        if "D" in pattern and dsa.indexer_stage == "sparse" and config.train.dense_warmup_frac > 0:
            warm = cfg.replace(dsa=dataclasses.replace(dsa, indexer_stage="dense_warmup"))
        out[name] = (cfg, warm)
    return out


def train_layout(cfg, warm_cfg, config, log) -> tuple:
    """Train config.seeds models of one layout (vmapped over seeds). Returns (params stacked
    over seeds, per-seed history of (step, loss, answer ce))."""
    import jax
    import jax.numpy as jnp
    import optax

    from model.objectives import lm_loss
    from model.transformer import Model

    tr, S = config.train, config.seeds
    models = {"sparse": Model(cfg), "warm": Model(warm_cfg) if warm_cfg else None}
    init = models["sparse"].init
    params = jax.vmap(lambda k: init(k, seq_len=tr.length)["params"])(
        jnp.stack([jax.random.key(1000 + s) for s in range(S)]))
    sched = optax.warmup_cosine_decay_schedule(0.0, tr.lr, tr.warmup, tr.steps, tr.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, weight_decay=tr.weight_decay))
    opt_state = jax.vmap(opt.init)(params)

    def make_step(model):
        def one(p, st, tokens, targets):
            def loss_fn(p):
                out = model.apply({"params": p}, tokens, with_mtp=False)
                return lm_loss(out, tokens, targets, model.cfg)
            (loss, met), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
            up, st = opt.update(g, st, p)
            return optax.apply_updates(p, up), st, loss, met["ce"]
        return jax.jit(jax.vmap(one))

    steps = {k: make_step(m) for k, m in models.items() if m is not None}
    n_warm = int(round(tr.dense_warmup_frac * tr.steps)) if warm_cfg else 0
    n_copy = int(round(tr.copy_frac * tr.steps))
    rngs = [np.random.default_rng([20_011, s]) for s in range(S)]
    voc = vocab_of(config)
    history, t0 = [], time.time()
    for i in range(tr.steps):
        batches = [copy_batch(r, voc, tr.batch, tr.length) if i < n_copy
                   else train_batch(r, voc, tr.batch, tr.length, config.task) for r in rngs]
        tokens = jnp.asarray(np.stack([b[0] for b in batches]))
        targets = jnp.asarray(np.stack([b[1] for b in batches]))
        fn = steps["warm"] if i < n_warm else steps["sparse"]
        params, opt_state, loss, ce = fn(params, opt_state, tokens, targets)
        if i % max(1, tr.steps // 10) == 0 or i == tr.steps - 1:
            loss, ce = np.asarray(loss), np.asarray(ce)
            history.append({"step": i, "loss": loss.tolist(), "ce": ce.tolist()})
            log(f"  step {i:5d}  ce per seed {np.round(ce, 3).tolist()}  "
                f"({time.time() - t0:.0f} s)")
    return params, history, time.time() - t0


def evaluate_layout(cfg, params, config, log) -> list[dict]:
    """Accuracy cells of one layout: every (task, length, depth) x seed."""
    import jax
    import jax.numpy as jnp

    from model.transformer import Model

    model, ev, task = Model(cfg), config.eval, config.task
    programs = {}

    def predict(length):
        if length not in programs:
            chunk = ev.prefill_chunk if length > ev.prefill_chunk else 0

            def one(p, tokens):
                B = tokens.shape[0]
                lengths = jnp.full((B,), length, jnp.int32)
                logits, _, _ = model.prefill({"params": p}, tokens, lengths,
                                             model.init_cache(B, length), chunk=chunk)
                return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,L]
            programs[length] = jax.jit(jax.vmap(one, in_axes=(0, None)))
        return programs[length]

    cells = []
    for length in ev.lengths:
        jobs = [("mqar", None)] + [("needle", float(d)) for d in task.needle_depths]
        for name, depth in jobs:
            tokens, targets = eval_set(vocab_of(config), name, length, ev.examples, task, depth)
            correct = np.zeros((config.seeds,), np.int64)
            for i in range(0, ev.examples, ev.batch):
                tb, gb = tokens[i:i + ev.batch], targets[i:i + ev.batch]
                pred = np.asarray(predict(length)(params, jnp.asarray(tb)))  # [S,b,L]
                hit = (pred[:, :, :-1] == tb[None, :, 1:]) & gb[None, :, 1:]
                correct += hit.sum(axis=(1, 2))
            total = int(targets.sum())
            for s in range(config.seeds):
                cells.append({"task": name, "length": int(length), "depth": depth, "seed": s,
                              "correct": int(correct[s]), "total": total,
                              "acc": float(correct[s] / total)})
            accs = [c["acc"] for c in cells[-config.seeds:]]
            log(f"  {name:6s} L={length:5d}" + (f" depth={depth:.1f}" if depth is not None
                                                else "          ")
                + f"  acc per seed {np.round(accs, 3).tolist()}")
    return cells


def speed_layout(cfg, params0, config, log) -> list[dict]:
    """Per length: live decode-state bytes per sequence vs plan.py, prefill and decode tok/s."""
    import jax
    import jax.numpy as jnp

    from model.plan import decode_state_bytes
    from model.transformer import Model

    model, sp = Model(cfg), config.speed
    variables = {"params": params0}
    out = []
    for length in sp.lengths:
        S = length + sp.decode_steps
        chunk = sp.prefill_chunk if length > sp.prefill_chunk else 0
        rng = np.random.default_rng([30_011, length])
        tokens = jnp.asarray(np.stack([mqar(rng, vocab_of(config), length, config.task.mqar_pairs,
                                            config.task.mqar_queries).tokens
                                       for _ in range(sp.batch)]))
        lengths = jnp.full((sp.batch,), length, jnp.int32)
        prefill = jax.jit(lambda v, t, n, S=S, chunk=chunk: model.prefill(
            v, t, n, model.init_cache(sp.batch, S), chunk=chunk)[:2])

        @jax.jit
        def decode(v, cache, tok):
            def body(_, carry):
                tok, cache = carry
                logits, cache, _ = model.decode_step(v, tok, cache)
                return jnp.argmax(logits, -1).astype(jnp.int32), cache
            return jax.lax.fori_loop(0, sp.decode_steps, body, (tok, cache))

        def timed(fn, *args):
            best = math.inf
            jax.block_until_ready(fn(*args))  # compile + warm
            for _ in range(sp.repeats):
                t0 = time.perf_counter()
                r = jax.block_until_ready(fn(*args))
                best = min(best, time.perf_counter() - t0)
            return best, r

        t_pre, (logits, cache) = timed(prefill, variables, tokens, lengths)
        live = sum(x.nbytes for x in jax.tree.leaves(cache)) / sp.batch
        tok0 = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        t_dec, _ = timed(decode, variables, cache, tok0)
        plan = decode_state_bytes(cfg, S)
        row = {"length": int(length), "cache_len": int(S), "state_bytes_live": float(live),
               "state_bytes_plan": int(plan["hybrid"]),
               "plan_ratio": float(live / plan["hybrid"]),
               "plan_all_mha_bytes": int(plan["all_mha"]),
               "prefill_tok_s": sp.batch * length / t_pre,
               "decode_tok_s": sp.batch * sp.decode_steps / t_dec,
               "batch": sp.batch, "prefill_chunk": chunk}
        out.append(row)
        log(f"  L={length:5d} state {live / 1024:9.1f} KiB/seq (plan {plan['hybrid'] / 1024:9.1f}"
            f" KiB, ratio {row['plan_ratio']:.4f})  prefill {row['prefill_tok_s']:9.0f} tok/s"
            f"  decode {row['decode_tok_s']:7.0f} tok/s")
    return out


def prefill_memory(config, log) -> dict:
    """Compiled memory of a long prefill of a preset model: chunked vs one shot (compile only),
    then the chunked prefill executed once (wall time)."""
    import jax
    import jax.numpy as jnp

    from configs import models
    from model.config import ModelConfig
    from model.transformer import Model

    mc = config.memory
    c = models.get_config(mc.model)
    c.max_seq_len = max(c.max_seq_len, mc.length)
    model = Model(ModelConfig.from_dict(c))
    T = mc.length
    abstract = (jax.eval_shape(lambda: model.init(jax.random.key(0))),
                jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32),
                jax.eval_shape(lambda: model.init_cache(1, T)))
    out = {"model": mc.model, "length": T, "chunk": mc.chunk,
           "measure": "XLA compiled memory_analysis(): temp (scratch) + argument + output bytes"}
    progs = {}
    for label, chunk in (("chunked", mc.chunk), ("one_shot", 0)):
        fn = jax.jit(lambda v, t, n, c, chunk=chunk: model.prefill(v, t, n, c, chunk=chunk))
        progs[label] = fn
        m = fn.lower(*abstract).compile().memory_analysis()
        out[label] = {"temp_bytes": int(m.temp_size_in_bytes),
                      "argument_bytes": int(m.argument_size_in_bytes),
                      "output_bytes": int(m.output_size_in_bytes),
                      "peak_bytes": int(m.temp_size_in_bytes + m.argument_size_in_bytes
                                        + m.output_size_in_bytes - m.alias_size_in_bytes)}
        log(f"  {label:8s} temp {m.temp_size_in_bytes / 2**20:8.1f} MiB  peak "
            f"{out[label]['peak_bytes'] / 2**20:8.1f} MiB")
    out["peak_ratio_one_shot_over_chunked"] = (out["one_shot"]["peak_bytes"]
                                               / out["chunked"]["peak_bytes"])
    variables = model.init(jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, c.vocab_size, (1, T)), jnp.int32)
    args = (variables, tokens, jnp.array([T], jnp.int32), model.init_cache(1, T))
    jax.block_until_ready(progs["chunked"](*args))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(progs["chunked"](*args))
    out["chunked_wall_s"] = time.perf_counter() - t0
    log(f"  chunked {T}-token prefill ran in {out['chunked_wall_s']:.1f} s "
        f"({T / out['chunked_wall_s']:.0f} tok/s)")
    return out


# ----------------------------------------------------------------------------- outputs
def summarize(cells: list[dict]) -> list[dict]:
    """Per (layout, task, length): mean over seeds [95% t-interval]; needle pooled over depths
    per seed first."""
    rows = {}
    for c in cells:
        key = (c["layout"], c["task"], c["length"])
        per_seed = rows.setdefault(key, {})
        a = per_seed.setdefault(c["seed"], [0, 0])
        a[0] += c["correct"]
        a[1] += c["total"]
    out = []
    for (layout, task, length), per_seed in rows.items():
        accs = [v[0] / v[1] for _, v in sorted(per_seed.items())]
        m, lo, hi = seed_interval(accs)
        out.append({"layout": layout, "task": task, "length": length, "mean": m, "lo": lo,
                    "hi": hi, "per_seed": accs})
    return out


def markdown_table(summary, speed, lengths) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in summary))
    idx = {(r["layout"], r["task"], r["length"]): r for r in summary}
    lines = []
    for task in ("mqar", "needle"):
        lines.append(f"\n{task} accuracy, mean over seeds [95% interval over seeds]:\n")
        lines.append("| layout | " + " | ".join(f"L={n}" for n in lengths) + " |")
        lines.append("|---|" + "---|" * len(lengths))
        for lay in layouts:
            cells = []
            for n in lengths:
                r = idx[(lay, task, n)]
                cells.append(f"{r['mean']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]")
            lines.append(f"| {lay} | " + " | ".join(cells) + " |")
    sl = sorted({r["length"] for rows in speed.values() for r in rows})
    lines.append("\nDecode state per sequence (live cache; plan.py ratio), prefill / decode "
                 "tokens/s:\n")
    lines.append("| layout | " + " | ".join(f"L={n}" for n in sl) + " |")
    lines.append("|---|" + "---|" * len(sl))
    for lay, rows in speed.items():
        cells = [f"{r['state_bytes_live'] / 1024:.1f} KiB ({r['plan_ratio']:.3f}); "
                 f"{r['prefill_tok_s']:.0f} / {r['decode_tok_s']:.0f}" for r in rows]
        lines.append(f"| {lay} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary, speed, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    layouts = list(dict.fromkeys(r["layout"] for r in summary))
    for ax, task in zip(axes[0], ("mqar", "needle")):
        for lay in layouts:
            rs = sorted((r for r in summary if r["layout"] == lay and r["task"] == task),
                        key=lambda r: r["length"])
            x = [r["length"] for r in rs]
            m = np.array([r["mean"] for r in rs])
            lo = np.array([r["lo"] for r in rs])
            hi = np.array([r["hi"] for r in rs])
            ax.plot(x, m, marker="o", label=lay)
            ax.fill_between(x, lo, hi, alpha=0.15)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{task}: accuracy vs length (95% interval over seeds)")
        ax.legend()
    ax_s, ax_t = axes[1]
    for lay, rows in speed.items():
        x = [r["length"] for r in rows]
        ax_s.plot(x, [r["state_bytes_live"] for r in rows], marker="o", label=f"{lay} (live)")
        ax_s.plot(x, [r["state_bytes_plan"] for r in rows], ls=":", color="k", lw=0.8)
        ax_t.plot(x, [r["prefill_tok_s"] for r in rows], marker="o", label=f"{lay} prefill")
        ax_t.plot(x, [r["decode_tok_s"] for r in rows], marker="s", ls="--",
                  label=f"{lay} decode")
    for ax in (ax_s, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
    ax_s.set_ylabel("decode state bytes / sequence")
    ax_s.set_title("decode state (dotted: plan.py)")
    ax_s.legend(fontsize=8)
    ax_t.set_ylabel("tokens/s")
    ax_t.set_title("prefill and decode speed (CPU)")
    ax_t.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(config) -> dict:
    import jax

    t_start = time.time()
    os.makedirs(config.out_dir, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    log(f"longctx[{config.name}]: {jax.devices()[0].platform}, layouts "
        f"{list(config.layouts.keys())}, {config.seeds} seeds, train length {config.train.length}, "
        f"eval lengths {list(config.eval.lengths)}")
    result = {"config": config.to_dict(), "cells": [], "speed": {}, "train": {}}
    for name, (cfg, warm) in layout_configs(config).items():
        log(f"[{name}] pattern {cfg.layer_pattern}, dsa positions {cfg.dsa.positions}, "
            f"stage {cfg.dsa.indexer_stage}{' after dense warm-up' if warm else ''}")
        params, history, train_s = train_layout(cfg, warm, config, log)
        result["train"][name] = {"history": history, "wall_s": train_s}
        t0 = time.time()
        for c in evaluate_layout(cfg, params, config, log):
            result["cells"].append({"layout": name, **c})
        result["train"][name]["eval_wall_s"] = time.time() - t0
        params0 = jax.tree.map(lambda x: x[0], params)
        result["speed"][name] = speed_layout(cfg, params0, config, log)
    if config.memory.enabled:
        log(f"[memory] {config.memory.model} model, {config.memory.length}-token prefill")
        result["memory"] = prefill_memory(config, log)
    result["summary"] = summarize(result["cells"])
    result["wall_s"] = time.time() - t_start
    table = markdown_table(result["summary"], result["speed"], list(config.eval.lengths))
    result["table"] = table
    with open(os.path.join(config.out_dir, "longctx.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result["summary"], result["speed"], os.path.join(config.out_dir, "longctx.png"))
    log(table)
    log(f"wrote {config.out_dir}/longctx.json and longctx.png; total {result['wall_s'] / 60:.1f} min")
    return result


def validate(config) -> str:
    """--dry_run: build every layout's ModelConfig (ConfigError names a bad field), the
    vocabulary, and one example of each task at every train/eval/speed length; returns what
    would run. Nothing is compiled or trained."""
    voc = vocab_of(config)
    layouts = layout_configs(config)
    if config.seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {config.seeds}")
    if not 0.0 <= config.train.copy_frac < 1.0:
        raise ValueError(f"train.copy_frac must be in [0, 1) (the rest of the steps train on "
                         f"the tasks), got {config.train.copy_frac}")
    copy_task(np.random.default_rng(0), voc, config.train.length)
    lengths = sorted({config.train.length, *config.eval.lengths, *config.speed.lengths})
    rng = np.random.default_rng(0)
    for n in lengths:
        mqar(rng, voc, n, config.task.mqar_pairs, config.task.mqar_queries)
        for d in config.task.needle_depths:
            needle(rng, voc, n, float(d))
    return (f"longctx[{config.name}]: layouts "
            + ", ".join(f"{k}={c.layer_pattern}" for k, (c, _) in layouts.items())
            + f"; {config.seeds} seeds x {config.train.steps} steps at {config.train.length} "
            f"tokens; eval {list(config.eval.lengths)}; speed {list(config.speed.lengths)}; "
            f"memory {'on' if config.memory.enabled else 'off'}; out {config.out_dir}")


def main(argv) -> None:
    """Parse --config (and --config.* overrides) into a private FlagValues, apart from absl's
    global flags."""
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", "configs/longctx.py",
                                             "long-context benchmark config", flag_values=fv)
    dry = flags.DEFINE_bool("dry_run", False, "only validate the config (layouts, vocabulary, "
                            "task lengths), print what would run, and exit", flag_values=fv)
    fv(argv)
    if dry.value:
        print(validate(holder.value))
        return
    import jax

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".cache", "jax"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    run(holder.value)


if __name__ == "__main__":
    main(sys.argv)
