"""Plan a model without allocating it: parameters, bytes, shards, decode-state memory, and the
per-device memory on a mesh.

    python scripts/plan.py --config configs/models.py:reference_2p8t          # ~20 s on CPU
    python scripts/plan.py --config configs/models.py:reference_2p8t --json
    python scripts/plan.py --config configs/rl.py:grpo_tiny                    # uses config.model
    python scripts/plan.py --config configs/models.py:reference_2p8t \
        --mesh fsdp=16,expert=8,tensor=8 --device h200 --batch 256 --seq 4096   # per-device table

Parameter counts come from `jax.eval_shape` of the real model init (no allocation); decode-state
bytes from the real cache shapes (`Model.init_cache` under eval_shape) for the hybrid layout, and
for an all-DSA and an all-dense-MHA layout of the same width and depth (MHA: dsa.num_heads heads,
K width qk_head_dim, V width v_head_dim, bf16).

Covered: totals (with and without the MTP module), active parameters per token (k routed +
shared experts), bytes in bf16 and with MXFP4 experts (4.25 bits/value: 4-bit elements + one
E8M0 scale per 32), shard count.

Per-device table (--mesh; `per_device_plan`): every parameter is mapped through the same logical
axis rules the runtime uses (model/sharding.py: axes that do not divide a dimension are dropped,
i.e. that dimension is replicated; those dims are listed). Assumptions, also printed:
  * training keeps a working copy of every parameter in its dtype (bf16 for reference_2p8t;
    MXFP4 experts are trained as bf16 with QAT, then re-quantised for the sampler; the router and
    KDA gate parameters are f32), gradients in the same dtypes, an f32 master copy of every
    non-f32 parameter, and AdamW's two f32 moments; all sharded like the parameters (ZeRO-3 over
    fsdp x expert, experts over the expert axis);
  * activations: a documented estimate (`activation_bytes`) for per-block rematerialisation
    (block inputs kept, one block's working set live, forward recompute + backward ~2x), and
    without remat; batch split over rules["batch"] = data x fsdp x expert, heads/mlp/vocab over
    tensor. The DSA indexer scores [B,T,T] f32 are counted as the model materialises them;
  * inference holds the parameters as stored (MXFP4 experts) and the decode state for --batch
    sequences of --seq tokens (batch split as above, KDA heads over tensor);
  * usable memory = device HBM x (1 - --headroom) (XLA workspace, collectives buffers,
    fragmentation).
The verdict says what does not fit and by how much.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from model import sharding as shd  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.transformer import Model  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/models.py:reference_2p8t",
                                          "model config (or a config with a .model field)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object")
_SHARD_GB = flags.DEFINE_float("shard_gb", 16.5, "bytes per checkpoint shard, in GB (1e9)")
_MESH = flags.DEFINE_string("mesh", None, "mesh axis sizes, e.g. expert=64,fsdp=16,tensor=8 "
                            "(axes data,fsdp,expert,tensor; missing axes are 1)")
_DEVICE = flags.DEFINE_enum("device", "h200", ["h200", "b200", "tpu-v5p", "tpu-v6e"],
                            "accelerator for the per-device verdict")
_BATCH = flags.DEFINE_integer("batch", 256, "global batch (sequences) for activations/decode")
_SEQ = flags.DEFINE_integer("seq", 4096, "sequence length (tokens) for activations/decode")
_HEADROOM = flags.DEFINE_float("headroom", 0.10, "fraction of HBM kept free (XLA workspace, "
                               "collective buffers, fragmentation)")

EXPERT_KEYS = ("w_gate", "w_up", "w_down")
MXFP4_BITS = 4.25


def _model_cfg(cfg) -> ModelConfig:
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
    "KDA gate params f32), grads in the param dtype, f32 master of every non-f32 param, AdamW "
    "mu+nu in f32; all sharded like the params",
    "activations: estimate, per-block remat (block inputs kept + one block's working set x2); "
    "DSA indexer scores [B,T,T] f32 counted as materialised",
    "inference: params as stored (MXFP4 experts) + decode state for --batch x --seq",
    "usable = HBM x (1 - headroom)",
)


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
        n = 1
        for i, d in enumerate(x.shape):
            e = spec[i] if i < len(spec) else None
            axes = () if e is None else (e,) if isinstance(e, str) else e
            n *= d // math.prod(mesh_shape[a] for a in axes)
        total += n * x.dtype.itemsize
        elems += n
        elems_f32 += n if x.dtype == jnp.float32 else 0
    return {"total": total, "elements": elems, "elements_f32": elems_f32}


def _training_cfg(cfg: ModelConfig) -> ModelConfig:
    """The config trained: MXFP4 experts become a bf16 (QAT) master."""
    if cfg.moe.expert_format == "mxfp4":
        import dataclasses
        return cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="bf16", qat=True))
    return cfg


def activation_bytes(cfg: ModelConfig, mesh_shape: dict, batch: int, seq: int, rules=None
                     ) -> dict:
    """Estimated activation bytes per device for one training step (documented estimate).

    tokens = local batch x seq (batch split over rules["batch"]); heads/mlp/vocab widths divided
    by the tensor axis when it divides them; a = activation bytes (bf16 2, f32 4).
      block input (kept under per-block remat): tokens x d_model x a, for every block (+ MTP)
      KDA block: qkv pre/post conv 2 x H(2K+V) a, normalised q,k 2HK a, gate f32 4HK, output
        f32 + gated 4HV + 2HV a, chunk states B x ceil(T/chunk) x H x K x V x 4
      DSA block: q_a, q (H(N+R)), absorbed q (H(L+R)), latent kv (L+R), o_lat f32 (HL), o (Hv),
        indexer q (HI DI); indexer scores B x T x T x 4 and top-k indices T x topk x 4 per
        sequence (the model materialises both); sparse attention gathers are query-chunked
        (pallas_kernels/dsa/ops.py budgets) and not counted
      MoE block: router logits/scores/probs 3 x E x 4, dispatch send+recv 2 x k cf D a,
        expert hidden 3 x k cf F a, combine k D a, shared expert 3 x F_shared a
      dense FFN: 3 x dense_dim a;  logits (+ MTP): V x 4 x 2 (logits and their gradient)
    remat = kept block inputs + 2 x the largest block working set + logits;
    no_remat = sum of every block's working set + logits.
    """
    a = jnp.dtype(cfg.dtype).itemsize
    tp = mesh_shape.get("tensor", 1)

    def split(n):  # width divided over tensor when divisible (as the rules would)
        return n / tp if n % tp == 0 else n

    baxes = shd.batch_axes(mesh_shape, batch, rules)
    b_loc = batch // math.prod(mesh_shape[x] for x in baxes)
    tok = b_loc * seq
    D = cfg.d_model
    k, s, m = cfg.kda, cfg.dsa, cfg.moe
    H, K, V = k.num_heads, k.k_dim, k.v_dim
    kda_tok = (2 * split(H * (2 * K + V)) * a + 2 * split(H * K) * a + split(H * K) * 4
               + split(H * V) * 4 + 2 * split(H * V) * a)
    kda = tok * kda_tok + b_loc * math.ceil(seq / k.chunk_size) * split(H) * K * V * 4
    HD, L, R = s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim
    dsa_tok = (s.q_lora_rank * a + split(HD * (s.qk_nope_head_dim + R)) * a
               + split(HD) * (L + R) * a + (L + R) * a + split(HD) * L * 4
               + split(HD * s.v_head_dim) * a + split(s.index_n_heads * s.index_head_dim) * a
               + min(s.index_topk, seq) * 4)
    dsa_scores = b_loc * seq * seq * 4
    dsa = tok * dsa_tok + dsa_scores
    cf = m.capacity_factor if m.dispatch == "capacity" else 1.0
    moe = tok * (3 * m.num_experts * 4 + 2 * m.num_experts_per_tok * cf * D * a
                 + 3 * m.num_experts_per_tok * cf * split(m.expert_dim) * a
                 + m.num_experts_per_tok * D * a
                 + 3 * split(m.expert_dim * m.num_shared_experts) * a) if m.num_experts else 0
    dense = tok * 3 * split(m.dense_dim) * a
    attn = {"K": kda, "D": dsa}
    blocks = [attn[kind] + (moe if cfg.is_moe_layer(i) else dense)
              for i, kind in enumerate(cfg.layer_kinds())]
    blocks += [attn[cfg.mtp.layer_kind] + (moe if m.num_experts else dense)
               for _ in range(cfg.mtp.depth)]
    logits = tok * split(cfg.vocab_size) * 4 * 2 * (1 + cfg.mtp.depth)
    kept = len(blocks) * tok * D * a
    return {
        "local_batch": b_loc,
        "tokens_per_device": tok,
        "block_inputs": kept,
        "largest_block": max(blocks),
        "dsa_indexer_scores_per_layer": dsa_scores,
        "logits": logits,
        "remat": kept + 2 * max(blocks) + logits,
        "no_remat": sum(blocks) + logits,
    }


_CACHE_AXES = {"state": ("batch", "act_heads", None, None), "conv": ("batch", None, "act_heads"),
               "kv": ("batch", "length", None), "k_idx": ("batch", "length", None),
               "lengths": ("batch",)}


def decode_state_per_device(cfg: ModelConfig, mesh_shape: dict, batch: int, seq: int,
                            rules=None) -> int:
    """Decode cache bytes per device for `batch` sequences of `seq` tokens."""
    shapes = jax.eval_shape(lambda: Model(cfg).init_cache(batch, seq))
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        key = str(getattr(path[-1], "key", ""))
        names = _CACHE_AXES.get(key, ("batch",) + (None,) * (x.ndim - 1))
        spec = shd.logical_to_spec(names, x.shape, mesh_shape, rules)
        n = 1
        for i, d in enumerate(x.shape):
            e = spec[i] if i < len(spec) else None
            axes = () if e is None else (e,) if isinstance(e, str) else e
            n *= d // math.prod(mesh_shape[a] for a in axes)
        total += n * x.dtype.itemsize
    return total


def _verdict(need: float, usable: float) -> dict:
    return {"total": int(need), "fits": need <= usable, "over_by": int(max(0, need - usable)),
            "utilisation": need / usable}


def per_device_plan(cfg: ModelConfig, mesh: str | dict, device: str = "h200", batch: int = 256,
                    seq: int = 4096, headroom: float = 0.10, rules=None) -> dict:
    """Per-device memory for training (AdamW) and inference on `mesh` (see module docstring)."""
    mesh_shape = shd.mesh_shape(mesh)
    ndev = math.prod(mesh_shape.values())
    dev = DEVICES[device]
    usable = dev["hbm"] * (1 - headroom)
    report: list = []
    stored = _shard_bytes(_abstract(cfg), mesh_shape, rules, report)
    tcfg = _training_cfg(cfg)
    train_report: list = []
    work = _shard_bytes(_abstract(tcfg), mesh_shape, rules, train_report)
    # gradients in the param dtype; f32 master where params are not f32; Adam mu, nu in f32
    grads = work["total"]
    master = 4 * (work["elements"] - work["elements_f32"])  # f32 leaves are their own master
    moments = 8 * work["elements"]
    act = activation_bytes(tcfg, mesh_shape, batch, seq, rules)
    train_total = work["total"] + grads + master + moments + act["remat"]
    dec = decode_state_per_device(cfg, mesh_shape, batch, seq, rules)
    baxes = shd.batch_axes(mesh_shape, batch, rules)
    b_loc = batch // math.prod(mesh_shape[x] for x in baxes)
    dec_logits = b_loc * cfg.vocab_size * 4
    infer_total = stored["total"] + dec + dec_logits
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
    return {
        "mesh": mesh_shape, "devices": ndev, "device": device, "device_name": dev["name"],
        "hbm_bytes": int(dev["hbm"]), "usable_bytes": int(usable), "headroom": headroom,
        "batch": batch, "seq": seq, "local_batch": b_loc,
        "train": {
            "params_bf16": work["total"], "grads": grads, "master_f32": master,
            "adam_moments_f32": moments, "activations_remat": act["remat"],
            "activations_no_remat": act["no_remat"],
            "dsa_indexer_scores_per_layer": act["dsa_indexer_scores_per_layer"],
            "logits": act["logits"],
            **_verdict(train_total, usable),
            "no_remat": _verdict(train_total - act["remat"] + act["no_remat"], usable),
        },
        "inference": {
            "params_stored": stored["total"], "decode_state": dec, "logits": dec_logits,
            **_verdict(infer_total, usable),
        },
        "not_divisible": summary,
        "replicated_dims": dropped,
        "warnings": warnings,
        "assumptions": list(ASSUMPTIONS),
    }


def plan(cfg: ModelConfig, shard_gb: float = 16.5, *, mesh: str | dict | None = None,
         device: str = "h200", batch: int = 256, seq: int = 4096, headroom: float = 0.10,
         rules=None) -> dict:
    """Totals (always) and, with `mesh`, the per-device table under out["per_device"]."""
    out = _plan_totals(cfg, shard_gb)
    if mesh is not None:
        out["per_device"] = per_device_plan(cfg, mesh, device, batch, seq, headroom, rules)
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


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.2f} {unit}"
        n /= 1000
    return str(n)


def _fmt_verdict(what: str, v: dict, usable: int) -> str:
    if v["fits"]:
        return (f"{what}: FITS  {_fmt_bytes(v['total'])} of {_fmt_bytes(usable)} usable "
                f"({100 * v['utilisation']:.0f}%)")
    return (f"{what}: DOES NOT FIT  needs {_fmt_bytes(v['total'])}, usable {_fmt_bytes(usable)}: "
            f"over by {_fmt_bytes(v['over_by'])} ({v['utilisation']:.2f}x)")


def format_per_device(pd: dict) -> str:
    """The per-device table as text (also used by docs/scaling.md)."""
    mesh = ",".join(f"{a}={s}" for a, s in pd["mesh"].items())
    t, i = pd["train"], pd["inference"]
    lines = [
        f"per device on mesh {mesh} ({pd['devices']} x {pd['device_name']}), "
        f"batch {pd['batch']} x {pd['seq']} tokens (local batch {pd['local_batch']}):",
        f"  {'':34}{'bytes/device':>14}",
        "  training (AdamW)",
        f"    {'params (working copy)':32}{_fmt_bytes(t['params_bf16']):>14}",
        f"    {'gradients':32}{_fmt_bytes(t['grads']):>14}",
        f"    {'f32 master copy':32}{_fmt_bytes(t['master_f32']):>14}",
        f"    {'Adam mu + nu (f32)':32}{_fmt_bytes(t['adam_moments_f32']):>14}",
        f"    {'activations (per-block remat)':32}{_fmt_bytes(t['activations_remat']):>14}",
        f"    {'  of which logits':32}{_fmt_bytes(t['logits']):>14}",
        f"    {'  DSA indexer scores / layer':32}{_fmt_bytes(t['dsa_indexer_scores_per_layer']):>14}",
        f"    {'total':32}{_fmt_bytes(t['total']):>14}",
        f"    {'(activations without remat)':32}{_fmt_bytes(t['activations_no_remat']):>14}",
        "  inference (decode)",
        f"    {'params as stored':32}{_fmt_bytes(i['params_stored']):>14}",
        f"    {'decode state':32}{_fmt_bytes(i['decode_state']):>14}",
        f"    {'logits':32}{_fmt_bytes(i['logits']):>14}",
        f"    {'total':32}{_fmt_bytes(i['total']):>14}",
        f"  device HBM {_fmt_bytes(pd['hbm_bytes'])}, usable {_fmt_bytes(pd['usable_bytes'])} "
        f"(headroom {pd['headroom']:.0%})",
        "  verdict:",
        "    " + _fmt_verdict("training", t, pd["usable_bytes"]),
        "    " + _fmt_verdict("training without remat", t["no_remat"], pd["usable_bytes"]),
        "    " + _fmt_verdict("inference", i, pd["usable_bytes"]),
    ]
    for w in pd["warnings"]:
        lines.append(f"  warning: {w}")
    if pd["not_divisible"]:
        lines.append("  not split over (mesh axis does not divide the dimension):")
        lines += [f"    {x}" for x in pd["not_divisible"]]
    lines.append("  assumptions:")
    lines += [f"    - {x}" for x in pd["assumptions"]]
    return "\n".join(lines)


def main(_):
    cfg = _model_cfg(_CONFIG.value)
    kw = {}
    if _MESH.value:
        kw = dict(mesh=_MESH.value, device=_DEVICE.value, batch=_BATCH.value, seq=_SEQ.value,
                  headroom=_HEADROOM.value)
    out = plan(cfg, _SHARD_GB.value, **kw)
    if _JSON.value:
        print(json.dumps(out))
        return
    print(f"model {out['name']}: {cfg.num_layers} layers '{out['layer_kinds']}', d_model "
          f"{cfg.d_model}, {cfg.moe.num_experts} experts (top-{cfg.moe.num_experts_per_tok})")
    print(f"  total params        {out['total_params']:>20,d}  ({out['total_params'] / 1e12:.3f} T)")
    print(f"    without MTP       {out['total_params_without_mtp']:>20,d}")
    print(f"    routed experts    {out['expert_params']:>20,d}")
    print(f"  active params/token {out['active_params']:>20,d}  ({out['active_params'] / 1e9:.1f} B)")
    print(f"  bytes bf16          {_fmt_bytes(out['bytes_bf16']):>20}")
    print(f"  bytes MXFP4 experts {_fmt_bytes(out['bytes_mxfp4']):>20}  "
          f"-> {out['num_shards']} shards of {_fmt_bytes(out['shard_bytes'])}")
    print("  decode state per sequence:")
    for s, d in out["decode_state_bytes"].items():
        print(f"    {int(s):>8,d} tokens: hybrid {_fmt_bytes(d['hybrid']):>12} | all-DSA "
              f"{_fmt_bytes(d['all_dsa']):>12} | all-MHA {_fmt_bytes(d['all_mha']):>12}")
    if "per_device" in out:
        print(format_per_device(out["per_device"]))


if __name__ == "__main__":
    app.run(main)
