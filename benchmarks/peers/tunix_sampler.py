"""google-tunix 0.1.7's Sampler alone on the matched model (benchmarks/peers/__init__.py:MATCHED):
whole calls at 64 new tokens and at 1 new token, at batch 32 (8 prompts x 4) and batch 1.

Run with the PEER's python from the repository root (scripts/setup_peers.sh makes the venv):

    ~/peer-venvs/tunix/bin/python -m benchmarks.peers.tunix_sampler --reps 3

It prints (and with --out writes) one JSON record: Clock samples named sampler_b{B}_g{G} (a whole
sampler call, host tokenisation and detokenisation included) and, inside them, tunix's own
compiled prefill and decode functions (sampler_b{B}_g{G}_prefill_fn / _decode_fn). The first call
of each shape compiles; the driver drops it. Decode tokens/s is computed by the driver the same
way for both sides: B x (64 - 1) / (call at 64 tokens - call at 1 token); the direct timing of
tunix's decode function is kept as a cross-check.

Also the helpers tunix_grpo.py shares: the id tokenizer (prompts are ids written as text; the
end-of-sequence id is outside the vocabulary, so every row generates exactly 64 tokens), the
random prompts and the Qwen3 model of the matched size. Imports tunix: never imported by the
project.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.peers import MATCHED, Clock, emit, flops_per_row, loadavg


class IdTokenizer:
    """Token ids written as space-separated text; BOS 1, PAD 0, EOS = vocab (never sampled)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 1

    def eos_id(self):
        return self.vocab

    def pad_id(self):
        return 0


def prompt_texts(rng, n: int, spec: dict) -> list[str]:
    """n prompts of prompt_len - 1 random ids in [3, vocab) (the sampler prepends BOS)."""
    ids = rng.integers(3, spec["vocab"], (n, spec["prompt_len"] - 1))
    return [" ".join(str(int(x)) for x in row) for row in ids]


def make_model(spec: dict, seed: int):
    """tunix's Qwen3 at the matched size (f32, untied head, 4.46M parameters)."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    m = spec["peer_model"]
    cfg = qwen3.ModelConfig(
        num_layers=m["num_layers"], vocab_size=spec["vocab"], embed_dim=m["embed_dim"],
        hidden_dim=m["hidden_dim"], num_heads=m["num_heads"], head_dim=m["head_dim"],
        num_kv_heads=m["num_kv_heads"], rope_theta=1_000_000, norm_eps=1e-6,
        use_tied_embedding=False)
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


def param_count(model) -> int:
    import jax
    from flax import nnx

    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("google-tunix", "jax", "jaxlib", "flax", "optax")}


def measure(clock: Clock, spec: dict, reps: int, batches=(32, 1)) -> dict:
    """1 warm-up + `reps` calls per (batch, new tokens) shape, the two lengths alternating."""
    import numpy as np
    from tunix.generate import sampler as sampler_lib

    model = make_model(spec, spec["seed"])
    tok = IdTokenizer(spec["vocab"])
    P, G = spec["prompt_len"], spec["new_tokens"]
    rng = np.random.default_rng(spec["seed"] + 1)
    cache = sampler_lib.CacheConfig(cache_size=P + G, num_layers=spec["peer_model"]["num_layers"],
                                    num_kv_heads=spec["peer_model"]["num_kv_heads"],
                                    head_dim=spec["peer_model"]["head_dim"])
    calls = {}
    for B in batches:
        for g in (G, 1):
            name = f"sampler_b{B}_g{g}"
            samp = sampler_lib.Sampler(model, tok, cache)
            samp._compiled_prefill_fn = clock.wrap(samp._compiled_prefill_fn, name + "_prefill_fn",
                                                   lambda s: s.token_buffer)
            samp._compiled_decode_fn = clock.wrap(samp._compiled_decode_fn, name + "_decode_fn",
                                                  lambda s: s.token_buffer)
            calls[name] = (clock.wrap(samp, name, lambda out: None), B, g)
    for i in range(1 + reps):
        for name, (call, B, g) in calls.items():
            n_prompts = max(1, B // spec["group"])
            texts = [t for t in prompt_texts(rng, n_prompts, spec) for _ in range(B // n_prompts)]
            out = call(texts, max_generation_steps=g, max_prompt_length=P, echo=False,
                       temperature=spec["temperature"], top_p=spec["top_p"], seed=i)
            n = sum(len(t) for t in out.tokens)
            if n != B * g:
                raise RuntimeError(f"{name}: {n} tokens generated, expected {B * g} (an early "
                                   "end-of-sequence would make the work unmatched)")
    return {"params": param_count(model),
            "decode_flops_per_token": decode_flops_per_token(
                model, spec["prompts"] * spec["group"], P + G)}


def decode_flops_per_token(model, batch: int, cache_size: int) -> float:
    """XLA's count of the floating-point operations in one decode step of the Qwen3 model (one
    token per row, `batch` rows, a cache of `cache_size` positions: the model's own forward
    over its cache, compiled alone, not run; its cost analysis), per row: the counterpart of
    benchmarks/grpo_matched.py:decode_flops_per_token, for the decode FLOP/s of the peer table."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, cache_size, jnp.float32)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    mask = jnp.ones((batch, 1, cache_size), jnp.bool_)

    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, tokens, cache, mask)

    return flops_per_row(jax.jit(step).lower(state, tokens, cache).compile(), batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="timed calls per shape after the warm-up")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 1])
    p.add_argument("--out", help="also write the JSON record here")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    import jax

    clock = Clock()
    jax.monitoring.register_event_duration_secs_listener(clock.listen)
    rec = {"side": "tunix", "versions": versions(), "load_before": loadavg()}
    rec.update(measure(clock, MATCHED, args.reps, tuple(args.batches)))
    rec.update(load_after=loadavg(), clock=clock.record(), spec=MATCHED)
    emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
