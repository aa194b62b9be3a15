"""import_hf / export_hf: the streaming conversion between a released checkpoint directory and
this model's (ModelConfig, variables). The family modules (model/hf/kimi_linear.py,
model/hf/deepseek_v32.py) supply the config translation and the tensor recipes; this module
checks, reads, places and writes."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from model.config import ModelConfig
from model.hf import deepseek_v32, kimi_linear
from model.hf.safetensors_io import DTYPES, INDEX_FILE, Checkpoint, CheckpointError, write_file

FAMILIES = {kimi_linear.MODEL_TYPE: kimi_linear, deepseek_v32.MODEL_TYPE: deepseek_v32}
FLOAT_DTYPES = {DTYPES[k] for k in ("F32", "BF16", "F16")}
FP8 = DTYPES["F8_E4M3"]
SCALE_SUFFIX = "_scale_inv"
CONFIG_FILE = "config.json"


def read_config(hf_dir: str) -> tuple[dict, object]:
    """(config.json as a dict, its family module); CheckpointError for a missing file or an
    unknown model_type."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{hf_dir}: no {CONFIG_FILE}: not a checkpoint directory")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    mt = raw.get("model_type")
    if mt not in FAMILIES:
        raise CheckpointError(f"config.json: model_type={mt!r} is not supported; supported: "
                              f"{sorted(FAMILIES)}")
    return raw, FAMILIES[mt]


def hf_config(hf_dir: str, *, dtype: str = "float32", param_dtype: str | None = None
              ) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (config.json only)."""
    raw, fam = read_config(hf_dir)
    return fam.to_config(raw, dtype=dtype, param_dtype=param_dtype or dtype)


def check_checkpoint(ckpt: Checkpoint, recipes, fp8_block: tuple[int, int] | None = None,
                     skip: tuple[str, ...] = ()) -> None:
    """Every tensor the recipes need, with its shape and a float dtype, and nothing else. With
    fp8_block (the config's quantization_config), a 2-D weight may be F8_E4M3 with its block
    scales `<name>_scale_inv` [ceil(out/b0), ceil(in/b1)] beside it."""
    want = {}
    for r in recipes:
        for name, shape in zip(r.hf, r.hf_shapes):
            want[name] = shape
    have = ckpt.tensors
    scales = {}
    for name, shape in want.items():
        t = have.get(name)
        if t is None or t.dtype != FP8:
            continue
        sname = name + SCALE_SUFFIX
        if fp8_block is None:
            raise CheckpointError(f"tensor {name!r}: dtype float8_e4m3fn, but config.json has "
                                  "no quantization_config (quant_method fp8) to read it with")
        if len(shape) != 2:
            raise CheckpointError(f"tensor {name!r}: float8 only for 2-D weights, the config "
                                  f"needs {list(shape)}")
        need = [-(-shape[0] // fp8_block[0]), -(-shape[1] // fp8_block[1])]
        st = have.get(sname)
        if st is None:
            raise CheckpointError(f"missing tensor {sname!r}: the block scales of the float8 "
                                  f"weight {name!r}")
        if list(st.shape) != need or st.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {sname!r}: {st.dtype} {list(st.shape)}, the float8 "
                                  f"weight {name!r} needs float {need} ({fp8_block} blocks)")
        scales[sname] = fp8_block
    missing = [n for n in want if n not in have]
    extra = sorted(n for n in set(have) - set(want) - set(scales) if not n.startswith(skip))
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) "
                              f"in {ckpt.dir}")
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in "
                              f"all) in {ckpt.dir}: the model of its config.json has no such "
                              "weight")
    for name, shape in want.items():
        t = have[name]
        if t.shape != tuple(shape):
            raise CheckpointError(f"tensor {name!r}: shape {list(t.shape)} in "
                                  f"{os.path.basename(t.file)}, the config needs {list(shape)}")
        if t.dtype not in FLOAT_DTYPES and not (t.dtype == FP8 and name + SCALE_SUFFIX in
                                                  scales):
            raise CheckpointError(f"tensor {name!r}: dtype {t.dtype} in "
                                  f"{os.path.basename(t.file)}; weights must be F32, BF16 or F16"
                                  " (or F8_E4M3 with block scales)")


def read_weight(ckpt: Checkpoint, name: str, fp8_block: tuple[int, int] | None) -> np.ndarray:
    """One tensor; an F8_E4M3 one dequantised to f32 with its block scales:
    W[i, j] = fp8[i, j] * scale_inv[i // b0, j // b1]."""
    arr = ckpt.read(name)
    if arr.dtype != FP8:
        return arr
    b0, b1 = fp8_block
    s = ckpt.read(name + SCALE_SUFFIX).astype(np.float32)
    s = np.repeat(np.repeat(s, b0, axis=0), b1, axis=1)[:arr.shape[0], :arr.shape[1]]
    return arr.astype(np.float32) * s


def _per_layer_target(cfg: ModelConfig) -> dict:
    import flax.linen as nn  # noqa: PLC0415

    from model.transformer import Model  # noqa: PLC0415 (model.transformer imports layers)

    flat_cfg = cfg.replace(scan_layers=False)
    return flatten_dict(nn.meta.unbox(Model(flat_cfg).abstract_init()))


def skipped_prefixes(hf_dir: str, cfg: ModelConfig, drop_mtp: bool) -> tuple[str, ...]:
    """Tensor-name prefixes an import leaves out: the MTP layers of a checkpoint that has them,
    only when asked (drop_mtp); otherwise CheckpointError naming the field."""
    raw, fam = read_config(hf_dir)
    n = fam.mtp_layers(raw) if hasattr(fam, "mtp_layers") else 0
    if n and not drop_mtp:
        raise CheckpointError(
            f"config.json: num_nextn_predict_layers={n}: the checkpoint holds {n} MTP layer(s) "
            f"(model.layers.{cfg.num_layers}.* on), which this import does not map; pass "
            "drop_mtp=True (scripts/convert.py --drop_mtp) to leave them out, as transformers' "
            "own class does")
    return tuple(f"model.layers.{cfg.num_layers + j}." for j in range(n))


def import_hf(hf_dir: str, *, dtype: str = "float32", param_dtype: str | None = None,
              scan_layers: bool = False, shardings=None, mesh=None, rules=None,
              drop_mtp: bool = False):
    """Read a checkpoint directory (config.json + safetensors) into (ModelConfig, variables).

    dtype: activations ("float32" | "bfloat16"); param_dtype: the parameters' dtype (default
    dtype; the router, its bias, A_log and dt_bias stay f32 as the model declares them).
    scan_layers: the returned config scans repeated layer groups and the per-layer tensors are
    stacked for it. shardings: a NamedSharding tree like the variables (of the returned
    config's layout), or mesh (+ rules): the model's own logical shardings on that mesh
    (model.sharding.model_shardings); each tensor goes straight onto its sharding. drop_mtp:
    leave out the MTP layers of a checkpoint that has them (deepseek_v32's
    num_nextn_predict_layers; without it such a checkpoint is refused).

    Everything is checked before any tensor is read: config.json (CheckpointError naming an
    unsupported model_type or field and its value), then every file's header (a corrupt header
    names its file), then the tensor set (a missing or unexpected tensor, a wrong shape or a
    non-float dtype names the tensor). Then one recipe at a time: its tensors are read (seek +
    read, no map of the file), converted on the host and put on their device, so host memory
    holds one recipe's tensors (one layer's stacked experts at most), not the model."""
    cfg = hf_config(hf_dir, dtype=dtype, param_dtype=param_dtype)
    raw, fam = read_config(hf_dir)
    block = fp8_block_of(fam, raw)
    skip = skipped_prefixes(hf_dir, cfg, drop_mtp)
    ckpt = Checkpoint(hf_dir)
    recipes = fam.recipes(cfg)
    check_checkpoint(ckpt, recipes, block, skip)
    if scan_layers:
        cfg = cfg.replace(scan_layers=True)
    if shardings is None and mesh is not None:
        from model import sharding as shd  # noqa: PLC0415
        from model.transformer import Model  # noqa: PLC0415

        shardings = shd.model_shardings(Model(cfg), mesh, rules)
    final_shardings = shardings
    if shardings is not None and cfg.scan_layers:
        from model.transformer import unstack_layers  # noqa: PLC0415

        shardings = unstack_layers(cfg, shardings, take=lambda sh, _: NamedSharding(
            sh.mesh, PartitionSpec(*tuple(sh.spec)[1:])))
    sh_flat = flatten_dict(shardings) if shardings is not None else {}
    target = _per_layer_target(cfg)
    out = {}
    for r in recipes:
        arrays = r.to_ours([read_weight(ckpt, n, block) for n in r.hf])
        for path, arr in zip(r.ours, arrays):
            t = target[path]
            if tuple(arr.shape) != tuple(t.shape):
                raise AssertionError(f"{path}: recipe gives {arr.shape}, model has {t.shape}")
            arr = np.ascontiguousarray(arr.astype(np.dtype(t.dtype)))
            sh = sh_flat.get(path)
            out[path] = jax.device_put(arr, sh) if sh is not None else jnp.asarray(arr)
        del arrays
    missing = sorted(set(target) - set(out))
    if missing:
        raise AssertionError(f"no recipe fills {'/'.join(missing[0])}")
    variables = unflatten_dict(out)
    if cfg.scan_layers:
        from model.transformer import stack_layers  # noqa: PLC0415

        kw = {} if final_shardings is None else {"out_shardings": final_shardings}
        variables = jax.jit(lambda v: stack_layers(cfg, v), **kw)(variables)
    return cfg, variables


def _hf_dtype(arr_dtype, dtype: str | None):
    if dtype is None:
        return np.dtype(arr_dtype)
    return np.dtype(jnp.dtype(dtype))


TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def export_hf(cfg: ModelConfig, variables, out_dir: str, *, dtype: str | None = None,
              max_shard_bytes: int = 5 << 30, extra: dict | None = None) -> dict:
    """Write (cfg, variables) as a checkpoint directory of cfg's family (config.json,
    model.safetensors or model-0000i-of-0000n.safetensors + index), loadable by transformers'
    from_pretrained. dtype: the tensors' dtype ("float32" | "bfloat16"; None: each variable's
    own). extra: config.json fields to add that the ModelConfig does not hold, only the
    token ids (TOKEN_FIELDS, e.g. `token_ids(hf_dir)` of the imported checkpoint; default None).
    Streams one recipe's tensors at a time (a scanned span's copy is sliced on its
    device). The directory must not hold safetensors files already; nothing is written when
    the config cannot be expressed (CheckpointError naming the field). Returns {"files",
    "tensors", "bytes", "dir"}."""
    from model.transformer import unstack_layers  # noqa: PLC0415

    fam = family_of(cfg)
    hf_cfg = fam.from_config(cfg)
    for k, val in (extra or {}).items():
        if k not in TOKEN_FIELDS:
            raise CheckpointError(f"export_hf extra={{{k!r}: ...}}: only {TOKEN_FIELDS} may be "
                                  "added; the rest of config.json follows from the ModelConfig")
        hf_cfg[k] = val
    flat_cfg = cfg.replace(scan_layers=False)
    recipes = fam.recipes(flat_cfg)
    if os.path.isdir(out_dir) and any(f.endswith(".safetensors") for f in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} holds safetensors files: export into an empty "
                              "directory")
    # per-layer views: a scanned span's copy t is leaf[t], taken lazily per recipe
    per_layer = flatten_dict(unstack_layers(cfg, variables, take=lambda x, t: (x, t))
                             if cfg.scan_layers else variables)
    # plan: names, shapes, dtypes, and which recipe makes each tensor
    plan = []
    for ri, r in enumerate(recipes):
        leaf_dt = _leaf(per_layer, r.ours[0]).dtype
        for j, (name, shape) in enumerate(zip(r.hf, r.hf_shapes)):
            plan.append((name, tuple(shape), _hf_dtype(leaf_dt, dtype), ri, j))
    shards, cur, size = [], [], 0
    for e in plan:
        nb = math.prod(e[1]) * e[2].itemsize
        if cur and size + nb > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += nb
    shards.append(cur)
    os.makedirs(out_dir, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    made: dict = {}  # the current recipe's converted tensors

    def producer(ri, j, dt):
        def produce():
            if made.get("ri") != ri:
                r = recipes[ri]
                leaves = [np.asarray(jax.device_get(_take(per_layer, p))) for p in r.ours]
                made.clear()
                made.update(ri=ri, arrays=r.to_hf(leaves))
            return np.ascontiguousarray(made["arrays"][j].astype(dt))
        return produce

    total, weight_map = 0, {}
    for fname, shard in zip(names, shards):
        total += write_file(os.path.join(out_dir, fname),
                            [(n, s, dt, producer(ri, j, dt)) for n, s, dt, ri, j in shard],
                            metadata={"format": "pt"})
        weight_map.update({e[0]: fname for e in shard})
    made.clear()
    if len(shards) > 1:
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2)
    if dtype is not None:
        hf_cfg["dtype"] = dtype
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    return {"files": len(shards), "tensors": len(plan), "bytes": total, "dir": out_dir}


def token_ids(hf_dir: str) -> dict:
    """The token-id fields (TOKEN_FIELDS) of a checkpoint's config.json, for export_hf(extra=)."""
    raw, _ = read_config(hf_dir)
    return {k: raw[k] for k in TOKEN_FIELDS if k in raw}


def fp8_block_of(fam, raw: dict):
    """The FP8 weight block a family's config.json declares (None: no FP8 weights)."""
    return fam.fp8_block(raw) if hasattr(fam, "fp8_block") else None


def family_of(cfg: ModelConfig):
    fam = FAMILIES.get(cfg.name)
    if fam is None:
        raise CheckpointError(f"model.name={cfg.name!r}: export_hf writes the layouts "
                              f"{sorted(FAMILIES)}; the config's name says which (an imported "
                              "config keeps it)")
    return fam


def _leaf(flat, path):
    x = flat[path]
    return x[0] if isinstance(x, tuple) else x


def _take(flat, path):
    x = flat[path]
    if isinstance(x, tuple):
        arr, t = x
        return arr[t]
    return x
