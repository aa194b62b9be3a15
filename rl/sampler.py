"""Generation: one jit-compiled prefill + decode loop over the model's explicit cache.

    sampler = Sampler(model, SamplingConfig(max_new_tokens=64, temperature=1.0))
    out = sampler.generate(variables, prompts, prompt_lengths, rng)   # right-padded prompts
    out.tokens [B,G], out.logprobs [B,G] (under the sampling distribution), out.mask [B,G]

The cache is created inside the compiled function and carried through a `lax.while_loop`, so XLA
updates it in place (no copy per step); the loop stops when every row has finished (EOS, a stop
sequence, or max_new_tokens). Rows of different prompt lengths run together: each row decodes
from its own position. Reproducible: the same rng and inputs give the same tokens; each row's
draws come from the call's rng folded with the row's id (`row_ids`, default its index in the
global batch) and each token's position (`categorical_rows`), so a row's tokens do not depend on
the rows beside it. `SamplingConfig(prefill_chunk=N)`
prefills long prompts N tokens at a time through the cache (`Model.prefill`'s chunk; same output).

Sampling transforms, in order: temperature (0 = greedy), top-k, top-p (nucleus). The returned
log-probs are those of the distribution actually sampled from (after the transforms); the
trainer's log-probs of the same tokens come from one teacher-forced forward
(`rl.train_step.make_logp_fn`), and the
gap between them is the sampler/trainer mismatch that TIS corrects.

Prefix sharing (`generate(..., group_size=G)`): rows come in groups of G copies of one prompt
(GRPO groups, several eval samples per task; checked on the host); each distinct prompt is
prefilled once and its cache (every leaf of `Model.init_cache`: KDA state and conv window, DSA
latent and indexer keys, lengths) repeated to its G rows, then decoding runs as above, with the
same random draws (the same tokens). Row refill (`generate(..., slots=R)`, R < B): the distinct prompts are
prefilled once into a bank, every row's first token is drawn from its prompt's last logits, and
R slots decode; when a slot's row ends, the next queued row takes the slot (its prompt's bank
cache and first token) inside the same compiled while_loop. Outputs stay indexed like the input
rows, with `finish_order` / `finish_step` giving the completion order. The output of both
equals the plain sampler's token for token, greedy or sampled (tests/rl/test_sampler_fast.py;
up to float differences in the logits between batch shapes); measured by
`benchmarks/rollouts.py`. Continuing from a cache (`new_cache`, then `extend(variables, cache,
tokens, lengths, rng)` per call): each row's new tokens are prefilled at its cache position and
decoding runs as above; the cache comes back for the next call (multi-turn episodes,
rl/agent.py: a turn prefills its last sampled token and the observation, not the whole
context; on a mesh the cache is laid out over it, `shd.cache_shardings`). On a mesh, sharing
needs the distinct prompts to split over the same batch axes as the rows (otherwise every row
is prefilled, logged once); refill too, and with several processes each passes its share of
the rows and of the slots (the program refills over the global batch). `prefill_groups` is the
shared prefill for other decoders. Not covered: either with speculative="mtp" (sharing falls
back to prefilling every row, logged once; refill raises), sharing a common prefix of different
prompts.

Also here: `pack` (prompt + completion rows for the trainer). Trainer-side log-probs of packed rows:
`rl.train_step.make_logp_fn`.
MTP self-speculative decoding (`SamplingConfig(speculative="mtp", draft_tokens=k)`,
rl/speculative.py): the first MTP module drafts k tokens, one trunk pass verifies k + 1; greedy
output equals the plain sampler's token for token, sampled output has its distribution. On a
2-core CPU with the demo model it is slower than plain decoding at every k (measured by
`scripts/bench.py spec`; numbers in docs/speed.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from model import sharding as shd
from model.transformer import Model, unstack_layers
from rl.draws import (  # noqa: F401  (re-exported: rl.sampler is where users import them)
    SPECULATIVE,
    SampleOutput,
    SamplingConfig,
    argmax_last,
    categorical_last,
    categorical_rows,
    hits_stop,
    process_logits,
    row_keys,
    sample_tokens,
    sampled_logprobs,
    truncation_mask,
)
from rl.speculative import generate_speculative_impl

_LOG = logging.getLogger(__name__)
_LOGGED: set = set()  # messages already logged (each once per process)


def _log_once(msg: str):
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        _LOG.warning(msg)



# One compiled program per (model config, sampling config without its temperature, mesh, mode):
# every Sampler of the same model shares it (the temperature is a traced argument), so greedy
# eval, sampled eval and RL rollouts of one batch shape compile once per process. mode:
# ("plain",), ("shared", G) (prefix sharing) or ("refill", G, R) (row refill into R slots).
_PROGRAMS: dict = {}
_NEW_CACHES: dict = {}  # (model config, rows, positions, mesh) -> jitted empty cache on the mesh
PLAIN = ("plain",)


def _program(model: Model, cfg: SamplingConfig, mesh=None, rules=None, mode: tuple = PLAIN):
    key = (model.cfg, dataclasses.replace(cfg, temperature=1.0), shd.mesh_key(mesh, rules), mode)
    fn = _PROGRAMS.get(key)
    if fn is None:
        if mode[0] == "extend":  # (variables, cache, tokens, lengths, rng, temperature, ids)
            impl = _per_layer(_extend_impl, model, key[1])
            fn = _PROGRAMS[key] = (jax.jit(impl, donate_argnums=(1,)) if mesh is None else
                                   _mesh_extend_program(impl, model, mesh, rules))
            return fn
        if cfg.speculative == "mtp":
            def impl(model, cfg, variables, prompts, lengths, rng, temperature, row_ids):
                del row_ids  # its draws are per step of the batch (rl/speculative.py)
                return generate_speculative_impl(model, cfg, variables, prompts, lengths, rng,
                                                 temperature)
        elif mode[0] == "refill":
            impl = functools.partial(_refill_impl, group=mode[1], slots=mode[2])
        else:
            impl = functools.partial(_generate_impl, group=mode[1] if mode[0] == "shared" else 1)
        fn = _per_layer(impl, model, key[1])
        group = 1 if mode == PLAIN else mode[1]
        fn = _PROGRAMS[key] = (jax.jit(fn) if mesh is None else
                               _mesh_program(fn, model, mesh, rules, cfg.speculative == "mtp",
                                             group=group, refill=mode[0] == "refill"))
    return fn


def _per_layer(impl, model: Model, cfg: SamplingConfig):
    """impl(model, cfg, variables, ...) as a function of (variables, ...). A model with scanned
    layer groups (model.scan_layers) samples through its per-layer twin: its stacked variables
    are unstacked once per call, outside the decode loop (model.transformer.unstack_layers), so
    that no step slices the stacked weights again (measured: decode 10% slower with the slices
    inside the loop, 16 layers on CPU)."""
    if not model.cfg.scan_layers:
        return functools.partial(impl, model, cfg)
    flat = Model(model.cfg.replace(scan_layers=False))

    def run(variables, *args):
        return impl(flat, cfg, unstack_layers(model.cfg, variables), *args)
    return run


def _mesh_program(impl, model: Model, mesh, rules, speculative: bool, group: int = 1,
                  refill: bool = False):
    """The sampler on a mesh (model.sharding.MeshJit): parameters with the model's shardings,
    prompts/lengths and every output row over the batch axes, the decode caches constrained
    likewise inside (`model.sharding.constrain_cache`), the rng key (as raw key data) and the
    temperature replicated. One program per batch shape. group > 1 (prefix sharing, row
    refill): the program takes the distinct prompts [U,P] and returns U * group rows."""
    var_sh = shd.model_shardings(model, mesh, rules)
    rep = shd.replicated(mesh)

    def run(variables, prompts, lengths, key_data, temperature, row_ids, *, typed):
        rng = jax.random.wrap_key_data(key_data) if typed else key_data
        return impl(variables, prompts, lengths, rng, temperature, row_ids)

    def ins(variables, prompts, *_):
        b = shd.batch_sharding(mesh, prompts.shape[0], rules)
        rows = shd.batch_sharding(mesh, prompts.shape[0] * group, rules)
        return shd.variables_shardings(var_sh, variables, mesh), b, b, rep, rep, rows

    def outs(variables, prompts, *_):
        b = shd.batch_sharding(mesh, prompts.shape[0] * group, rules)
        return SampleOutput(tokens=b, logprobs=b, mask=b, lengths=b, finished=b,
                            draft_stats=rep if speculative else None,
                            finish_order=b if refill else None,
                            finish_step=b if refill else None)

    progs = {t: shd.MeshJit(functools.partial(run, typed=t), mesh, rules, in_shardings=ins,
                            out_shardings=outs, name="sampler") for t in (True, False)}

    def call(variables, prompts, lengths, rng, temperature, row_ids):
        typed, data, temp = _replicated_draw_args(rng, temperature, rep)
        return progs[typed](variables, prompts, lengths, data, temp, row_ids)

    return call


def _replicated_draw_args(rng, temperature, rep):
    """(whether rng is a typed key, its key data and the temperature as arrays replicated with
    `rep`): a mesh program's random key and temperature, the same on every device."""
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(rng) if typed else rng)
    data = jax.make_array_from_callback(data.shape, rep, lambda i: data[i])
    temp = jax.make_array_from_callback((), rep, lambda i: np.float32(temperature))
    return typed, data, temp


def _mesh_extend_program(impl, model: Model, mesh, rules):
    """`Sampler.extend` on a mesh (model.sharding.MeshJit): parameters with the model's
    shardings, the decode cache in and out with its `cache_shardings` (rows over the batch axes,
    KDA state heads over tensor; donated), the new tokens, their lengths and every output row
    over the batch axes, the rng key and temperature replicated. One program per (rows,
    new-token width, cache size)."""
    var_sh = shd.model_shardings(model, mesh, rules)
    rep = shd.replicated(mesh)

    def run(variables, cache, tokens, lengths, key_data, temperature, row_ids, *, typed):
        rng = jax.random.wrap_key_data(key_data) if typed else key_data
        return impl(variables, cache, tokens, lengths, rng, temperature, row_ids)

    def ins(variables, cache, tokens, *_):
        b = shd.batch_sharding(mesh, tokens.shape[0], rules)
        return (shd.variables_shardings(var_sh, variables, mesh),
                shd.cache_shardings(cache, mesh, rules), b, b, rep, rep, b)

    def outs(variables, cache, tokens, *_):
        b = shd.batch_sharding(mesh, tokens.shape[0], rules)
        return (SampleOutput(tokens=b, logprobs=b, mask=b, lengths=b, finished=b),
                shd.cache_shardings(cache, mesh, rules))

    progs = {t: shd.MeshJit(functools.partial(run, typed=t), mesh, rules, in_shardings=ins,
                            out_shardings=outs, donate_argnums=(1,), name="sampler-extend")
             for t in (True, False)}

    def call(variables, cache, tokens, lengths, rng, temperature, row_ids):
        typed, data, temp = _replicated_draw_args(rng, temperature, rep)
        return progs[typed](variables, cache, tokens, lengths, data, temp, row_ids)

    return call


def distinct_prompts(prompts: np.ndarray, lengths: np.ndarray, group_size: int):
    """Host-side: the first row of each group of group_size consecutive rows, after checking
    that the rows of a group are the same prompt (same length, same tokens up to it; padding
    past the length is not compared). prompts [B,P], lengths [B] -> ([B/G,P], [B/G])."""
    B, P = prompts.shape
    if B % group_size:
        raise ValueError(f"group_size={group_size} does not divide the batch of {B} rows: "
                         "pass rows as whole groups of group_size copies of each prompt")
    g = prompts.reshape(B // group_size, group_size, P)
    gl = lengths.reshape(B // group_size, group_size)
    valid = np.arange(P)[None, None] < gl[..., None]
    same = np.all(gl == gl[:, :1], axis=1) & np.all((g == g[:, :1]) | ~valid, axis=(1, 2))
    if not same.all():
        bad = int(np.argmin(same))
        raise ValueError(f"group_size={group_size}: rows {bad * group_size}.."
                         f"{(bad + 1) * group_size - 1} are not copies of one prompt (prefix "
                         "sharing prefills each group's prompt once); pass each prompt's "
                         "group_size rows next to each other, or group_size=1")
    return np.ascontiguousarray(g[:, 0]), np.ascontiguousarray(gl[:, 0])


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

    def _mode(self, n_rows: int, group_size: int, slots: int) -> tuple:
        """The program for a batch of n_rows (this process's rows) in groups of group_size."""
        if slots and self.cfg.speculative == "mtp":
            raise ValueError("row refill (slots > 0) is not implemented for speculative "
                             "decoding: use slots=0 with speculative='mtp'")
        if slots and slots < n_rows:
            if self.mesh is not None and not (self._same_layout(n_rows // group_size, n_rows)
                                              and self._same_layout(slots, n_rows)):
                raise ValueError(
                    f"row refill on mesh {dict(self.mesh.shape)}: the {n_rows // group_size} "
                    f"distinct prompts, the {slots} slots and the {n_rows} rows must split over "
                    "the same batch axes: choose slots and prompts divisible by the data axes")
            # the program's slots are the global batch's (every process's share)
            return ("refill", group_size, self._global_rows(slots))
        if group_size == 1:
            return PLAIN
        if self.cfg.speculative == "mtp":
            _log_once("rl.sampler: prefix sharing is not implemented for speculative decoding; "
                      "prefilling every row")
            return PLAIN
        if self.mesh is not None and not self._same_layout(n_rows // group_size, n_rows):
            _log_once(f"rl.sampler: {n_rows // group_size} distinct prompts do not split over "
                      f"the batch axes of mesh {dict(self.mesh.shape)} like the {n_rows} rows; "
                      "prefilling every row (no prefix sharing)")
            return PLAIN
        return ("shared", group_size)

    def _same_layout(self, n_prompts: int, n_rows: int) -> bool:
        """Whether this process's n_prompts distinct prompts and its n_rows rows map onto the
        mesh alike: the same batch axes, and (several processes) the same share per process,
        so that prompt u's rows stay with the devices that prefill it."""
        try:
            gp = shd.global_rows(n_prompts, self.mesh, self.rules)
            gr = shd.global_rows(n_rows, self.mesh, self.rules)
        except ValueError:
            return False
        return (gp * n_rows == gr * n_prompts and shd.batch_axes(self.mesh, gp, self.rules)
                == shd.batch_axes(self.mesh, gr, self.rules))

    def generate(self, variables, prompts, prompt_lengths, rng, *, group_size: int = 1,
                 slots: int = 0, row_ids=None) -> SampleOutput:
        """prompts [B,P] int32 right-padded, prompt_lengths [B] (>= 1). On a mesh: this
        process's rows of the global batch.

        group_size G > 1 (prefix sharing): rows come in groups of G consecutive copies of one
        prompt (checked: ValueError otherwise); each distinct prompt is prefilled once and its
        cache copied to its G rows. Same outputs as G = 1 (the same draws from the same rng),
        up to float differences between prefill batch shapes.
        slots R (row refill; 0 or >= B = every row at once): R rows decode at a time; when one
        finishes, the next queued row starts in its slot from its prompt's prefilled cache
        (each distinct prompt prefilled once into a bank). Outputs are indexed like the input
        rows, with finish_order / finish_step (completion order).
        row_ids [B] int (default: each row's index in the global batch): a sampled row's draws
        come from rng folded with its id and the position of each token (`categorical_rows`),
        so the same (rng, id, prompt) gives the same tokens with or without sharing and
        refill, in any batch and on any process layout (up to float differences in the
        logits between batch shapes). Rows with equal ids and prompts draw alike."""
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
        for name, v in (("group_size", group_size), ("slots", slots)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (name == "group_size"):
                raise ValueError(f"{name} must be an int >= {int(name == 'group_size')}, got {v!r}")
        ids = check_row_ids(row_ids, prompts.shape[0])
        if group_size > 1 or slots:
            prompts_u, lengths_u = distinct_prompts(prompts, lengths, group_size)
        mode = self._mode(prompts.shape[0], group_size, slots)
        fn = self._generate
        if mode != PLAIN:
            prompts, lengths = prompts_u, lengths_u
            fn = _program(self.model, self.cfg, self.mesh, self.rules, mode)
        if self.mesh is not None:
            prompts, lengths, ids = shd.to_global((prompts, lengths, ids), self.mesh, self.rules)
        return fn(variables, prompts, lengths, rng, np.float32(self.cfg.temperature), ids)

    def _check_extend(self):
        if self.cfg.speculative != "none":
            raise ValueError("Sampler.extend runs without speculative decoding: use generate "
                             "(every call prefills its prompts)")

    def _global_rows(self, n: int) -> int:
        return n if self.mesh is None else shd.global_rows(n, self.mesh, self.rules)

    def new_cache(self, batch: int, max_len: int):
        """An empty decode cache of `batch` rows (on a mesh: this process's rows of the global
        batch) and `max_len` positions for `extend`; on a mesh a global cache laid out as the
        mesh's extend program takes it (shd.cache_shardings), made by one jitted program per
        shape (every process runs it)."""
        self._check_extend()
        if self.mesh is None:
            return self.model.init_cache(batch, max_len)
        n = self._global_rows(batch)
        key = (self.model.cfg, n, max_len, shd.mesh_key(self.mesh, self.rules))
        fn = _NEW_CACHES.get(key)
        if fn is None:
            def make(model=self.model):
                return model.init_cache(n, max_len)
            sh = shd.cache_shardings(jax.eval_shape(make), self.mesh, self.rules)
            fn = _NEW_CACHES[key] = jax.jit(make, out_shardings=sh)
        return fn()

    def extend(self, variables, cache, tokens, lengths, rng, row_ids=None):
        """Continue rows from a decode cache (multi-turn episodes: the next turn's context is the
        cached one plus a few new tokens). tokens [B,M] right-padded: each row's tokens that the
        cache does not hold yet (the last sampled token, an observation); lengths [B] how many
        (0: the row sits the call out, its cache is not advanced and it generates nothing).
        They are prefilled at each row's cache position (cache["lengths"]) and decoding runs as
        in `generate`. Returns (SampleOutput, cache); the passed cache is donated (do not reuse
        it). Room: every row's position + M must fit the cache (every row's padded tokens are
        written past its position, where decoding or the next call overwrites them before any
        query attends them; a write that does not fit lands inside the row's history), and a
        generating row's position + its new tokens + max_new_tokens too. One compiled program
        per (B, M, cache size). Greedy output equals `generate` on the whole context up to
        float reassociation (tests/rl/test_agent.py), and so does sampled output for the same
        rng and row_ids (draws by row id and token position, as `generate`). On a mesh: tokens,
        lengths and row_ids are this process's rows, the cache and the outputs global (as
        `generate`); with several processes every process calls with the same M and cache size
        (its rows may all sit out)."""
        self._check_extend()
        tokens = np.asarray(tokens, np.int32)
        lengths = np.asarray(lengths, np.int32)
        if (tokens.ndim != 2 or lengths.shape != tokens.shape[:1]
                or cache["lengths"].shape != (self._global_rows(len(lengths)),)):
            raise ValueError(f"tokens must be [B,M] and lengths [B] for a cache of "
                             f"{cache['lengths'].shape[0]} rows; got {tokens.shape}, "
                             f"{lengths.shape}")
        if lengths.min() < 0 or lengths.max() > tokens.shape[1]:
            raise ValueError(f"lengths must be in [0, {tokens.shape[1]}], got {lengths}")
        ids = check_row_ids(row_ids, tokens.shape[0])
        fn = _program(self.model, self.cfg, self.mesh, self.rules, mode=("extend",))
        if self.mesh is not None:
            tokens, lengths, ids = shd.to_global((tokens, lengths, ids), self.mesh, self.rules)
        else:
            cache = _commit_like(variables, cache)
        return fn(variables, cache, tokens, lengths, rng, np.float32(self.cfg.temperature), ids)


def _commit_like(variables, cache):
    """`cache` with its uncommitted leaves (a fresh `new_cache`: zeros on the default device)
    placed on the device `variables` are committed to (unchanged when they are not). jit keys
    its programs by their arguments' placement too: a fresh cache and the committed one an
    earlier call returned would otherwise compile the same extend program twice (docs/speed.md:
    030bfb4)."""
    leaf = jax.tree.leaves(variables)[0]
    if not getattr(leaf, "committed", False) or len(leaf.devices()) != 1:
        return cache
    (device,) = leaf.devices()
    return jax.tree.map(lambda x: x if getattr(x, "committed", True)
                        else jax.device_put(x, device), cache)


def check_row_ids(row_ids, n: int) -> np.ndarray:
    """Host-side [n] int32 row ids from `row_ids` (None: all -1, the row's index in the global
    batch, set in the program); anything but n non-negative ints is a ValueError."""
    if row_ids is None:
        return np.full((n,), -1, np.int32)
    ids = np.asarray(row_ids)
    if ids.shape != (n,) or not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"row_ids must be {n} non-negative ints (one per row), got "
                         f"{ids.shape} {ids.dtype}")
    return ids.astype(np.int32)


def repeat_rows(tree, group: int):
    """Each row of every leaf (leading dim = batch) repeated group times, consecutively."""
    return tree if group == 1 else jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), tree)


def prefill_groups(model: Model, cfg: SamplingConfig, variables, prompts, lengths, max_len: int,
                   group: int = 1):
    """Prefill each of U distinct prompts once and give each its group rows of decode cache.

    prompts [U,P] right-padded, lengths [U]. Returns (cache for U * group rows (row u * group + j
    is a copy of prompt u's; constrained to the mesh's cache layout under use_mesh), logits
    [U,P,V], hidden [U,P,D]) -- logits and hidden per distinct prompt (`repeat_rows` expands
    them). group 1: the plain sampler's prefill."""
    U, _ = prompts.shape
    cache = shd.constrain_cache(model.init_cache(U, max_len))  # no-op without a mesh
    logits, cache, hidden = model.prefill(variables, prompts, lengths, cache,
                                          chunk=cfg.prefill_chunk)
    if group > 1:
        cache = shd.constrain_cache(repeat_rows(cache, group))
    return cache, logits, hidden


def _last_logits(logits, lengths):
    """logits [B,T,V] at each row's last prompt position: [B,V]."""
    return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def _generate_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths, rng,
                   temperature, row_ids, *, group: int = 1):
    """prompts [U,P]: the distinct prompts (every row when group == 1); U * group rows out
    (row_ids [U * group]: `row_keys`)."""
    P = prompts.shape[1]
    cache, logits, _ = prefill_groups(model, cfg, variables, prompts, lengths,
                                      P + cfg.max_new_tokens, group)
    last = repeat_rows(_last_logits(logits, lengths), group)  # [B,V]
    keys = row_keys(rng, row_ids)
    return _decode(model, cfg, variables, cache, last, keys, temperature)[0]


def _extend_impl(model: Model, cfg: SamplingConfig, variables, cache, tokens, lengths, rng,
                 temperature, row_ids):
    """Continue rows from their cache: tokens [B,M] right-padded new tokens per row, lengths [B]
    how many (0: the row sits the call out: its cache is not advanced, nothing is generated).
    The new tokens are prefilled at each row's cache position, then decoding runs as in
    `_generate_impl`. Returns (SampleOutput, cache)."""
    logits, cache, _ = model.prefill(variables, tokens, lengths, cache, chunk=cfg.prefill_chunk)
    last = _last_logits(logits, jnp.maximum(lengths, 1))  # [B,V]
    keys = row_keys(rng, row_ids)
    return _decode(model, cfg, variables, cache, last, keys, temperature, skip=lengths == 0)


def _decode(model: Model, cfg: SamplingConfig, variables, cache, last, keys, temperature,
            skip=None):
    """The decode loop from a prefilled cache and each row's last logits [B,V]: the first token
    is drawn from `last`, then one decode step per token until every row is done; row b's
    draws come from keys[b] (`row_keys`) at the positions of its tokens (its cache length when
    the loop starts, + 1 per token). skip [B] bool: rows that generate nothing (done from the
    start, cache untouched). Returns (SampleOutput, cache)."""
    B = last.shape[0]
    G = cfg.max_new_tokens
    pos0 = cache["lengths"]  # [B] the position of each row's first new token
    tok, lp = sample_tokens(last, keys, pos0, cfg, temperature)
    buf = jnp.zeros((B, G), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, G), jnp.float32).at[:, 0].set(lp)
    done = (tok == cfg.eos_id) | hits_stop(buf, 0, cfg)
    n_gen = jnp.ones((B,), jnp.int32)
    if skip is not None:
        done, n_gen = done | skip, jnp.where(skip, 0, n_gen)

    def cond(carry):
        t, _, _, _, _, done, _ = carry
        return (t < G) & ~jnp.all(done)

    def body(carry):
        t, tok, buf, lps, cache, done, n_gen = carry
        active = ~done
        logits, cache, _ = model.decode_step(variables, tok, cache, active)
        nxt, lp = sample_tokens(logits, keys, pos0 + t, cfg, temperature)
        nxt = jnp.where(active, nxt, 0)
        buf = buf.at[:, t].set(nxt)
        lps = lps.at[:, t].set(jnp.where(active, lp, 0.0))
        n_gen = n_gen + active.astype(jnp.int32)
        done = done | (active & ((nxt == cfg.eos_id) | hits_stop(buf, t, cfg)))
        return t + 1, nxt, buf, lps, cache, done, n_gen

    carry = (jnp.int32(1), tok, buf, lps, cache, done, n_gen)
    _, _, buf, lps, cache, done, n_gen = jax.lax.while_loop(cond, body, carry)
    mask = jnp.arange(G)[None] < n_gen[:, None]
    finished = done if skip is None else done & ~skip
    return SampleOutput(tokens=jnp.where(mask, buf, 0), logprobs=jnp.where(mask, lps, 0.0),
                        mask=mask, lengths=n_gen, finished=finished), cache


def _refill_impl(model: Model, cfg: SamplingConfig, variables, prompts, lengths, rng,
                 temperature, row_ids, *, group: int, slots: int):
    """Row refill: N = U * group sequences (sequence i continues prompt i // group) through R =
    slots decode rows, all inside one while_loop of fixed shapes.

    The U distinct prompts are prefilled once into a bank ([U] rows of cache) and every
    sequence's first token is drawn from its prompt's last logits up front (the same draws as
    the plain sampler's first token). A slot holds one sequence; each step decodes the live
    slots, writes their tokens at the sequence's row of the [N,G] outputs, and a slot whose
    sequence ended (EOS, stop sequence, max_new_tokens) records it (length, finished, order,
    step) and takes the next queued sequence: its prompt's bank cache and its first token. The
    loop ends when every slot is idle. Each sequence draws from its own key (`row_keys`) at its
    tokens' positions, so its tokens are those the plain sampler gives its row."""
    U, P = prompts.shape
    G = cfg.max_new_tokens
    N, R = U * group, slots
    bank, logits, _ = prefill_groups(model, cfg, variables, prompts, lengths, P + G)  # [U] rows
    last = repeat_rows(_last_logits(logits, lengths), group)  # [N,V]
    keys = row_keys(rng, row_ids)  # [N]
    start = jnp.repeat(lengths, group)  # [N] each sequence's first new position
    tok0, lp0 = sample_tokens(last, keys, start, cfg, temperature)  # [N] first tokens
    buf = jnp.zeros((N, G), jnp.int32).at[:, 0].set(tok0)
    lps = jnp.zeros((N, G), jnp.float32).at[:, 0].set(lp0)
    hit0 = (tok0 == cfg.eos_id) | hits_stop(buf, 0, cfg)  # [N] ended by its first token
    done0 = hit0 | (G == 1)
    prompt_of = jnp.arange(N) // group  # [N]

    def load(sid):  # bank rows for sequences sid [R] (clipped into range)
        return jax.tree.map(lambda b: b[prompt_of[jnp.clip(sid, 0, N - 1)]], bank)

    sid = jnp.arange(R, dtype=jnp.int32)  # [R] sequence in each slot (-1: idle)
    cache = shd.constrain_cache(load(sid))
    carry = dict(step=jnp.int32(0), nxt=jnp.int32(R), count=jnp.int32(0), sid=sid,
                 tok=tok0[:R], n_gen=jnp.ones((R,), jnp.int32), sdone=done0[:R],
                 shit=hit0[:R], cache=cache, buf=buf, lps=lps,
                 lengths=jnp.zeros((N,), jnp.int32), finished=jnp.zeros((N,), bool),
                 order=jnp.full((N,), -1, jnp.int32), fstep=jnp.full((N,), -1, jnp.int32))

    def cond(c):
        return jnp.any(c["sid"] >= 0)

    def body(c):
        c = dict(c)
        live = c["sid"] >= 0
        active = live & ~c["sdone"]
        logits, cache, _ = model.decode_step(variables, c["tok"], c["cache"], active)
        seq = jnp.maximum(c["sid"], 0)
        nt, lp = sample_tokens(logits, keys[seq], start[seq] + c["n_gen"], cfg, temperature)
        row = jnp.where(active, c["sid"], N)  # N: out of range, the write is dropped
        buf = c["buf"].at[row, c["n_gen"]].set(nt, mode="drop")
        lps = c["lps"].at[row, c["n_gen"]].set(lp, mode="drop")
        n_gen = c["n_gen"] + active.astype(jnp.int32)
        hit = active & ((nt == cfg.eos_id)
                        | hits_stop(buf[jnp.maximum(c["sid"], 0)], n_gen - 1, cfg))
        shit = c["shit"] | hit
        sdone = c["sdone"] | hit | (active & (n_gen >= G))
        ended = live & sdone  # record, then refill or idle these slots
        rank = jnp.cumsum(ended.astype(jnp.int32)) - 1
        rec = jnp.where(ended, c["sid"], N)
        c["lengths"] = c["lengths"].at[rec].set(n_gen, mode="drop")
        c["finished"] = c["finished"].at[rec].set(shit, mode="drop")
        c["order"] = c["order"].at[rec].set(c["count"] + rank, mode="drop")
        c["fstep"] = c["fstep"].at[rec].set(c["step"], mode="drop")
        new = c["nxt"] + rank  # [R] the queued sequence an ended slot takes
        refill = ended & (new < N)
        newc = jnp.clip(new, 0, N - 1)
        cache = jax.lax.cond(
            jnp.any(refill),
            lambda cc: jax.tree.map(
                lambda b, x: jnp.where(refill.reshape((R,) + (1,) * (x.ndim - 1)), b, x),
                load(newc), cc),
            lambda cc: cc, cache)
        c.update(
            step=c["step"] + 1, nxt=c["nxt"] + jnp.sum(refill, dtype=jnp.int32),
            count=c["count"] + jnp.sum(ended, dtype=jnp.int32),
            sid=jnp.where(ended, jnp.where(refill, new, -1), c["sid"]),
            tok=jnp.where(refill, tok0[newc], jnp.where(active, nt, c["tok"])),
            n_gen=jnp.where(refill, 1, n_gen), sdone=jnp.where(refill, done0[newc], sdone),
            shit=jnp.where(refill, hit0[newc], shit), cache=shd.constrain_cache(cache),
            buf=buf, lps=lps)
        return c

    c = jax.lax.while_loop(cond, body, carry)
    mask = jnp.arange(G)[None] < c["lengths"][:, None]
    return SampleOutput(tokens=jnp.where(mask, c["buf"], 0),
                        logprobs=jnp.where(mask, c["lps"], 0.0), mask=mask,
                        lengths=c["lengths"], finished=c["finished"],
                        finish_order=c["order"], finish_step=c["fstep"])


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
