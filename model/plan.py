"""The memory and compute planner: parameters, bytes, shards, decode-state memory, and the
per-device memory on a mesh, for a ModelConfig, without allocating the model.

    from model import plan
    p = plan.plan(cfg)                                   # totals
    pd = plan.per_device_plan(cfg, "fsdp=16,expert=8,tensor=8", "h200", batch=256, seq=4096)
    print(plan.format_per_device(pd))

The command line is scripts/plan.py; train/run_plan.py reads an RL config's run (`RunPlan`) and
batch; scripts/_common.py's launch check reads `per_device_plan`.

Parameter counts come from `jax.eval_shape` of the real model init (no allocation); decode-state
bytes from the real cache shapes (`Model.init_cache` under eval_shape) for the hybrid layout, and
for an all-DSA and an all-dense-MHA layout of the same width and depth (MHA: dsa.num_heads heads,
K width qk_head_dim, V width v_head_dim, bf16).

Covered: totals (with and without the MTP module), active parameters per token (k routed +
shared experts), bytes in bf16 and with MXFP4 experts (4.25 bits/value: 4-bit elements + one
E8M0 scale per 32), shard count.

Per-device table (`per_device_plan`; scripts/plan.py --mesh): every parameter is mapped through
the same logical axis rules the runtime uses (model/sharding.py: axes that do not divide a
dimension are dropped, i.e. that dimension is replicated; those dims are listed). Assumptions, also printed:
  * training keeps a working copy of every parameter in its dtype (bf16 for reference_2p8t;
    MXFP4 experts are trained as bf16 with QAT, model.moe.qat; the router and KDA gate
    parameters are f32), gradients in the same dtypes, an f32 master copy of every
    non-f32 parameter, and AdamW's two f32 moments; all sharded like the parameters (ZeRO-3 over
    fsdp x expert, experts over the expert axis);
  * activations under the configured rematerialisation policy (`model.remat`: "none", "full"
    or "save_dots"; the table shows the other two next to it): per block, the residuals JAX
    saves for the backward pass under that policy, counted from a trace of the real block
    (`block_residual_bytes`: jax.vjp under make_jaxpr, nothing compiled or allocated) on the
    device's tensor-parallel slice (`device_slice_cfg`: heads/mlp widths over tensor; DSA/KDA/
    MXFP4 ops traced with their Pallas kernels, as impl="auto" runs them on GPU/TPU), at the
    local batch (rules["batch"] = data x fsdp x expert); plus the backward of one block
    (its recompute and cotangents) and the f32 logits with their gradient (`activation_bytes`
    has the formula). It ignores XLA's fusion and buffer reuse: on the tiny model at T=2048 it
    is 1.5-1.8x XLA's compiled temp memory (`compiled_train_memory`, docs/scaling.md);
  * inference holds the parameters as stored (MXFP4 experts) and the decode state for `batch`
    sequences of `seq` tokens (batch split as above, KDA heads over tensor);
  * ZeRO-3 gathered weights and expert-parallel dispatch buffers (`fsdp_gathered_bytes`,
    `ep_buffer_bytes`; a warning when the dropless all_to_all's buffers explode);
  * with an RL config (`RunPlan`, built by train/run_plan.py:run_plan_from_config): its optimizer
    dtypes (optim.master_dtype / mu_dtype), the micro-batch gradient accumulator, the reference
    policy, and a rollout verdict (the sampler next to the train state: on the training
    parameters, or on the packed MXFP4 copy of the experts that rl.rollout_experts=mxfp4
    quantises once per rollout batch, counted with its gathered weights). For the tiny model on
    8 fake devices the training total is within 10% of XLA's memory analysis of the compiled
    RL train step (tests/rl/test_sharded_rl.py); for small_8dev on v5p:2x2x2 each program's
    total ("programs": train step, rollout, reference forward) is within 10% of the TPU
    compiler's (docs/scaling.md section 4.2, tests/rl/tpu_plan_check.py);
  * usable memory = device HBM x (1 - headroom) (XLA workspace, collectives buffers,
    fragmentation).
The verdict says what does not fit and by how much.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import quant
from model import sharding as shd
from model.config import ModelConfig
from model.layers import moe as moe_lib
from model.layers import registry
from model.objectives import lm_loss
from model.transformer import Model, block_class

EXPERT_KEYS = ("w_gate", "w_up", "w_down")
MXFP4_BITS = 4.25


def model_cfg(cfg) -> ModelConfig:
    """The ModelConfig of a model config, or of a run config's `model` field."""
    return ModelConfig.from_dict(cfg.model if "model" in cfg else cfg)


@functools.lru_cache(maxsize=8)
def _abstract(cfg: ModelConfig):
    """Boxed abstract variables (jax.eval_shape of the real init), cached per config."""
    return Model(cfg).abstract_init()


def count_params(cfg: ModelConfig) -> dict:
    """Walk the abstract params: totals, routed-expert elements, MTP elements."""
    shapes = _abstract(cfg)["params"]
    total = expert = mtp = expert_mtp = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        leaf = getattr(leaf, "value", leaf)
        names = [str(p.key) for p in path if hasattr(p, "key")]  # dict keys (skip box attrs)
        n = int(np.prod(leaf.shape))
        is_expert = any(str(nm).startswith(EXPERT_KEYS) for nm in names)
        if is_expert and leaf.dtype == jnp.uint8:
            # packed MXFP4: blocks hold 2 values per byte; scales are per 32 values (not params)
            n = n * 2 if str(names[-1]).endswith("_blocks") else 0
        is_mtp = str(names[0]).startswith("mtp_")
        total += n
        expert += n if is_expert else 0
        mtp += n if is_mtp else 0
        expert_mtp += n if (is_expert and is_mtp) else 0
    return {"total": total, "expert": expert, "mtp": mtp, "expert_mtp": expert_mtp}


def decode_state_bytes(cfg: ModelConfig, seq_len: int) -> dict:
    def cache_bytes(c: ModelConfig) -> int:
        shapes = jax.eval_shape(lambda: Model(c).init_cache(1, seq_len))
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    hybrid = cache_bytes(cfg)
    all_dsa = cache_bytes(cfg.replace(layer_pattern="D"))
    d = cfg.dsa
    mha = cfg.num_layers * seq_len * d.num_heads * (d.qk_head_dim + d.v_head_dim) * 2
    return {"hybrid": hybrid, "all_dsa": all_dsa, "all_mha": mha}


# --------------------------------------------------------------------------- per device
# HBM per device in bytes (vendor figures; TPU v5p: 95 GiB user-allocatable of 96 GiB physical).
DEVICES = {
    "h200": {"name": "NVIDIA H200 SXM (141 GB HBM3e)", "hbm": 141e9},
    "b200": {"name": "NVIDIA B200 (HGX, 180 GB HBM3e)", "hbm": 180e9},
    "tpu-v5p": {"name": "Cloud TPU v5p (95 GiB HBM2e usable)", "hbm": 95 * 2**30},
    "tpu-v6e": {"name": "Cloud TPU v6e / Trillium (32 GB HBM)", "hbm": 32e9},
}

ASSUMPTIONS = (
    "train: working params in the param dtype (MXFP4 experts trained as bf16 + QAT; router and "
    "KDA gate params f32), grads in the param dtype, f32 master of every non-f32 param and AdamW "
    "mu+nu in f32 (optim.master_dtype / mu_dtype of an RL config; defaults as configs/rl.py), "
    "a second gradient tree with micro-batches, the frozen reference policy when the algorithm "
    "has one; all sharded like the params",
    "ZeRO-3: weights gathered over the batch axes for compute, cast to the compute dtype first "
    "(all blocks kept for the backward without remat, one block with it) plus one block's "
    "full-size gradient before its reduce-scatter; expert parallelism: send/receive buffers of "
    "one layer forward and backward, and every MoE layer's dispatched rows with their gate/up "
    "projections kept into the backward (twice with remat: the forward's and the recompute's)",
    "the step's transients at the larger of the backward's start (residuals, logits, gathers, "
    "EP rows; no weight gradient yet) and its end (the gradient tree, one block's working set)",
    "rollouts: the sampler next to the train state (params, master, moments, reference; the "
    "gradients are not live), on the train state's params (no MTP module) or, with "
    "rl.rollout_experts=mxfp4, a packed MXFP4 copy of the experts; the decode state of the "
    "rollout batch, the prefill's f32 logits, the weight gathers hoisted out of the decode loop "
    "(every block's gathered weights live, in the compute dtype)",
    "activations: under the configured remat policy (model.remat); per block the residuals JAX "
    "saves for the backward (traced from the real block on this device's tensor-parallel slice, "
    "Pallas kernels as on GPU/TPU), plus one block's recompute and cotangents, plus f32 logits "
    "and their gradient; no XLA buffer reuse, no sequence parallelism",
    "inference: params as stored (MXFP4 experts) + decode state for --batch x --seq",
    "usable = HBM x (1 - headroom)",
)


def local_elements(shape, spec, mesh_shape: dict) -> int:
    """Elements of one device's shard of an array of `shape` laid out by PartitionSpec `spec`."""
    n = 1
    for i, d in enumerate(shape):
        e = spec[i] if i < len(spec) else None
        axes = () if e is None else (e,) if isinstance(e, str) else e
        n *= d // math.prod(mesh_shape[a] for a in axes)
    return n


def _shard_bytes(abstract, mesh_shape: dict, rules=None, report=None) -> dict:
    """Per-device bytes of a boxed abstract variable tree under the rules: {"total", "elements",
    "elements_f32"} (per-device element counts, all and of f32 leaves)."""
    total = elems = elems_f32 = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract, is_leaf=shd._is_box):
        if shd._is_box(leaf):
            rep = [] if report is not None else None
            spec = shd.logical_to_spec(leaf.names, leaf.value.shape, mesh_shape, rules, rep)
            if rep:
                report.extend((jax.tree_util.keystr(path),) + r for r in rep)
            x = leaf.value
        else:
            spec, x = jax.sharding.PartitionSpec(), leaf
        n = local_elements(x.shape, spec, mesh_shape)
        total += n * x.dtype.itemsize
        elems += n
        elems_f32 += n if x.dtype == jnp.float32 else 0
    return {"total": total, "elements": elems, "elements_f32": elems_f32}


def _training_cfg(cfg: ModelConfig) -> ModelConfig:
    """The config trained: MXFP4 experts become a bf16 (QAT) master."""
    if cfg.moe.expert_format == "mxfp4":
        return cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="bf16", qat=True))
    return cfg


REMAT_NAMES = ("none", "full", "save_dots")  # model/config.py:REMAT


def _split(n: int, logical: str, mesh_shape: dict, rules=None) -> int:
    """n divided over the mesh axes the rules give `logical` (when they divide n)."""
    spec = shd.logical_to_spec((logical,), (n,), mesh_shape, rules)
    e = spec[0] if len(spec) else None
    axes = () if e is None else (e,) if isinstance(e, str) else e
    return n // math.prod(mesh_shape[a] for a in axes)


def device_slice_cfg(cfg: ModelConfig, mesh_shape: dict, rules=None, *, kernels: str = "pallas"
                     ) -> ModelConfig:
    """The model one device computes under tensor parallelism: each layer kind's share
    (`LayerKind.device_slice` in model/layers/registry.py: its heads divided over the axes the
    rules map "heads" to, when they divide) and FFN/expert widths divided over "mlp"'s axes,
    everything else whole; kernels: the impl to trace ("pallas": what impl="auto" runs on
    GPU/TPU for these shapes, by each op's dispatch table, and lax.ragged_dot for the dropless
    experts; "xla")."""
    def heads(n):
        return _split(n, "heads", mesh_shape, rules)

    def mlp(n):
        return _split(n, "mlp", mesh_shape, rules) if n else n

    sections = {kind.section: kind.slice_for_device(cfg.section(kind.section), heads, kernels)
                for letter, kind in registry.kinds().items() if letter in cfg.kinds_used()}
    m = cfg.moe
    return cfg.replace(
        **sections,
        moe=dataclasses.replace(m, expert_dim=mlp(m.expert_dim), dense_dim=mlp(m.dense_dim),
                       mxfp4_impl=kernels,
                       grouped_matmul="ragged_dot" if kernels == "pallas" else m.grouped_matmul))


@functools.lru_cache(maxsize=64)
def _block_variables(cfg: ModelConfig, kind: str, moe: bool, seq: int):
    """Abstract variables of one block (jax.eval_shape of its init at batch 1): the same for
    every remat policy and batch (model.transformer.block_class), so traced once for all."""
    def init(x):
        valid = jnp.ones((1, seq), bool)
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (1, seq))
        return nn.meta.unbox(block_class("none")(cfg, kind, moe).init(
            jax.random.key(0), x, valid=valid, positions=pos))

    return jax.eval_shape(init, jax.ShapeDtypeStruct((1, seq, cfg.d_model), jnp.dtype(cfg.dtype)))


@functools.lru_cache(maxsize=256)
def block_residual_bytes(cfg: ModelConfig, kind: str, moe: bool, remat: str, batch: int,
                         seq: int) -> int:
    """Bytes JAX keeps from one block's forward for its backward pass (the saved residuals of
    jax.vjp, parameters excluded) under the remat policy: the real block module
    (model.transformer.block_class), traced with jax.make_jaxpr only (no compile, no
    allocation), batch x seq tokens, loss = sum of the output and the aux losses."""
    from jax._src.ad_checkpoint import saved_residuals

    blk = block_class(remat)(cfg, kind, moe)
    dt = jnp.dtype(cfg.dtype)
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), dt)

    def apply(variables, x):
        valid = jnp.ones((batch, seq), bool)
        pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        return blk.apply(variables, x, valid=valid, positions=pos)

    variables = _block_variables(cfg, kind, moe, seq)

    def loss(params, x):
        y, _, aux = apply({**variables, "params": params}, x)
        return jnp.sum(y.astype(jnp.float32)) + sum(
            jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(aux))

    total = 0
    for aval, desc in saved_residuals(loss, variables["params"], x):
        if "argument params" in desc:  # the parameters themselves are not activations
            continue
        total += int(np.prod(aval.shape)) * aval.dtype.itemsize
    return total


def activation_bytes(cfg: ModelConfig, mesh_shape: dict, batch: int, seq: int, rules=None,
                     *, kernels: str = "pallas") -> dict:
    """Activation bytes per device for one training step, for every remat policy.

    Per block b (trunk and MTP), R_b(p) = the residuals JAX saves for the backward under policy
    p (`block_residual_bytes`, traced from the real block on the device's tensor-parallel slice
    `device_slice_cfg`, at the local batch and seq). Traced at batch 1 and 2: the part that
    does not grow with the batch is parameter-derived (QAT fake-quantised expert copies) and is
    divided over the fsdp x expert axes like the weights it copies; the rest scales with the
    local batch. Then
        act(p) = sum_b R_b(p) + max_b [ (R_b(none) - R_b(p)) + R_b(none) ] + logits
    i.e. everything saved, plus, for the block being differentiated, what its backward
    recomputes (nothing for "none", the whole block for "full") and a working set of
    cotangents the size of its residuals. logits = tokens x vocab/tensor x 4 bytes x 2 (f32
    logits and their gradient) per head (next token + MTP depths).
    Not covered: XLA's buffer reuse and fusion (the compiled program can need less, see
    `compiled_train_memory`), forward-only transients that are not saved (e.g. the indexer
    KL's [B,H,T,S] probabilities), collective buffers (in --headroom), the expert-parallel dispatch
    buffers (the local dropless dispatch is traced: k rows per token, as in the EP path),
    sequence parallelism (none: every device holds whole sequences).
    """
    # one trace per (slice, block kind, policy): the configured policy is not part of the key
    scfg = device_slice_cfg(cfg, mesh_shape, rules, kernels=kernels).replace(remat="none")
    # the expert path the step takes at these shapes (model/layers/moe.py:takes_all_experts;
    # never under expert parallelism): the traced blocks of 1 and 2 sequences take the path of
    # the planned batch
    every = (cfg.moe.num_experts > 0 and cfg.moe.expert_parallel == "none"
             and moe_lib.takes_all_experts(cfg.moe, batch * seq))
    scfg = scfg.replace(moe=dataclasses.replace(scfg.moe, all_experts_max_rows=(
        2 * max(1, batch) * seq * cfg.moe.num_experts if every else 0)))
    baxes = shd.batch_axes(mesh_shape, batch, rules)
    b_loc = batch // math.prod(mesh_shape[x] for x in baxes)
    tok = b_loc * seq
    param_split = math.prod(mesh_shape.get(a, 1) for a in ("fsdp", "expert"))
    m = cfg.moe
    kinds = [(kind, cfg.is_moe_layer(i)) for i, kind in enumerate(cfg.layer_kinds())]
    kinds += [(cfg.mtp.layer_kind, m.num_experts > 0)] * cfg.mtp.depth

    def per_device(kind, moe, remat):
        one = block_residual_bytes(scfg, kind, moe, remat, 1, seq)
        two = block_residual_bytes(scfg, kind, moe, remat, 2, seq)
        per_seq, fixed = two - one, 2 * one - two
        return b_loc * per_seq + fixed / param_split

    res = {p: [per_device(kd, mo, p) for kd, mo in kinds] for p in REMAT_NAMES}
    logits = tok * _split(cfg.vocab_size, "vocab", mesh_shape, rules) * 4 * 2 * (1 + cfg.mtp.depth)
    out = {"local_batch": b_loc, "tokens_per_device": tok, "logits": logits,
           "dsa_indexer_scores_per_layer": b_loc * seq * seq * 4,
           "block_residuals": {p: int(sum(r)) for p, r in res.items()}}
    out["saved"], out["working"] = {}, {}
    for p in REMAT_NAMES:
        live = max(2 * n - r for n, r in zip(res["none"], res[p]))
        out["saved"][p], out["working"][p] = int(sum(res[p])), int(live)
        out[p] = int(sum(res[p]) + live + logits)
    # the names used before the policies were configurable
    out["remat"], out["no_remat"] = out["full"], out["none"]
    return out


def train_grad_fn(cfg: ModelConfig):
    """(variables, tokens [B,T]) -> gradient of model.objectives.lm_loss (every token a target)
    over the params: the training computation whose memory `compiled_train_memory` reports."""
    model = Model(cfg)

    def grad(variables, tokens):
        def loss(params):
            out = model.apply({**variables, "params": params}, tokens)
            return lm_loss(out, tokens, jnp.ones(tokens.shape, bool), cfg)[0]
        return jax.grad(loss)(variables["params"])
    return grad


MEMORY_FIELDS = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                 "alias_size_in_bytes", "generated_code_size_in_bytes")


def compiled_train_memory(cfg: ModelConfig, batch: int, seq: int,
                          policies: tuple[str, ...] = REMAT_NAMES) -> dict:
    """XLA's own numbers: `train_grad_fn` lowered from shapes only (nothing allocated) and
    compiled for this host's default backend, once per remat policy -> {policy: {field: bytes}}
    (`MEMORY_FIELDS` of `Compiled.memory_analysis()`), plus "xla_flags".

    On XLA:CPU the default concurrency-optimised scheduler places the recomputation of a
    rematerialised block early, next to the forward pass (jax 0.10.2: the tiny model's temp
    memory does not fall); run with
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false to see what remat saves
    (the flag is read when the backend starts, not per compilation). Compiling a large model
    takes long: meant for small configs and for GPU/TPU hosts."""
    out = {}
    for p in policies:
        pcfg = cfg.replace(remat=p)
        variables = jax.eval_shape(Model(pcfg).init, jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        ma = jax.jit(train_grad_fn(pcfg)).lower(variables, tokens).compile().memory_analysis()
        out[p] = {f: int(getattr(ma, f)) for f in MEMORY_FIELDS}
    out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return out


def decode_state_per_device(cfg: ModelConfig, mesh_shape: dict, batch: int, seq: int,
                            rules=None) -> int:
    """Decode cache bytes per device for `batch` sequences of `seq` tokens: each layer's cache
    leaves split over the logical axes its kind gives them (`LayerKind.cache_axes`; leaves not
    listed split over the batch only)."""
    shapes = jax.eval_shape(lambda: Model(cfg).init_cache(batch, seq))
    kinds = registry.kinds()
    layer_axes = [kinds[k].cache_axes for k in cfg.layer_kinds()]
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        key = str(getattr(path[-1], "key", ""))
        axes = {}
        if str(getattr(path[0], "key", "")) == "layers":  # ("layers", layer index, leaf name)
            axes = layer_axes[path[1].idx]
        names = axes.get(key, ("batch",) + (None,) * (x.ndim - 1))
        spec = shd.logical_to_spec(names, x.shape, mesh_shape, rules)
        total += local_elements(x.shape, spec, mesh_shape) * x.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run allocates besides the model (from an RL/SFT config: `run_plan_from_config`).

    master_dtype: "float32" = an f32 master of every non-f32 parameter and both Adam moments in
      f32 (rl.train_step.with_master_copy); "" = none, moments in mu_dtype / the param dtype.
    mu_dtype: Adam's first moment ("" = the parameter's dtype).
    micro_batches: > 1 adds the gradient accumulator (a second gradient tree) and divides the
      activations' batch.
    reference: RL keeps a frozen reference policy (a sharded copy of the parameters).
    rollout_rows / rollout_len: the sampler's batch (rows, prompt + generated tokens); the
      sampler runs next to the train state.
    rollout_prompt_len: the prompt width the sampler's prefill computes logits for (0: one
      position per row).
    rollout_experts: "bf16" = the sampler runs on the train state's parameters; "mxfp4" = on a
      packed MXFP4 copy of the routed experts (rl.rollout_experts, quantised once per batch),
      so its gathered expert weights are MXFP4 (4.25 bits) and the copy is counted.
    """

    master_dtype: str = "float32"
    mu_dtype: str = "float32"
    micro_batches: int = 1
    reference: bool = False
    rollout_rows: int = 0
    rollout_len: int = 0
    rollout_prompt_len: int = 0
    rollout_experts: str = "bf16"


def _leaf_spec_bytes(abstract, mesh_shape: dict, rules, keep_axes, as_dtype=None) -> int:
    """Per-device bytes of the boxed tree when only the mesh axes in keep_axes(leaf names)
    split it (the rest gathered); as_dtype: floating leaves wider than it counted in it."""
    total = 0
    for leaf in jax.tree.leaves(abstract, is_leaf=shd._is_box):
        x = leaf.value if shd._is_box(leaf) else leaf
        spec = (shd.logical_to_spec(leaf.names, x.shape, mesh_shape, rules)
                if shd._is_box(leaf) else jax.sharding.PartitionSpec())
        keep = keep_axes(leaf.names if shd._is_box(leaf) else ())
        n = 1
        for i, d in enumerate(x.shape):
            e = spec[i] if i < len(spec) else None
            axes = () if e is None else (e,) if isinstance(e, str) else e
            n *= d // math.prod(mesh_shape[a] for a in axes if a in keep)
        size = x.dtype.itemsize
        if as_dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
            size = min(size, jnp.dtype(as_dtype).itemsize)
        total += n * size
    return total


def fsdp_gathered_bytes(cfg: ModelConfig, mesh_shape: dict, rules=None, *,
                        cast: bool = False) -> dict:
    """Weights all-gathered for compute under ZeRO-3: every dimension split over a batch axis
    (data/fsdp/expert, rules["batch"]) is gathered, except an expert matrix's expert dimension
    under expert parallelism (its experts stay on their shard); tensor splits stay.
    {"all_blocks": bytes of every gathered weight (kept for the backward without remat),
     "one_block": the largest single block's (what remat keeps live)}, minus the shards
    already held. cast: the weights are cast to the compute dtype (cfg.dtype) before they are
    gathered (what the TPU compile of small_8dev does, f32 parameters with bf16 compute, in the
    train step and the sampler alike): the gathered copy is whole, in the compute dtype."""
    rules = shd.normalize_rules(rules)
    batch_axes = set(rules.get("batch", ()))
    ep = cfg.moe.expert_parallel != "none"
    # per layer: a scanned span's copies are gathered one at a time, each as its layer would
    # be (the stacking axis is unsplit), so the per-layer tree gives the same bytes
    tree = _abstract(cfg.replace(scan_layers=False))["params"]

    def keep(names):
        k = {a for a in mesh_shape if a not in batch_axes}
        if ep and "expert" in names:
            k |= set(rules.get("expert", ()))
        return k

    per_block, total = [], 0
    for name, sub in tree.items():
        if name == "embed":  # the token lookup reads the table's shards; the head is gathered
            sub = {k: v for k, v in sub.items() if k != "embedding"}
        gathered = 0
        for leaf in jax.tree.leaves(sub, is_leaf=shd._is_box):
            full = _leaf_spec_bytes(leaf, mesh_shape, rules, keep)
            held = _leaf_spec_bytes(leaf, mesh_shape, rules, lambda _: set(mesh_shape))
            narrow = _leaf_spec_bytes(leaf, mesh_shape, rules, keep, as_dtype=cfg.dtype)
            # a cast leaf's compute copy is new memory; an uncast one adds what is gathered
            gathered += narrow if (cast and narrow < full) else full - held
        full, held = gathered, 0
        total += full - held
        if name.startswith(("layer_", "mtp_")):
            per_block.append(full - held)
    return {"all_blocks": int(total), "one_block": int(max(per_block, default=0))}


def ep_buffer_bytes(cfg: ModelConfig, mesh_shape: dict, tokens_local: int, rules=None) -> dict:
    """Expert-parallel dispatch buffers per MoE layer per device (model/layers/moe.py), beyond
    the local dropless dispatch the traced block residuals count (k rows per token):
    all_to_all: [E, C, D] send and receive buffers with C = tokens_local (dropless) or
    ceil(cf * tokens_local * k / E) (capacity); ragged_all_to_all: M receive rows,
    ep * tokens_local * min(k, E/ep) (dropless) or ceil(cf * tokens_local * k) (capacity).
    {"rows", "transient" (send + receive of one layer), "kept" (one copy of a layer's
    dispatched rows and their gate/up projections, rows x (D + 2F), with rows = E x C for
    all_to_all and k x tokens_local for ragged_all_to_all: what XLA keeps of every MoE
    layer from the forward into the backward whatever the remat policy; the TPU compile of
    small_8dev holds it twice per layer under remat, the forward's and the recompute's,
    docs/scaling.md section 4.2), "layers"}; zeros without expert parallelism."""
    m = cfg.moe
    zero = {"rows": 0, "transient": 0, "kept": 0, "layers": 0}
    if not m.num_experts or m.expert_parallel == "none":
        return zero
    ep = mesh_shape.get("expert", 1)
    E, k, n = m.num_experts, m.num_experts_per_tok, tokens_local
    if m.expert_parallel == "all_to_all":
        C = n if m.dispatch == "dropless" else moe_lib.expert_capacity(m, n)
        rows = kept_rows = E * C  # the padded [E, C] buffers are what each layer holds
    else:
        rows = (ep * n * min(k, E // max(ep, 1)) if m.dispatch == "dropless"
                else max(1, math.ceil(m.capacity_factor * n * k)))
        # the M receive rows are a worst-case bound; the layer keeps the rows it routed (k per
        # token; an estimate: no compile of a ragged program has been read for this)
        kept_rows = min(rows, n * k)
    b = jnp.dtype(cfg.dtype).itemsize
    D, F = cfg.d_model, _split(m.expert_dim, "mlp", mesh_shape, rules)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) + cfg.mtp.depth
    return {"rows": int(rows), "transient": int(2 * rows * D * b),
            "kept": int(kept_rows * (D + 2 * F) * b), "layers": int(layers)}


def _verdict(need: float, usable: float) -> dict:
    return {"total": int(need), "fits": need <= usable, "over_by": int(max(0, need - usable)),
            "utilisation": need / usable}


def per_device_plan(cfg: ModelConfig, mesh: str | dict, device: str = "h200", batch: int = 256,
                    seq: int = 4096, headroom: float = 0.10, rules=None,
                    run: RunPlan | None = None) -> dict:
    """Per-device memory for training (AdamW) and inference on `mesh` (see module docstring);
    run: what the run allocates besides the model (RunPlan; default: f32 master and f32 Adam
    moments, one micro-batch, no reference policy, no rollouts)."""
    run = run or RunPlan()
    mesh_shape = shd.mesh_shape(mesh)
    ndev = math.prod(mesh_shape.values())
    dev = DEVICES[device]
    usable = dev["hbm"] * (1 - headroom)
    report: list = []
    stored = _shard_bytes(_abstract(cfg), mesh_shape, rules, report)
    tcfg = _training_cfg(cfg)
    train_report: list = []
    work = _shard_bytes(_abstract(tcfg), mesh_shape, rules, train_report)
    # what rl.train_step allocates: params and gradients in the param dtype; with master_dtype
    # an f32 master of every non-f32 parameter and both Adam moments in f32; without, mu in
    # mu_dtype (or the param dtype) and nu in the param dtype
    params, elems = work["total"], work["elements"]
    grads = params
    master = 4 * (elems - work["elements_f32"]) if run.master_dtype else 0
    mu = 4 * elems if (run.master_dtype or run.mu_dtype == "float32") else params
    nu = 4 * elems if run.master_dtype else params
    moments = mu + nu
    accum = grads if run.micro_batches > 1 else 0  # the micro-batch gradient accumulator
    reference = params if run.reference else 0  # the frozen reference policy (sharded copy)
    mb = max(batch // max(run.micro_batches, 1), 1)
    act = activation_bytes(tcfg, mesh_shape, mb, seq, rules)
    gathered = fsdp_gathered_bytes(tcfg, mesh_shape, rules, cast=True)
    ep_buf = ep_buffer_bytes(tcfg, mesh_shape, act["tokens_per_device"], rules)

    def gathered_live(p):
        """ZeRO-3 gathered weights live at once: every block's without remat (kept for the
        backward), one block's with it, plus one block's full-size weight gradient before its
        reduce-scatter."""
        return gathered["all_blocks" if p == "none" else "one_block"] + gathered["one_block"]

    def ep_live(p):
        """EP: the send/receive buffers of one layer's forward and of its backward (the
        cotangents go back through the same all_to_all), plus the dispatched rows every MoE
        layer keeps into the backward (twice with remat: the forward's and the recompute's)."""
        copies = 1 if p == "none" else 2
        return 2 * ep_buf["transient"] + copies * ep_buf["kept"] * ep_buf["layers"]

    def step_peak(p):
        """The step's transient peak, the larger of two moments: the backward's start (every
        block's saved residuals, the logits and their gradient, the working set of the first
        block's backward, the gathered weights and the EP buffers every layer keeps; no weight
        gradient exists yet) and its end (the full gradient tree, one block's working set and
        gathered weights, one layer's EP send/receive)."""
        return max(backward_start(p), backward_end(p))

    def backward_start(p):
        return act[p] + gathered_live(p) + ep_live(p)

    def backward_end(p):
        return grads + act["working"][p] + 2 * gathered["one_block"] + 2 * ep_buf["transient"]

    state = params + accum + master + moments + reference
    total = {p: state + step_peak(p) for p in REMAT_NAMES}
    dec = decode_state_per_device(cfg, mesh_shape, batch, seq, rules)
    baxes = shd.batch_axes(mesh_shape, batch, rules)
    b_loc = batch // math.prod(mesh_shape[x] for x in baxes)
    dec_logits = b_loc * cfg.vocab_size * 4
    infer_total = stored["total"] + dec + dec_logits
    # the programs without the MTP module (the sampler and the log-prob forward do not run it;
    # jax.jit drops unused arguments)
    abstract_t = _abstract(tcfg)
    forward_params = _shard_bytes(
        {**abstract_t, "params": {k: v for k, v in abstract_t["params"].items()
                                  if not k.startswith("mtp_")}}, mesh_shape, rules)["total"]
    # the separate log-prob forward: one block's gathered weights at a time, and the larger of
    # one MoE layer's EP send/receive buffers and the f32 logits of the rows
    ref_forward = forward_params + fsdp_gathered_bytes(tcfg, mesh_shape, rules, cast=True)[
        "one_block"] + max(ep_buf["transient"], act["logits"] // (2 * (1 + cfg.mtp.depth)))
    rollout = None
    if run.rollout_rows:  # the sampler on the train state's parameters, next to the train state
        r_dec = decode_state_per_device(tcfg, mesh_shape, run.rollout_rows, run.rollout_len,
                                        rules)
        r_loc = run.rollout_rows // math.prod(
            mesh_shape[x] for x in shd.batch_axes(mesh_shape, run.rollout_rows, rules))
        # the prefill's f32 logits over the whole vocabulary for every prompt position
        r_logits = r_loc * max(run.rollout_prompt_len, 1) * tcfg.vocab_size * 4
        # the sampler's weight gathers are hoisted out of the decode loop: every block's
        # gathered weights live, cast to the compute dtype before the gather
        scfg = quant.mxfp4_config(tcfg) if run.rollout_experts == "mxfp4" else tcfg
        r_copy = (_shard_bytes(_abstract(scfg), mesh_shape, rules)["total"]
                  if run.rollout_experts == "mxfp4" else 0)  # the packed copy (model/quant.py)
        r_gathered = fsdp_gathered_bytes(scfg, mesh_shape, rules, cast=True)["all_blocks"]
        r_program = forward_params + r_copy + r_gathered + r_dec + r_logits
        resident = master + moments + reference  # the train state outside the program
        rollout = {"rows": run.rollout_rows, "len": run.rollout_len,
                   "experts": run.rollout_experts, "train_state": params + resident,
                   "sampler_copy": r_copy, "gathered_weights": r_gathered,
                   "decode_state": r_dec, "logits": r_logits, "program": r_program,
                   **_verdict(r_program + resident, usable)}
    dropped = sorted({f"{p}: {name} ({dim_size}) not divisible by {axis}={size} -> replicated"
                      for p, _, name, axis, size, dim_size in train_report + report})
    summary = sorted({f"{name} ({dim_size}) / {axis}={size}"
                      for _, _, name, axis, size, dim_size in train_report + report})
    warnings = []
    ep = mesh_shape.get("expert", 1)
    if cfg.moe.num_experts and ep > 1 and cfg.moe.num_experts % ep:
        divs = [d for d in range(2, 257) if cfg.moe.num_experts % d == 0][:8]
        warnings.append(
            f"num_experts={cfg.moe.num_experts} is not divisible by expert={ep}: routed experts "
            f"are split over fsdp x expert on d_model instead (ZeRO-3) and moe.expert_parallel "
            f"cannot run on this mesh; use expert in {divs} or pad num_experts")
    if batch % math.prod(mesh_shape[x] for x in ("data", "fsdp", "expert")):
        warnings.append(f"batch {batch} does not split evenly over data x fsdp x expert: "
                        f"split only over {', '.join(baxes) or 'nothing (replicated)'}")
    if ep_buf["rows"] and cfg.moe.dispatch == "dropless" and ep_buf["transient"] > 0.1 * usable:
        routed = cfg.moe.num_experts_per_tok * act["tokens_per_device"]
        warnings.append(
            f"moe.dispatch='dropless' with moe.expert_parallel={cfg.moe.expert_parallel!r}: the "
            f"dispatch buffers of one MoE layer take {fmt_bytes(ep_buf['transient'])} "
            f"({ep_buf['rows']:,d} rows of d_model per device, "
            f"{ep_buf['rows'] / max(routed, 1):.0f}x the {routed:,d} routed assignments), over "
            "10% of the usable memory: use moe.dispatch='capacity'"
            + (" or moe.expert_parallel='ragged_all_to_all'"
               if cfg.moe.expert_parallel == "all_to_all" else ""))
    for what, v in (("training", total[cfg.remat]), ("rollouts", rollout and rollout["total"])):
        if v and v > usable:
            warnings.append(f"{what} does not fit: {fmt_bytes(v)} per device, "
                            f"{fmt_bytes(usable)} usable")
    return {
        "mesh": mesh_shape, "devices": ndev, "device": device, "device_name": dev["name"],
        "hbm_bytes": int(dev["hbm"]), "usable_bytes": int(usable), "headroom": headroom,
        "batch": batch, "seq": seq, "local_batch": b_loc, "run": dataclasses.asdict(run),
        "train": {
            "params_bf16": params, "grads": grads, "grad_accumulator": accum,
            "master_f32": master, "adam_moments_f32": moments, "adam_mu": mu, "adam_nu": nu,
            "reference_policy": reference,
            "remat": cfg.remat,  # the configured policy: "activations" and "total" use it
            "activations": act[cfg.remat],
            "activations_by_policy": {r: act[r] for r in REMAT_NAMES},
            "activations_remat": act["full"], "activations_no_remat": act["none"],
            "activations_save_dots": act["save_dots"],
            "block_residuals_by_policy": act["block_residuals"],
            "dsa_indexer_scores_per_layer": act["dsa_indexer_scores_per_layer"],
            "logits": act["logits"],
            "fsdp_gathered": gathered_live(cfg.remat),
            "ep_buffers": ep_live(cfg.remat),
            "state": state, "step_peak": step_peak(cfg.remat),
            "backward_start": backward_start(cfg.remat), "backward_end": backward_end(cfg.remat),
            "ep_buffer_rows": ep_buf["rows"],
            **_verdict(total[cfg.remat], usable),
            "by_policy": {r: _verdict(total[r], usable) for r in REMAT_NAMES},
            "no_remat": _verdict(total["none"], usable),
        },
        "inference": {
            "params_stored": stored["total"], "decode_state": dec, "logits": dec_logits,
            **_verdict(infer_total, usable),
        },
        "rollout": rollout,
        # per-device totals of the pod programs train/aot.py compiles (arguments + outputs +
        # temporaries - aliased in XLA's memory analysis)
        "programs": {"train_step": total[cfg.remat], "ref_forward": int(ref_forward),
                     "rollout": rollout and rollout["program"]},
        "not_divisible": summary,
        "replicated_dims": dropped,
        "warnings": warnings,
        "assumptions": list(ASSUMPTIONS),
    }


def plan(cfg: ModelConfig, shard_gb: float = 16.5, *, mesh: str | dict | None = None,
         device: str = "h200", batch: int = 256, seq: int = 4096, headroom: float = 0.10,
         rules=None, run: RunPlan | None = None) -> dict:
    """Totals (always) and, with `mesh`, the per-device table under out["per_device"]."""
    out = _plan_totals(cfg, shard_gb)
    if mesh is not None:
        out["per_device"] = per_device_plan(cfg, mesh, device, batch, seq, headroom, rules,
                                            run=run)
    return out


def _plan_totals(cfg: ModelConfig, shard_gb: float = 16.5) -> dict:
    p = count_params(cfg)
    m = cfg.moe
    routed_frac = (m.num_experts_per_tok / m.num_experts) if m.num_experts else 1.0
    active = p["total"] - p["expert"] + int(round(p["expert"] * routed_frac))
    rest = p["total"] - p["expert"]
    bytes_bf16 = 2 * p["total"]
    bytes_mxfp4 = int(p["expert"] * MXFP4_BITS / 8) + 2 * rest
    out = {
        "name": cfg.name,
        "total_params": p["total"],
        "total_params_without_mtp": p["total"] - p["mtp"],
        "mtp_params": p["mtp"],
        "expert_params": p["expert"],
        "active_params": active,
        "bytes_bf16": bytes_bf16,
        "bytes_mxfp4": bytes_mxfp4,
        "shard_bytes": int(shard_gb * 1e9),
        "num_shards": math.ceil(bytes_mxfp4 / (shard_gb * 1e9)),
        "layer_kinds": "".join(cfg.layer_kinds()),
        "decode_state_bytes": {str(s): decode_state_bytes(cfg, s) for s in (1 << 17, 1 << 20)},
    }
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


def _fmt_verdict(what: str, v: dict, usable: int) -> str:
    if v["fits"]:
        return (f"{what}: FITS  {fmt_bytes(v['total'])} of {fmt_bytes(usable)} usable "
                f"({100 * v['utilisation']:.0f}%)")
    return (f"{what}: DOES NOT FIT  needs {fmt_bytes(v['total'])}, usable {fmt_bytes(usable)}: "
            f"over by {fmt_bytes(v['over_by'])} ({v['utilisation']:.2f}x)")


def format_per_device(pd: dict) -> str:
    """The per-device table as text (also used by docs/scaling.md)."""
    mesh = ",".join(f"{a}={s}" for a, s in pd["mesh"].items())
    t, i = pd["train"], pd["inference"]
    lines = [
        f"per device on mesh {mesh} ({pd['devices']} x {pd['device_name']}), "
        f"batch {pd['batch']} x {pd['seq']} tokens (local batch {pd['local_batch']}):",
        f"  {'':34}{'bytes/device':>14}",
        "  training (AdamW)",
        f"    {'params (working copy)':32}{fmt_bytes(t['params_bf16']):>14}",
        f"    {'gradients':32}{fmt_bytes(t['grads']):>14}",
        *([f"    {'micro-batch grad accumulator':32}{fmt_bytes(t['grad_accumulator']):>14}"]
          if t["grad_accumulator"] else []),
        f"    {'f32 master copy':32}{fmt_bytes(t['master_f32']):>14}",
        f"    {'Adam mu + nu':32}{fmt_bytes(t['adam_moments_f32']):>14}",
        *([f"    {'reference policy':32}{fmt_bytes(t['reference_policy']):>14}"]
          if t["reference_policy"] else []),
        f"    {'ZeRO-3 gathered weights':32}{fmt_bytes(t['fsdp_gathered']):>14}",
        *([f"    {'expert-parallel buffers':32}{fmt_bytes(t['ep_buffers']):>14}"]
          if t["ep_buffers"] else []),
        f"    {'activations (remat=' + t['remat'] + ')':32}{fmt_bytes(t['activations']):>14}",
        f"    {'  of which logits':32}{fmt_bytes(t['logits']):>14}",
        f"    {'  DSA indexer scores / layer':32}{fmt_bytes(t['dsa_indexer_scores_per_layer']):>14}",
        f"    {'total':32}{fmt_bytes(t['total']):>14}",
        *[f"    {'(activations, remat=' + r + ')':32}{fmt_bytes(a):>14}"
          for r, a in t["activations_by_policy"].items() if r != t["remat"]],
        "  inference (decode)",
        f"    {'params as stored':32}{fmt_bytes(i['params_stored']):>14}",
        f"    {'decode state':32}{fmt_bytes(i['decode_state']):>14}",
        f"    {'logits':32}{fmt_bytes(i['logits']):>14}",
        f"    {'total':32}{fmt_bytes(i['total']):>14}",
        f"  device HBM {fmt_bytes(pd['hbm_bytes'])}, usable {fmt_bytes(pd['usable_bytes'])} "
        f"(headroom {pd['headroom']:.0%})",
        "  verdict:",
        "    " + _fmt_verdict("training", t, pd["usable_bytes"]) + f"  [remat={t['remat']}]",
        *["    " + _fmt_verdict("training without remat" if r == "none" else
                             f"training with remat={r}", v, pd["usable_bytes"])
          for r, v in t["by_policy"].items() if r != t["remat"]],
        "    " + _fmt_verdict("inference", i, pd["usable_bytes"]),
    ]
    if pd.get("rollout"):
        r = pd["rollout"]
        lines.append("    " + _fmt_verdict(
            f"rollouts next to the train state ({r['rows']} rows x {r['len']} tokens, "
            f"{r['experts']} experts)", r, pd["usable_bytes"]))
        lines.append(f"      train state {fmt_bytes(r['train_state'])}, sampler's MXFP4 copy "
                     f"{fmt_bytes(r['sampler_copy'])}, gathered weights "
                     f"{fmt_bytes(r['gathered_weights'])}, decode state "
                     f"{fmt_bytes(r['decode_state'])}, logits {fmt_bytes(r['logits'])}")
    progs = pd["programs"]
    lines.append("  per-device programs (compare: python -m train.aot): train step "
                 + fmt_bytes(progs["train_step"]) + ", reference forward "
                 + fmt_bytes(progs["ref_forward"])
                 + (", rollout " + fmt_bytes(progs["rollout"]) if progs["rollout"] else ""))
    for w in pd["warnings"]:
        lines.append(f"  warning: {w}")
    if pd["not_divisible"]:
        lines.append("  not split over (mesh axis does not divide the dimension):")
        lines += [f"    {x}" for x in pd["not_divisible"]]
    lines.append("  assumptions:")
    lines += [f"    - {x}" for x in pd["assumptions"]]
    return "\n".join(lines)


def format_compiled_memory(cfg: ModelConfig, batch: int, seq: int) -> str:
    """XLA's memory analysis of the training gradient per remat policy, next to the planner's
    activation estimate for the same batch on one device (kernels as this backend runs them)."""
    tcfg = _training_cfg(cfg)
    measured = compiled_train_memory(tcfg, batch, seq)
    kernels = "xla" if jax.default_backend() == "cpu" else "pallas"
    est = activation_bytes(tcfg, {"data": 1}, batch, seq, kernels=kernels)
    lines = [f"compiled training gradient of {cfg.name}, batch {batch} x {seq} tokens on "
             f"{jax.default_backend()} (XLA_FLAGS={measured['xla_flags']!r}), configured "
             f"remat={cfg.remat}:",
             f"  {'remat':10}{'XLA temp':>14}{'arguments':>14}{'outputs':>14}"
             f"{'planner activations':>22}"]
    for r in REMAT_NAMES:
        m = measured[r]
        lines.append(f"  {r:10}{fmt_bytes(m['temp_size_in_bytes']):>14}"
                     f"{fmt_bytes(m['argument_size_in_bytes']):>14}"
                     f"{fmt_bytes(m['output_size_in_bytes']):>14}{fmt_bytes(est[r]):>22}")
    return "\n".join(lines)
