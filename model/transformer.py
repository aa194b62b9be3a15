"""The hybrid stack: sequence-mixing layers (from the pattern string), MoE or dense FFNs, MTP.

Public entry points live on `Model`, a thin stateless facade over the Linen module:

    model = Model(ModelConfig.from_dict(configs.models.get_config("test")))
    variables = model.init(jax.random.key(0))             # {"params": ..., "router_state": ...}
    out = model.apply(variables, tokens)                   # training: ModelOutput
    cache = model.init_cache(batch=B, max_len=S)
    logits, cache, hidden = model.prefill(variables, tokens, lengths, cache)  # right-padded
    logits, cache, hidden = model.prefill(variables, tokens, lengths, cache, chunk=1024)  # long
    logits, cache, hidden = model.decode_step(variables, next_tokens, cache)  # [B] -> [B,V]
    logits, steps, hidden = model.verify(variables, tokens_k1, cache)  # [B,T] -> [B,T,V]
    cache = model.commit(steps, n_keep)                                # keep n_keep[b] tokens

Every block (trunk and MTP) runs under the rematerialisation policy `cfg.remat` ("none", "full",
"save_dots"; `block_class`, `REMAT_POLICIES`); parameters are the same under every policy.

Layer kinds come from `ModelConfig.layer_kinds()` and the layer registry
(model/layers/registry.py: letter -> layer class, config section, cache); every layer follows
`registry.SequenceMixer`, and nothing below branches on the layer kind.

Scanned layer groups (`cfg.scan_layers`, spans from `ModelConfig.layer_groups`): each span of
r identical copies of a p-layer period is one `BlockGroup` under nn.scan (`scanned_group`), its
variables `layers_<first>_<last>/block_<j>/...` stacked [r, ...] on the logical axis "layers";
the training forward (no cache) is one lax.scan per span, so XLA compiles the span's body once
instead of r times. Cached calls (prefill, decode, verify) run the copies one by one on slices
of the stacked variables, keeping one cache per layer; the sampler instead unstacks the
variables once per call (rl/sampler.py). `stack_layers` / `unstack_layers` convert variables
between the layouts, `layer_location` says where a layer lives. ModelOutput's per-layer
statistics stay in layer order either way.

The cache is a plain pytree: {"lengths": [B] int32 tokens held per row, "layers": (per-layer
cache, ...)}, each layer's built by its kind's init_cache (its `LayerCache`: model/layers/kda.py
KDACache holds a conv window and a [B,H,K,V] f32 state, dsa.py DSACache the latent KV and indexer
keys for every position < max_len).

MTP speculative decoding (rl/speculative.py) uses `verify` (k + 1 tokens at once; KDA layers
return their state and conv window after each prefix 0..k) + `commit` (keep n tokens per row) on
this cache, and `mtp_draft` over a separate cache for the first MTP module (`init_draft_cache`),
applied recursively to its own hidden output for drafts beyond the first.
"""

from __future__ import annotations

import operator
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from model import sharding as shd
from model.batched_draws import batch_random_draws
from model.config import ModelConfig, span_name
from model.layers import registry
from model.layers.embeddings import Embedder
from model.layers.linear import MLP
from model.layers.moe import MoE
from model.layers.mtp import MTPCombine
from model.layers.norms import RMSNorm
from runtime.xla_env import unroll_threefry_on_cpu

PAD_ID = 0

unroll_threefry_on_cpu()  # same random bits, a cheaper init compile (runtime/xla_env.py)


@flax.struct.dataclass
class ModelOutput:
    logits: jax.Array  # [B,T,V] f32, predicts token t+1
    hidden: jax.Array  # [B,T,D] trunk output before the final norm
    mtp_logits: jax.Array | None  # [depth,B,T,V], depth k predicts token t+k+1
    balance_loss: jax.Array  # scalar, sum over MoE layers (without the coefficient)
    indexer_kl: jax.Array  # scalar, sum over DSA layers
    expert_counts: jax.Array | None  # [n_moe_layers, E] assignments per expert
    router: dict[str, jax.Array] | None  # stats stacked over MoE layers


def _dtype(name: str):
    return jnp.dtype(name)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + ffn(norm(x)); attn is the layer of kind
    `kind` (a registry letter).

    `__call__` takes keywords and hands them to `forward` positionally, so that the rematerialised
    variant (`block_class`) can mark step_caches (a Python bool) static for jax.checkpoint."""

    cfg: ModelConfig
    kind: str
    moe: bool

    def __call__(self, x, *, valid, positions, cache=None, offset=None, step_caches=False):
        return self.forward(x, valid, positions, cache, offset, step_caches)

    @nn.compact
    def forward(self, x, valid, positions, cache, offset, step_caches):
        c = self.cfg
        dt, pdt = _dtype(c.dtype), _dtype(c.param_dtype)
        kind = registry.get(self.kind)
        attn = kind.layer(c.section(kind.section), c.d_model, c.norm_eps, dt, pdt, name="attn")
        x = shd.constrain(x, shd.BLOCK_AXES)  # the residual stream's layout between blocks
        h = RMSNorm(c.norm_eps, pdt, name="attn_norm")(x)
        a, new_cache, aux = attn(h, valid=valid, positions=positions, cache=cache, offset=offset,
                                 step_caches=step_caches)
        x = x + a
        h = RMSNorm(c.norm_eps, pdt, name="ffn_norm")(x)
        if self.moe:
            f, moe_aux = MoE(c.moe, c.d_model, dt, pdt, name="ffn")(h, valid=valid)
            aux = {**aux, **moe_aux}
        else:
            f = MLP(c.moe.dense_dim, dt, pdt, name="ffn")(h)
        return shd.constrain(x + f, shd.BLOCK_AXES), new_cache, aux


# model.remat -> jax.checkpoint policy of every block (trunk and MTP). "full" is jax.checkpoint's
# default (nothing inside the block is saved: the block input is kept and the whole block is
# recomputed in the backward pass); "save_dots" keeps the outputs of matmuls without batch
# dimensions (the weight projections of attention, KDA, MLPs and the router) and recomputes the
# rest (norms, activations, attention/recurrence internals, batched einsums such as per-expert
# and per-head products). A forward-only call (prefill, decode) is unaffected.
REMAT_POLICIES = {
    "full": None,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
_REMAT_BLOCKS: dict[str, type] = {}


def block_class(remat: str) -> type:
    """Block, or Block under per-block jax.checkpoint (flax nn.remat) with the named policy.

    Parameters are identical in both (same names and tree); only the backward pass changes. In a
    forward-only call (prefill/decode) the checkpoint is inlined and costs nothing."""
    if remat == "none":
        return Block
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; valid: {['none', *REMAT_POLICIES]}")
    if remat not in _REMAT_BLOCKS:
        # static_argnums counts self: forward(self, x, valid, positions, cache, offset, step_caches)
        _REMAT_BLOCKS[remat] = nn.remat(Block, policy=REMAT_POLICIES[remat], static_argnums=(6,),
                                        methods=["forward"])
    return _REMAT_BLOCKS[remat]


class BlockGroup(nn.Module):
    """One period of the layer pattern: blocks `block_0` .. `block_{p-1}` in order (kinds[j],
    moes[j]). The body of a scanned span (`scanned_group`): carry x [B,T,D]; valid [B,T] and
    positions [B,T] are the same for every copy. Returns (x, per-block aux dicts)."""

    cfg: ModelConfig
    kinds: tuple[str, ...]
    moes: tuple[bool, ...]

    @nn.compact
    def __call__(self, x, valid, positions):
        block = block_class(self.cfg.remat)
        auxes = []
        for j, (kind, moe) in enumerate(zip(self.kinds, self.moes)):
            x, _, aux = block(self.cfg, kind, moe, name=f"block_{j}")(
                x, valid=valid, positions=positions)
            auxes.append(aux)
        return x, tuple(auxes)


_SCANNED_GROUPS: dict[int, type] = {}


def scanned_group(repeats: int) -> type:
    """BlockGroup under nn.scan over `repeats` copies: every variable collection (params,
    router_state, diagnostics) gets a leading [repeats] axis, logically named "layers" (a
    rule of model/sharding.py, unsplit by default), and each copy its own init key."""
    if repeats not in _SCANNED_GROUPS:
        _SCANNED_GROUPS[repeats] = nn.scan(
            BlockGroup, variable_axes={"params": 0, "router_state": 0, "diagnostics": 0},
            split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast), length=repeats,
            metadata_params={nn.PARTITION_NAME: "layers"})
    return _SCANNED_GROUPS[repeats]


def layer_location(cfg: ModelConfig, i: int) -> tuple[str, str | None, int | None]:
    """Where trunk layer i's variables live in cfg's layout: (span name, None, None) for an
    unscanned layer (`variables[col]["layer_<i>"]`), (span name, "block_<j>", t) for copy t of
    block j of a scanned span (`variables[col][span][block][...][t]`)."""
    for s, p, r in cfg.layer_groups():
        if s <= i < s + p * r:
            if r == 1:
                return span_name(s, p, r), None, None
            return span_name(s, p, r), f"block_{(i - s) % p}", (i - s) // p
    raise IndexError(f"layer {i} is not in a {cfg.num_layers}-layer model")


def unstack_layers(cfg: ModelConfig, variables: dict, take=None) -> dict:
    """Variables of cfg's layout (scanned spans, cfg.scan_layers) -> the per-layer layout
    (`layer_<i>` for every trunk layer; what `cfg.replace(scan_layers=False)` initialises).
    Works on any collection dict ({"params", "router_state", ...}); other entries are kept.
    take(leaf, t): copy t of a stacked leaf (default leaf[t]; e.g. a NamedSharding without its
    leading axis, for a tree of shardings)."""
    take = take or operator.getitem
    out = {}
    for col, tree in variables.items():
        tree = dict(tree)
        for s, p, r in cfg.layer_groups():
            name = span_name(s, p, r)
            if r == 1 or name not in tree:
                continue
            span = tree.pop(name)
            for t in range(r):
                for j in range(p):
                    if f"block_{j}" in span:  # (a collection may hold some blocks only)
                        tree[f"layer_{s + t * p + j}"] = jax.tree.map(
                            lambda x, t=t: take(x, t), span[f"block_{j}"])
        out[col] = tree
    return out


def stack_layers(cfg: ModelConfig, variables: dict) -> dict:
    """Inverse of unstack_layers: per-layer variables -> cfg's layout (identity without
    scan_layers). Raises ValueError naming a missing layer."""
    out = {}
    for col, tree in variables.items():
        tree = dict(tree)
        for s, p, r in cfg.layer_groups():
            if r == 1:
                continue
            blocks = {}
            for j in range(p):
                names = [f"layer_{s + t * p + j}" for t in range(r)]
                present = [n for n in names if n in tree]
                if not present:  # (a collection may hold some blocks only)
                    continue
                if len(present) != r:
                    missing = sorted(set(names) - set(present))
                    raise ValueError(
                        f"stack_layers: {col} has {present[0]} but not {missing[0]}; block {j} "
                        f"of the scanned span {span_name(s, p, r)} needs all of {names}")
                copies = [tree.pop(n) for n in names]
                blocks[f"block_{j}"] = jax.tree.map(lambda *xs: jnp.stack(xs), *copies)
            if blocks:
                tree[span_name(s, p, r)] = blocks
        out[col] = tree
    return out


class Transformer(nn.Module):
    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        dt, pdt = _dtype(c.dtype), _dtype(c.param_dtype)
        self.embed = Embedder(c.vocab_size, c.d_model, c.tie_embeddings, dt, pdt)
        block = block_class(c.remat)
        kinds = c.layer_kinds()
        # one entry per span of c.layer_groups(): a Block, or a scanned BlockGroup
        self.blocks = [
            block(c, kinds[s], c.is_moe_layer(s), name=f"layer_{s}") if r == 1 else
            scanned_group(r)(c, kinds[s:s + p], tuple(c.is_moe_layer(i) for i in range(s, s + p)),
                             name=span_name(s, p, r))
            for s, p, r in c.layer_groups()]
        self.final_norm = RMSNorm(c.norm_eps, pdt)
        self.mtp_combine = [MTPCombine(c.d_model, c.norm_eps, dt, pdt, name=f"mtp_{k}_combine")
                            for k in range(c.mtp.depth)]
        self.mtp_blocks = [block(c, c.mtp.layer_kind, c.moe.num_experts > 0, name=f"mtp_{k}_block")
                           for k in range(c.mtp.depth)]
        self.mtp_norms = [RMSNorm(c.norm_eps, pdt, name=f"mtp_{k}_norm")
                          for k in range(c.mtp.depth)]

    def __call__(self, tokens, valid=None, cache=None, with_mtp=True, step_caches=False):
        """tokens [B,T] int32; valid [B,T] bool (default all). With a cache: chunked prefill /
        decode, rows start at cache["lengths"]. Returns (ModelOutput, new cache or None).
        step_caches: the layers return per-prefix cache candidates (speculative verification)
        and the lengths stay put; `Model.commit` keeps n tokens per row."""
        B, T = tokens.shape
        if valid is None:
            valid = jnp.ones((B, T), bool)
        offset = None if cache is None else cache["lengths"]
        base = jnp.zeros((B,), jnp.int32) if offset is None else offset
        positions = base[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B,T]
        x = self.embed.encode(tokens)  # [B,T,D]
        new_layers, auxes = [], []
        for (s, p, r), blk in zip(self.cfg.layer_groups(), self.blocks):
            if r == 1:
                lc = None if cache is None else cache["layers"][s]
                x, nc, aux = blk(x, valid=valid, positions=positions, cache=lc, offset=offset,
                                 step_caches=step_caches)
                new_layers.append(nc)
                auxes.append(aux)
            elif cache is None:  # one lax.scan over the r copies of the group
                x, ys = blk(x, valid, positions)  # ys: per block j, aux stacked [r, ...]
                auxes += [jax.tree.map(operator.itemgetter(t), ys[j])
                          for t in range(r) for j in range(p)]  # layer order
            else:  # cached calls (prefill, decode, verify) keep one cache per layer: unrolled
                stacked = {col: v[span_name(s, p, r)] for col, v in self.variables.items()
                           if span_name(s, p, r) in v}
                for t in range(r):
                    for j in range(p):
                        i = s + t * p + j
                        sub = jax.tree.map(operator.itemgetter(t),
                                           {col: v[f"block_{j}"] for col, v in stacked.items()
                                            if f"block_{j}" in v})
                        x, nc, aux = Block(self.cfg, blk.kinds[j], blk.moes[j], parent=None).apply(
                            sub, x, valid=valid, positions=positions, cache=cache["layers"][i],
                            offset=offset, step_caches=step_caches)
                        new_layers.append(nc)
                        auxes.append(aux)
        hidden = x
        logits = self.embed.decode(self.final_norm(x))

        mtp_logits = None
        if self.cfg.mtp.depth and cache is None and with_mtp:
            outs, h = [], hidden
            for k in range(self.cfg.mtp.depth):
                shift = k + 1
                nxt = jnp.pad(tokens[:, shift:], ((0, 0), (0, shift)), constant_values=PAD_ID)
                vk = valid & jnp.pad(valid[:, shift:], ((0, 0), (0, shift)))
                h = self.mtp_combine[k](h, self.embed.encode(nxt))
                h, _, aux = self.mtp_blocks[k](h, valid=vk, positions=positions)
                auxes.append(aux)
                outs.append(self.embed.decode(self.mtp_norms[k](h)))
            mtp_logits = jnp.stack(outs)

        moe_aux = [a for a in auxes if "expert_counts" in a]
        zero = jnp.zeros((), jnp.float32)
        out = ModelOutput(
            logits=logits,
            hidden=hidden,
            mtp_logits=mtp_logits,
            balance_loss=sum((a["balance_loss"] for a in moe_aux), zero),
            indexer_kl=sum((a["indexer_kl"] for a in auxes if "indexer_kl" in a), zero),
            expert_counts=jnp.stack([a["expert_counts"] for a in moe_aux]) if moe_aux else None,
            router=(jax.tree.map(lambda *xs: jnp.stack(xs), *[a["router"] for a in moe_aux])
                    if moe_aux else None),
        )
        new_cache = None
        if cache is not None:
            added = 0 if step_caches else jnp.sum(valid, axis=1).astype(jnp.int32)
            new_cache = {**cache, "lengths": cache["lengths"] + added,
                         "layers": tuple(new_layers)}
        return out, new_cache

    def mtp_draft(self, hidden, next_tokens, valid, cache):
        """The first MTP module over its own cache (speculative drafting).

        hidden [B,T,D] trunk outputs at positions cache["lengths"] + t (or, to draft further
        ahead, this module's own output `h` at the previous position), next_tokens [B,T] the
        tokens that follow them, valid [B,T]. Returns (logits [B,T,V] for the token after
        next_tokens, new cache with lengths advanced by the valid count, h [B,T,D] the MTP
        block's output before its norm)."""
        B, T = next_tokens.shape
        offset = cache["lengths"]
        positions = offset[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B,T]
        h = self.mtp_combine[0](hidden, self.embed.encode(next_tokens))
        h, mc, _ = self.mtp_blocks[0](h, valid=valid, positions=positions, cache=cache["mtp"],
                                      offset=offset)
        logits = self.embed.decode(self.mtp_norms[0](h))
        return logits, {**cache, "lengths": offset + jnp.sum(valid, axis=1).astype(jnp.int32),
                        "mtp": mc}, h


def _layer_order(name: str) -> tuple:
    """Sort key: trunk layers by index (layer_2 before layer_10), then the rest by name."""
    if name.startswith("layer_") and name[6:].isdigit():
        return (0, int(name[6:]), "")
    return (1, 0, name)


def moe_layer_names(cfg: ModelConfig) -> list[str]:
    """Names of the MoE blocks in the order ModelOutput.expert_counts / .router stack them
    (trunk layers as `layer_<i>` in either layout; where their variables live:
    moe_layer_locations)."""
    names = [f"layer_{i}" for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    if cfg.moe.num_experts > 0:
        names += [f"mtp_{k}_block" for k in range(cfg.mtp.depth)]
    return names


def moe_layer_locations(cfg: ModelConfig) -> list[tuple[str, str | None, int | None]]:
    """layer_location of each of moe_layer_names(cfg), in that order (MTP blocks: (name, None,
    None))."""
    mtp = [(f"mtp_{k}_block", None, None) for k in range(cfg.mtp.depth)]
    return ([layer_location(cfg, i) for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
            + (mtp if cfg.moe.num_experts > 0 else []))


_INIT_PROGRAMS: dict = {}  # (ModelConfig, seq_len, batch_draws) -> jitted init
_ABSTRACT_INITS: dict = {}  # (ModelConfig, seq_len) -> abstract variables (read-only leaves)
_RECALL_PROGRAMS: dict = {}  # ModelConfig -> jitted indexer-recall diagnostics


def _check_chunk(chunk) -> int:
    """A prefill chunk size: an int >= 0 (0 = one shot)."""
    try:
        n = operator.index(chunk)  # ints and numpy ints; not floats or strings
    except TypeError:
        n = -1
    if isinstance(chunk, bool) or n < 0:
        raise ValueError(f"prefill chunk must be an int >= 0 (0 = the whole prompt in one call, "
                         f"N = N tokens per call through the cache), got {chunk!r}")
    return n


class Model:
    """Stateless facade: every method is a pure function of (variables, inputs[, cache])."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.net = Transformer(cfg)

    def init(self, rng: jax.Array, *, seq_len: int = 8, batch_draws: bool = True
             ) -> dict[str, Any]:
        """Fresh variables, from one compiled program per (config, seq_len): op-by-op
        initialisation costs about twice as much in a fresh process (docs/speed.md) and cannot
        use the persistent compilation cache. batch_draws: the
        parameters' random draws share a few threefry hashes (model/batched_draws.py: the same
        values, about half the compile); False for an init partitioned across devices."""
        key = (self.cfg, seq_len, batch_draws)
        fn = _INIT_PROGRAMS.get(key)
        if fn is None:
            net = self.net

            def init_fn(rng):
                v = net.init({"params": rng}, jnp.zeros((1, seq_len), jnp.int32))
                return nn.meta.unbox({k: x for k, x in v.items() if k != "diagnostics"})

            fn = _INIT_PROGRAMS[key] = jax.jit(batch_random_draws(init_fn) if batch_draws
                                               else init_fn)
        return fn(rng)

    def abstract_init(self, *, seq_len: int = 8):
        """Shapes/dtypes of the variables without allocating (jax.eval_shape); boxed with their
        logical axis names (nn.Partitioned) for sharding. Cached per (config, seq_len): tracing
        a 61-layer reference model's init takes seconds."""
        key = (self.cfg, seq_len)
        if key not in _ABSTRACT_INITS:
            tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
            v = jax.eval_shape(lambda t: self.net.init({"params": jax.random.key(0)}, t), tokens)
            _ABSTRACT_INITS[key] = {k: x for k, x in v.items() if k != "diagnostics"}
        return dict(_ABSTRACT_INITS[key])

    def apply(self, variables, tokens, valid=None, *, with_mtp: bool = True) -> ModelOutput:
        out, _ = self.net.apply(variables, tokens, valid, None, with_mtp)
        return out

    def init_cache(self, batch: int, max_len: int) -> dict[str, Any]:
        layers = tuple(self._layer_cache(k, batch, max_len) for k in self.cfg.layer_kinds())
        return {"lengths": jnp.zeros((batch,), jnp.int32), "layers": layers}

    def init_draft_cache(self, batch: int, max_len: int) -> dict[str, Any]:
        """Cache of the first MTP module's block, for `mtp_draft` (speculative decoding)."""
        if not self.cfg.mtp.depth:
            raise ValueError("speculative drafting needs an MTP module: set mtp.depth >= 1")
        return {"lengths": jnp.zeros((batch,), jnp.int32),
                "mtp": self._layer_cache(self.cfg.mtp.layer_kind, batch, max_len)}

    def _layer_cache(self, kind: str, batch: int, max_len: int):
        k = registry.get(kind)
        return k.layer.init_cache(self.cfg.section(k.section), batch, max_len,
                                  _dtype(self.cfg.dtype))

    def prefill(self, variables, tokens, lengths, cache, *, chunk: int = 0):
        """tokens [B,T] right-padded, lengths [B]. Returns (logits [B,T,V], cache, hidden
        [B,T,D]).

        chunk (0 = one shot): feed the prompt through the cache `chunk` tokens at a time (a
        lax.scan over the T // chunk full chunks, then one call for the remainder), so the
        attention temporaries are [B, chunk, S] (S = the cache length) instead of [B, T, S]: the
        DSA indexer scores, top-k and dense/sparse attention of one chunk, and one chunk of the
        KDA recurrence. Equal to one-shot prefill up to float reassociation (KDA's state is
        carried between chunks; tests/model/test_chunked_prefill.py). The outputs logits and
        hidden still hold every position ([B,T,V], [B,T,D]: linear in T). Rows whose prompt ended
        before a chunk see only invalid tokens there: their KDA state and conv window stay put
        and their DSA rows past their length are rewritten by decoding before any query attends
        them, exactly as padding is in one-shot prefill. Not covered: capacity-dispatch MoE
        (moe.dispatch="capacity") drops tokens per call, so its chunked result differs from one
        shot wherever one of them drops a token."""
        chunk = _check_chunk(chunk)
        B, T = tokens.shape
        valid = jnp.arange(T)[None] < lengths[:, None]  # [B,T]
        if chunk == 0 or T <= chunk:
            out, cache = self.net.apply(variables, tokens, valid, cache)
            return out.logits, cache, out.hidden
        n = T // chunk

        def step(c, xs):
            tok_c, valid_c = xs  # [B,chunk] each
            out, c = self.net.apply(variables, tok_c, valid_c, c)
            return c, (out.logits, out.hidden)

        def split(x):  # [B,n*chunk] -> [n,B,chunk]
            return x[:, :n * chunk].reshape(B, n, chunk).swapaxes(0, 1)

        cache, (logits, hidden) = jax.lax.scan(step, cache, (split(tokens), split(valid)))
        logits = logits.swapaxes(0, 1).reshape(B, n * chunk, -1)  # [B,n*chunk,V]
        hidden = hidden.swapaxes(0, 1).reshape(B, n * chunk, -1)  # [B,n*chunk,D]
        if n * chunk < T:
            out, cache = self.net.apply(variables, tokens[:, n * chunk:], valid[:, n * chunk:],
                                        cache)
            logits = jnp.concatenate([logits, out.logits], axis=1)
            hidden = jnp.concatenate([hidden, out.hidden], axis=1)
        return logits, cache, hidden

    def verify(self, variables, tokens, cache, active=None):
        """Speculative verification: tokens [B,T] (the last sampled token, then drafts) at each
        row's position; active [B] (default all). Returns (logits [B,T,V], step cache, hidden
        [B,T,D]); `commit(step_cache, n)` then keeps the first n[b] tokens of row b."""
        valid = jnp.ones(tokens.shape, bool)
        if active is not None:
            valid = valid & active[:, None]
        out, step_cache = self.net.apply(variables, tokens, valid, cache, step_caches=True)
        return out.logits, step_cache, out.hidden

    def commit(self, step_cache, n):
        """The cache after the first n[b] (0..T) verified tokens of each row."""
        layers = tuple(registry.get(k).layer.select_step_cache(lc, n)
                       for k, lc in zip(self.cfg.layer_kinds(), step_cache["layers"]))
        return {**step_cache, "lengths": step_cache["lengths"] + n.astype(jnp.int32),
                "layers": layers}

    def mtp_draft(self, variables, hidden, next_tokens, valid, draft_cache):
        """See `Transformer.mtp_draft`: (MTP-1 logits [B,T,V], the advanced draft cache, the
        MTP block's hidden output [B,T,D]). Multi-token drafts (rl/speculative.py) feed that
        hidden output back with the drafted token to draft the next one."""
        return self.net.apply(variables, hidden, next_tokens, valid, draft_cache,
                              method=Transformer.mtp_draft)

    def decode_step(self, variables, tokens, cache, active=None):
        """tokens [B] (the last sampled token per row); active [B] bool rows to advance
        (default all). Returns (logits [B,V], cache, hidden [B,D])."""
        valid = jnp.ones((tokens.shape[0], 1), bool) if active is None else active[:, None]
        out, cache = self.net.apply(variables, tokens[:, None], valid, cache)
        return out.logits[:, 0], cache, out.hidden[:, 0]

    def indexer_recall(self, variables, tokens, valid=None) -> dict[str, jax.Array]:
        """Recall of the DSA lightning indexer: per DSA layer (trunk and MTP), the fraction of
        the index_topk keys with the highest head-averaged attention that the indexer's top-k
        also selects, averaged over queries with more than index_topk causal keys (fewer keys:
        every key is selected). tokens [B,T]. Returns {layer name: recall, "mean": mean over
        layers}; NaN where no query qualifies (T <= index_topk). One compiled program per config
        (op by op, each call in a fresh process compiled every primitive separately)."""
        fn = _RECALL_PROGRAMS.get(self.cfg)
        if fn is None:
            net = self.net

            def diagnostics(variables, tokens, valid):
                _, state = net.apply(variables, tokens, valid, None, True,
                                     mutable=["diagnostics"])
                return state.get("diagnostics", {})

            fn = _RECALL_PROGRAMS[self.cfg] = jax.jit(diagnostics)
        out = {}
        diag = unstack_layers(self.cfg, {"d": fn(variables, tokens, valid)})["d"]
        for name, layer in sorted(diag.items(), key=lambda kv: _layer_order(kv[0])):
            (hits, n), = layer["attn"]["indexer_recall"]  # sown once per DSA layer
            out[name] = hits / n
        if out:
            out["mean"] = jnp.mean(jnp.stack(list(out.values())))
        return out
