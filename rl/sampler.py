"""Generation: one jit-compiled prefill + decode loop over the model's explicit cache.

    sampler = Sampler(model, SamplingConfig(max_new_tokens=64, temperature=1.0))
    out = sampler.generate(variables, prompts, prompt_lengths, rng)   # right-padded prompts
    out.tokens [B,G], out.logprobs [B,G] (under the sampling distribution), out.mask [B,G]

The cache is created inside the compiled function and carried through a `lax.while_loop`, so XLA
updates it in place (no copy per step); the loop stops when every row has finished (EOS, a stop
sequence, or max_new_tokens). Rows of different prompt lengths run together: each row decodes
from its own position. Reproducible: the same rng and inputs give the same tokens.

Sampling transforms, in order: temperature (0 = greedy), top-k, top-p (nucleus). The returned
log-probs are those of the distribution actually sampled from (after the transforms); the
trainer's log-probs of the same tokens come from one teacher-forced forward
(`rl.train_step.make_logp_fn`), and the
gap between them is the sampler/trainer mismatch that TIS corrects.

Also here: `pack` (prompt + completion rows for the trainer). Trainer-side log-probs of packed rows:
`rl.train_step.make_logp_fn`.
Not covered: MTP speculative decoding (the MTP head is trained, drafting is not wired in yet).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model.transformer import Model


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off
    eos_id: int = 2
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences that end a row

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@flax.struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B,G] generated ids (EOS included when sampled; pad after)
    logprobs: jax.Array  # [B,G] f32 under the sampling distribution, 0 where mask is False
    mask: jax.Array  # [B,G] bool: generated (not padding)
    lengths: jax.Array  # [B] number of generated tokens
    finished: jax.Array  # [B] bool: ended by EOS or a stop sequence (not by max_new_tokens)


def process_logits(logits: jax.Array, cfg: SamplingConfig, temperature=None) -> jax.Array:
    """Apply temperature / top-k / top-p: [B,V] -> log-probs [B,V] of the sampling distribution.
    `temperature` (a traced scalar is fine) overrides cfg.temperature; it must be > 0 here."""
    t = cfg.temperature if temperature is None else temperature
    logits = logits.astype(jnp.float32) / t
    if cfg.top_k:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_l = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_l, axis=-1)
        cum = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        cutoff = jnp.min(jnp.where(cum < cfg.top_p, sorted_l, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def _sample(logits, rng, cfg: SamplingConfig, temperature):
    """temperature: traced f32 scalar; 0 -> greedy (argmax, log-prob reported as 0)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = process_logits(logits, cfg, jnp.maximum(temperature, 1e-6))
    drawn = jax.random.categorical(rng, logp, axis=-1).astype(jnp.int32)
    is_greedy = temperature <= 0
    tok = jnp.where(is_greedy, greedy, drawn)
    lp = jnp.where(is_greedy, 0.0, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0])
    return tok, lp


def _hits_stop(buf, t, cfg: SamplingConfig):
    """Whether the tokens ending at step t (inclusive) match a stop sequence: [B] bool."""
    hit = jnp.zeros(buf.shape[0], bool)
    for seq in cfg.stop_sequences:
        n = len(seq)
        start = t - n + 1
        win = jax.lax.dynamic_slice_in_dim(buf, jnp.maximum(start, 0), n, axis=1)
        hit = hit | ((start >= 0) & jnp.all(win == jnp.asarray(seq, jnp.int32), axis=1))
    return hit


# One compiled program per (model config, sampling config without its temperature): every
# Sampler of the same model shares it (the temperature is a traced argument), so greedy eval,
# sampled eval and RL rollouts of one batch shape compile once per process.
_PROGRAMS: dict = {}


def _program(model: Model, cfg: SamplingConfig):
    key = (model.cfg, dataclasses.replace(cfg, temperature=1.0))
    fn = _PROGRAMS.get(key)
    if fn is None:
        fn = _PROGRAMS[key] = jax.jit(functools.partial(_generate_impl, model, key[1]))
    return fn


class Sampler:
    def __init__(self, model: Model, cfg: SamplingConfig):
        self.model, self.cfg = model, cfg
        self._generate = _program(model, cfg)

    def generate(self, variables, prompts, prompt_lengths, rng) -> SampleOutput:
        """prompts [B,P] int32 right-padded, prompt_lengths [B] (>= 1)."""
        prompts = jnp.asarray(prompts, jnp.int32)
        lengths = jnp.asarray(prompt_lengths, jnp.int32)
        if prompts.ndim != 2 or lengths.shape != prompts.shape[:1]:
            raise ValueError(f"prompts must be [B,P] and prompt_lengths [B]; got {prompts.shape}, "
                             f"{lengths.shape}")
        if int(jnp.min(lengths)) < 1:
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        need = prompts.shape[1] + self.cfg.max_new_tokens
        if need > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt width {prompts.shape[1]} + max_new_tokens "
                             f"{self.cfg.max_new_tokens} exceeds model max_seq_len "
                             f"{self.model.cfg.max_seq_len}")
        return self._generate(variables, prompts, lengths, rng,
                              jnp.float32(self.cfg.temperature))


def _generate_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths, rng,
                   temperature):
    B, P = prompts.shape
    G = cfg.max_new_tokens
    cache = model.init_cache(B, P + G)
    logits, cache, _ = model.prefill(variables, prompts, lengths, cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B,V]
    rng, sub = jax.random.split(rng)
    tok, lp = _sample(last, sub, cfg, temperature)
    buf = jnp.zeros((B, G), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, G), jnp.float32).at[:, 0].set(lp)
    done = (tok == cfg.eos_id) | _hits_stop(buf, 0, cfg)
    n_gen = jnp.ones((B,), jnp.int32)

    def cond(carry):
        t, _, _, _, _, done, _, _ = carry
        return (t < G) & ~jnp.all(done)

    def body(carry):
        t, tok, buf, lps, cache, done, n_gen, rng = carry
        active = ~done
        logits, cache, _ = model.decode_step(variables, tok, cache, active)
        rng, sub = jax.random.split(rng)
        nxt, lp = _sample(logits, sub, cfg, temperature)
        nxt = jnp.where(active, nxt, 0)
        buf = buf.at[:, t].set(nxt)
        lps = lps.at[:, t].set(jnp.where(active, lp, 0.0))
        n_gen = n_gen + active.astype(jnp.int32)
        done = done | (active & ((nxt == cfg.eos_id) | _hits_stop(buf, t, cfg)))
        return t + 1, nxt, buf, lps, cache, done, n_gen, rng

    carry = (jnp.int32(1), tok, buf, lps, cache, done, n_gen, rng)
    _, _, buf, lps, _, done, n_gen, _ = jax.lax.while_loop(cond, body, carry)
    mask = jnp.arange(G)[None] < n_gen[:, None]
    return SampleOutput(tokens=jnp.where(mask, buf, 0), logprobs=jnp.where(mask, lps, 0.0),
                        mask=mask, lengths=n_gen, finished=done)


def pack(prompts, prompt_lengths, completions, completion_mask, width: int | None = None,
         pad_id: int = 0, extras: tuple = ()):
    """Host-side: rows = prompt[:p] + completion[:c] + padding (numpy).

    Returns (tokens [N,L] int32, loss_mask [N,L] bool: True on completion tokens, i.e. on the
    positions of the targets, *extras placed like the completions ([N,L] f32, e.g. the sampler's
    log-probs)), L = width or the longest row. Raises if a row does not fit the width.
    """
    prompts, completions = np.asarray(prompts), np.asarray(completions)
    pl = np.asarray(prompt_lengths)
    cl = np.asarray(completion_mask).sum(axis=1)
    L = int((pl + cl).max()) if width is None else width
    if (pl + cl).max() > L:
        raise ValueError(f"a packed row needs {(pl + cl).max()} tokens but width is {L}")
    N = prompts.shape[0]
    tokens = np.full((N, L), pad_id, np.int32)
    mask = np.zeros((N, L), bool)
    placed = [np.zeros((N, L), np.float32) for _ in extras]
    extras = [np.asarray(e) for e in extras]
    for i in range(N):
        p, c = pl[i], cl[i]
        tokens[i, :p] = prompts[i, :p]
        tokens[i, p:p + c] = completions[i, :c]
        mask[i, p:p + c] = True
        for dst, src in zip(placed, extras):
            dst[i, p:p + c] = src[i, :c]
    return (tokens, mask, *placed)
