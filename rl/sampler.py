"""Generation: one jit-compiled prefill + decode loop over the model's explicit cache.

    sampler = Sampler(model, SamplingConfig(max_new_tokens=64, temperature=1.0))
    out = sampler.generate(variables, prompts, prompt_lengths, rng)   # right-padded prompts
    out.tokens [B,G], out.logprobs [B,G] (under the sampling distribution), out.mask [B,G]

The cache is created inside the compiled function and carried through a `lax.while_loop`, so XLA
updates it in place (no copy per step); the loop stops when every row has finished (EOS, a stop
sequence, or max_new_tokens). Rows of different prompt lengths run together: each row decodes
from its own position. Reproducible: the same rng and inputs give the same tokens. `SamplingConfig(prefill_chunk=N)`
prefills long prompts N tokens at a time through the cache (`Model.prefill`'s chunk; same output).

Sampling transforms, in order: temperature (0 = greedy), top-k, top-p (nucleus). The returned
log-probs are those of the distribution actually sampled from (after the transforms); the
trainer's log-probs of the same tokens come from one teacher-forced forward
(`rl.train_step.make_logp_fn`), and the
gap between them is the sampler/trainer mismatch that TIS corrects.

Also here: `pack` (prompt + completion rows for the trainer). Trainer-side log-probs of packed rows:
`rl.train_step.make_logp_fn`.
MTP self-speculative decoding (`SamplingConfig(speculative="mtp")`): the first MTP module drafts
one token, one trunk pass verifies two; greedy output equals the plain sampler's token for token,
sampled output has its distribution (rl/speculative.py). On a 2-core CPU with the
demo model it is slower than plain decoding (measured by `scripts/bench.py spec`; numbers in the
README). Not covered: drafts longer than one token (chaining deeper MTP modules) and
tree drafts.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd
from model.transformer import Model

SPECULATIVE = ("none", "mtp")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off
    eos_id: int = 2
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences that end a row
    speculative: str = "none"  # "mtp": draft with the MTP head, verify the drafts in one pass
    draft_tokens: int = 1  # speculative="mtp": tokens drafted per trunk pass (k; verify k + 1)
    # prompt tokens per prefill call through the cache (Model.prefill's chunk); 0 = one shot.
    # Long prompts: attention temporaries grow with prefill_chunk x prompt, not prompt squared.
    prefill_chunk: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if (isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int)
                or self.prefill_chunk < 0):
            raise ValueError(f"prefill_chunk must be an int >= 0 (0 = the whole prompt in one "
                             f"prefill call, N = N tokens per call), got {self.prefill_chunk!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {sorted(SPECULATIVE)}, got "
                             f"{self.speculative!r}")


@flax.struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B,G] generated ids (EOS included when sampled; pad after)
    logprobs: jax.Array  # [B,G] f32 under the sampling distribution, 0 where mask is False
    mask: jax.Array  # [B,G] bool: generated (not padding)
    lengths: jax.Array  # [B] number of generated tokens
    finished: jax.Array  # [B] bool: ended by EOS or a stop sequence (not by max_new_tokens)
    # speculative="mtp": [drafts verified, drafts accepted] summed over rows (None otherwise)
    draft_stats: jax.Array | None = None


def truncation_mask(z: jax.Array, top_k: int = 0, top_p: float = 1.0,
                    include: jax.Array | None = None) -> jax.Array:
    """Which tokens survive top-k then top-p (nucleus) truncation: z [...,V] temperature-scaled
    logits -> [...,V] bool. Ties at a cut-off are kept. include [...] (token ids), when given, is
    always kept: the trainer scores the sampled token even where its own logits would have cut
    it (see `sampled_logprobs`). All-true when top_k == 0 and top_p == 1."""
    keep = jnp.ones(z.shape, bool)
    if top_k:
        kth = jax.lax.top_k(z, top_k)[0][..., -1:]
        keep = z >= kth
    if top_p < 1.0:
        zk = jnp.where(keep, z, -jnp.inf)
        sorted_l = jnp.flip(jnp.sort(zk, axis=-1), axis=-1)  # descending
        probs = jax.nn.softmax(sorted_l, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
        cutoff = jnp.min(jnp.where(before < top_p, sorted_l, jnp.inf), axis=-1, keepdims=True)
        keep = keep & (z >= cutoff)
    if include is not None:
        keep = keep | (jnp.arange(z.shape[-1]) == include[..., None])
    return jax.lax.stop_gradient(keep)


def process_logits(logits: jax.Array, cfg: SamplingConfig, temperature=None) -> jax.Array:
    """Apply temperature, then top-k, then top-p: [...,V] -> log-probs [...,V] of the sampling
    distribution (-inf outside it). `temperature` (a traced scalar is fine) overrides
    cfg.temperature; it must be > 0 here."""
    t = cfg.temperature if temperature is None else temperature
    z = logits.astype(jnp.float32) / t
    keep = truncation_mask(z, cfg.top_k, cfg.top_p)
    return jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)


def sampled_logprobs(logits: jax.Array, targets: jax.Array, cfg: SamplingConfig | None,
                     ) -> tuple[jax.Array, jax.Array]:
    """Trainer-side log-probs of `targets` under the distribution the sampler draws from.

    logits [N,L,V], targets [N,L] -> (logp [N,L] f32, processed log-probs [N,L,V]). cfg None or
    temperature 1 without truncation: plain log_softmax. Otherwise the logits are divided by
    cfg.temperature and truncated by cfg.top_k / cfg.top_p exactly as `process_logits` does, so
    at the sampler's parameters the values equal the sampler's (tests/rl/test_objective.py).
    The truncation set is recomputed from these logits and always contains the target: after
    an update moves a sampled token outside the set, it keeps a finite log-prob (its ratio then
    falls and the clip stops its gradient) instead of -inf, which would make ratios and KL
    estimates NaN. Gradients flow through the kept logits; set membership is a constant.
    """
    z = logits.astype(jnp.float32)
    if cfg is not None and cfg.temperature <= 0:
        raise ValueError("log-probs of a greedy sampler (temperature 0) are undefined: RL needs "
                         "a sampling temperature > 0 (rl.temperature)")
    if cfg is not None and cfg.temperature != 1.0:
        z = z / cfg.temperature
    if cfg is not None and (cfg.top_k or cfg.top_p < 1.0):
        keep = truncation_mask(z, cfg.top_k, cfg.top_p, include=targets)
        z = jnp.where(keep, z, -jnp.inf)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    return logp, logp_all


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
    """Whether the tokens ending at step t (inclusive; a scalar or one per row [B]) match a stop
    sequence: [B] bool."""
    hit = jnp.zeros(buf.shape[0], bool)
    t = jnp.broadcast_to(t, buf.shape[:1])
    for seq in cfg.stop_sequences:
        n = len(seq)
        start = t - n + 1
        win = jax.vmap(lambda row, s, n=n: jax.lax.dynamic_slice_in_dim(row, s, n))(
            buf, jnp.maximum(start, 0))
        hit = hit | ((start >= 0) & jnp.all(win == jnp.asarray(seq, jnp.int32), axis=1))
    return hit


# One compiled program per (model config, sampling config without its temperature, mesh): every
# Sampler of the same model shares it (the temperature is a traced argument), so greedy eval,
# sampled eval and RL rollouts of one batch shape compile once per process.
_PROGRAMS: dict = {}


def _mesh_key(mesh, rules):
    if mesh is None:
        return None
    return mesh, tuple(sorted(shd._rules(rules).items()))


def _program(model: Model, cfg: SamplingConfig, mesh=None, rules=None):
    key = (model.cfg, dataclasses.replace(cfg, temperature=1.0), _mesh_key(mesh, rules))
    fn = _PROGRAMS.get(key)
    if fn is None:
        if cfg.speculative == "mtp":
            from rl.speculative import generate_speculative_impl as impl
        else:
            impl = _generate_impl
        fn = functools.partial(impl, model, key[1])
        fn = _PROGRAMS[key] = (jax.jit(fn) if mesh is None else
                               _mesh_program(fn, model, mesh, rules, cfg.speculative == "mtp"))
    return fn


def _mesh_program(impl, model: Model, mesh, rules, speculative: bool):
    """The sampler on a mesh (model.sharding.MeshJit): parameters with the model's shardings,
    prompts/lengths and every output row over the batch axes, the decode caches constrained
    likewise inside (`model.sharding.constrain_cache`), the rng key (as raw key data) and the
    temperature replicated. One program per batch shape."""
    var_sh = shd.model_shardings(model, mesh, rules)
    rep = shd.replicated(mesh)

    def run(variables, prompts, lengths, key_data, temperature, *, typed):
        rng = jax.random.wrap_key_data(key_data) if typed else key_data
        return impl(variables, prompts, lengths, rng, temperature)

    def ins(variables, prompts, *_):
        b = shd.batch_sharding(mesh, prompts.shape[0], rules)
        return shd.variables_shardings(var_sh, variables, mesh), b, b, rep, rep

    def outs(variables, prompts, *_):
        b = shd.batch_sharding(mesh, prompts.shape[0], rules)
        return SampleOutput(tokens=b, logprobs=b, mask=b, lengths=b, finished=b,
                            draft_stats=rep if speculative else None)

    progs = {t: shd.MeshJit(functools.partial(run, typed=t), mesh, rules, in_shardings=ins,
                            out_shardings=outs, name="sampler") for t in (True, False)}

    def call(variables, prompts, lengths, rng, temperature):
        typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        data = np.asarray(jax.random.key_data(rng) if typed else rng)
        data = jax.make_array_from_callback(data.shape, rep, lambda i: data[i])
        temp = jax.make_array_from_callback((), rep, lambda i: np.float32(temperature))
        return progs[typed](variables, prompts, lengths, data, temp)

    return call


class Sampler:
    """Generation with one compiled program per batch shape (see the module docstring).

    mesh/rules (model.sharding.mesh_from_config): the program runs on the mesh: variables are
    the (sharded) train-state variables, each process passes ITS rows of the global batch
    (prompts [b,P] numpy; the global batch is every process's rows, model.sharding.to_global)
    and gets global jax.Arrays back (this process's rows: model.sharding.host_rows)."""

    def __init__(self, model: Model, cfg: SamplingConfig, *, mesh=None, rules=None):
        if cfg.speculative == "mtp" and not model.cfg.mtp.depth:
            raise ValueError("speculative='mtp' needs a model with an MTP module (mtp.depth >= 1)")
        self.model, self.cfg = model, cfg
        self.mesh, self.rules = mesh, rules
        self._generate = _program(model, cfg, mesh, rules)

    def generate(self, variables, prompts, prompt_lengths, rng) -> SampleOutput:
        """prompts [B,P] int32 right-padded, prompt_lengths [B] (>= 1). On a mesh: this
        process's rows of the global batch."""
        prompts = np.asarray(prompts, np.int32)
        lengths = np.asarray(prompt_lengths, np.int32)
        if prompts.ndim != 2 or lengths.shape != prompts.shape[:1]:
            raise ValueError(f"prompts must be [B,P] and prompt_lengths [B]; got {prompts.shape}, "
                             f"{lengths.shape}")
        if int(np.min(lengths)) < 1:
            raise ValueError("every prompt needs at least one token (e.g. BOS)")
        need = prompts.shape[1] + self.cfg.max_new_tokens
        if need > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt width {prompts.shape[1]} + max_new_tokens "
                             f"{self.cfg.max_new_tokens} exceeds model max_seq_len "
                             f"{self.model.cfg.max_seq_len}")
        if self.mesh is not None:
            prompts, lengths = shd.to_global((prompts, lengths), self.mesh, self.rules)
        return self._generate(variables, prompts, lengths, rng,
                              np.float32(self.cfg.temperature))


def _generate_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths, rng,
                   temperature):
    B, P = prompts.shape
    G = cfg.max_new_tokens
    cache = shd.constrain_cache(model.init_cache(B, P + G))  # no-op without a mesh
    logits, cache, _ = model.prefill(variables, prompts, lengths, cache, chunk=cfg.prefill_chunk)
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
