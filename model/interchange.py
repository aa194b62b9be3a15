"""Checkpoint interchange: model variables <-> sharded safetensors with MXFP4 experts.

The directory layout Hugging Face and gpt-oss users know:

    out/model-00001-of-00004.safetensors ...   tensors, each file at most max_shard_bytes (a
                                               tensor larger than that gets a file of its own)
    out/model.safetensors.index.json            {"metadata": {"total_size": bytes},
                                                 "weight_map": {tensor name: file name}}
    out/config.json                             {"model": the ModelConfig fields (rebuilds it),
                                                 "quantization_config": {...}, ...}

Tensor names are the variables' paths joined by "." (`params.layer_1.moe.w_up_blocks`,
`router_state.layer_1.moe.bias`). Routed experts are written as MXFP4 (`experts="mxfp4"`):
`<name>_blocks` uint8 [E, out, in/32, 16] (two E2M1 codes per byte, low nibble = even element)
and `<name>_scales` uint8 [E, out, in/32] (E8M0, bias 127); float experts are quantised on the
way out (PTQ, the same `model.quant.quantize_kernel` the sampler uses), packed experts are
copied. `experts="bf16"` writes experts as bf16 [E, in, out] instead. Every other tensor keeps
its parameter dtype (`dtype="keep"`: bf16 for a bf16 model such as reference_2p8t, f32 for the
CPU presets, and the router and its bias, f32 in every model) or is cast (`dtype="bfloat16"`).

Streaming: the shard plan comes from shapes alone (`export_specs` + `plan_shards`, also what the
dry run of `scripts/export.py` prints for reference_2p8t from `jax.eval_shape`); export then
fetches, converts and writes one shard at a time, so host memory holds at most one shard's
tensors; import reads one tensor at a time and places it on its device (or mesh sharding).

    export_safetensors(variables, cfg, "out", max_shard_bytes=2 << 30)
    cfg, variables = import_safetensors("out")                    # as stored (packed experts)
    cfg, variables = import_safetensors("out", experts="float")   # dequantised to param dtype

Tensors are per layer whatever the model's layout: a `scan_layers` model's stacked spans
(model/config.py:layer_groups) are written one copy at a time under the per-layer names
(`params.layer_5.ffn.w_up_blocks`, sliced on the device), and import stacks them again when
config.json's scan_layers is set (one jitted program into the given shardings: while it runs,
the spans are held twice, per layer and stacked).

Not covered: multi-process export of arrays no single process can address (gather to one
process first); tensors split across files (a tensor is never split, as in HF's writer); the
gpt-oss / HF module naming (names here are this model's parameter paths).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from model import quant
from model.config import SPAN_NAME_RE, ModelConfig
from pallas_kernels.mxfp4 import ops as mx
from pallas_kernels.mxfp4.reference import BLOCK, PACKED

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
FORMAT = "kimi-posttrain-jax/safetensors"
FORMAT_VERSION = 1
EXPERT_MODES = ("mxfp4", "bf16")
DTYPE_MODES = ("keep", "bfloat16")
_NP_DTYPES = {"uint8": np.uint8, "float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
              "float16": np.float16, "int32": np.int32}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of the export: its name, shape and dtype in the file, the variables leaf it
    comes from and how ("copy", "cast", "blocks"/"scales" (quantise a float expert kernel),
    "dequant" (a packed expert written as bf16))."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: tuple[str, ...]
    kind: str
    index: int | None = None  # the copy of a scanned span's stacked leaf (its leading axis)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(_NP_DTYPES[self.dtype]).itemsize


def tensor_name(path) -> str:
    for p in path:
        if "." in str(p):
            raise ValueError(f"variable path component {p!r} contains '.', which separates "
                             "path components in tensor names")
    return ".".join(str(p) for p in path)


def _dtype_name(d) -> str:
    return jnp.dtype(d).name


def _flat(variables) -> dict:
    return flatten_dict({k: v for k, v in variables.items() if k != "diagnostics"})


def _per_layer(path, shape):
    """[(name path, copy index or None, shape)] of one variables leaf: a leaf of a scanned span
    (`.../layers_<a>_<b>/block_<j>/...`, stacked [r, ...]; model.config.span_name) splits
    into its r copies under per-layer names (`.../layer_<a + t*p + j>/...`, p = (b-a+1)/r)."""
    for k, key in enumerate(path[:-1]):
        m = SPAN_NAME_RE.fullmatch(str(key))
        if m and str(path[k + 1]).startswith("block_"):
            first, last = int(m.group(1)), int(m.group(2))
            r, j = shape[0], int(str(path[k + 1])[6:])
            p = (last - first + 1) // r
            return [(path[:k] + (f"layer_{first + t * p + j}",) + path[k + 2:], t, shape[1:])
                    for t in range(r)]
    return [(path, None, shape)]


def export_specs(variables, *, experts: str = "mxfp4", dtype: str = "keep") -> list[TensorSpec]:
    """The tensors an export writes, in variables order, from arrays or jax.ShapeDtypeStructs
    (so `jax.eval_shape` output plans an export without allocating). Tensors are per layer in
    either layout: a scanned span's stacked leaf is written as one tensor per copy, named as
    the per-layer model names it (`params.layer_5.ffn.w_up_blocks`)."""
    if experts not in EXPERT_MODES:
        raise ValueError(f"experts={experts!r}: must be one of {EXPERT_MODES}")
    if dtype not in DTYPE_MODES:
        raise ValueError(f"dtype={dtype!r}: must be one of {DTYPE_MODES}")
    specs = []
    for src, v in _flat(variables).items():
        vd = _dtype_name(v.dtype)
        for path, index, shape in _per_layer(src, tuple(v.shape)):
            def spec(name_path, sh, dt, kind, src=src, index=index):
                specs.append(TensorSpec(tensor_name(name_path), tuple(sh), dt, src, kind, index))
            base = quant._packed_name(path[-1]) if path[0] == "params" else None
            if path[0] == "params" and quant._is_expert_kernel(path, jax.ShapeDtypeStruct(
                    shape, v.dtype)):
                if experts == "mxfp4":
                    E, d_in, d_out = shape
                    if d_in % BLOCK:
                        raise ValueError(f"{tensor_name(path)}: input dim {d_in} is not a "
                                         f"multiple of 32; export with experts='bf16'")
                    nb = d_in // BLOCK
                    for kind, sh in (("blocks", (E, d_out, nb, PACKED)),
                                     ("scales", (E, d_out, nb))):
                        spec(path[:-1] + (f"{path[-1]}_{kind}",), sh, "uint8", kind)
                    continue
                spec(path, shape, "bfloat16", "cast")
            elif base is not None and experts == "bf16":
                if path[-1].endswith("_blocks"):  # [E, out, nb, 16] -> bf16 [E, in, out]
                    E, d_out, nb, _ = shape
                    spec(path[:-1] + (base,), (E, nb * BLOCK, d_out), "bfloat16", "dequant")
            else:
                is_float = jnp.issubdtype(jnp.dtype(v.dtype), jnp.floating)
                out = "bfloat16" if (dtype == "bfloat16" and is_float) else vd
                spec(path, shape, out, "copy" if out == vd else "cast")
    return specs


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in order: a new file starts when the next tensor would push the current one past
    max_shard_bytes; a tensor larger than that gets a file of its own (tensors are not split)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        shards.append(cur)
    return shards


def shard_file_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_summary(shards: list[list[TensorSpec]]) -> dict:
    """{"files", "total_bytes", "bytes_per_file": [...], "expert_bytes", "other_bytes",
    "largest_tensor": (name, bytes)}."""
    sizes = [sum(s.nbytes for s in sh) for sh in shards]
    flat = [s for sh in shards for s in sh]
    expert = sum(s.nbytes for s in flat if s.kind in ("blocks", "scales", "dequant")
                 or quant._packed_name(s.source[-1]) or s.source[-1] in quant.EXPERT_KEYS
                 and len(s.shape) == 3)
    big = max(flat, key=lambda s: s.nbytes) if flat else None
    return {"files": len(shards), "total_bytes": sum(sizes), "bytes_per_file": sizes,
            "expert_bytes": expert, "other_bytes": sum(sizes) - expert,
            "largest_tensor": (big.name, big.nbytes) if big else None, "tensors": len(flat)}


# --------------------------------------------------------------------------- export
def _materialise(spec: TensorSpec, leaf, cache: dict) -> np.ndarray:
    """The host array of one spec (one leaf fetched; a quantised pair computed once)."""
    if spec.kind == "copy":
        return np.asarray(jax.device_get(leaf))
    if spec.kind == "cast":
        return np.asarray(jax.device_get(_cast(leaf, spec.dtype)))
    if spec.kind in ("blocks", "scales"):
        if cache.get("source") != (spec.source, spec.index):
            q = _quantize_kernel(leaf)
            cache.clear()
            cache.update(source=(spec.source, spec.index), blocks=q.blocks, scales=q.scales)
        return np.asarray(jax.device_get(cache[spec.kind]))
    if spec.kind == "dequant":
        return np.asarray(jax.device_get(leaf))
    raise AssertionError(spec.kind)


_quantize_kernel = jax.jit(quant.quantize_kernel)


@jax.jit
def _dequant_pair(blocks, scales):
    return jnp.swapaxes(mx.dequantize(mx.MXFP4(blocks, scales), jnp.bfloat16), -1, -2)


def _cast(x, dtype: str):
    return jnp.asarray(x).astype(jnp.dtype(dtype))


def config_json(cfg: ModelConfig, specs: list[TensorSpec], *, experts: str, dtype: str,
                high_precision=quant.DEFAULT_HIGH_PRECISION) -> dict:
    """config.json: the exported model's config (expert_format follows what the files hold) and
    the quantisation description (HF's quantization_config keys where they exist)."""
    packed = any(s.name.endswith("_blocks") for s in specs)
    cfg_out = cfg.replace(moe=dataclasses.replace(
        cfg.moe, expert_format="mxfp4" if packed else "bf16", qat=False))
    out = {"format": FORMAT, "format_version": FORMAT_VERSION,
           "model": dataclasses.asdict(cfg_out), "tensor_dtype": dtype}
    if packed:
        out["quantization_config"] = {
            "quant_method": "mxfp4", "block_size": BLOCK,
            "modules_to_not_convert": list(quant.parse_modules(high_precision)),
            "blocks": "uint8 [E, out, in/32, 16], two E2M1 codes per byte, low nibble = even "
                      "element; E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bit 3 = sign)",
            "scales": "uint8 [E, out, in/32], E8M0 exponent, scale = 2**(byte - 127), "
                      "0xFF = NaN",
            "weight": "W[e, i, o] = E2M1(blocks[e, o, i // 32, (i % 32) // 2] nibble i % 2) * "
                      "2**(scales[e, o, i // 32] - 127); the layer computes x @ W[e]",
        }
    return out


def export_safetensors(variables, cfg: ModelConfig, out_dir: str, *,
                       max_shard_bytes: int = 5 << 30, experts: str = "mxfp4",
                       dtype: str = "keep", high_precision=quant.DEFAULT_HIGH_PRECISION,
                       on_shard=None) -> dict:
    """Write `variables` (of a model with config `cfg`) as sharded safetensors under out_dir
    (see module doc). Streams: one shard's tensors on the host at a time. on_shard(i, path,
    nbytes) is called after each file. Returns plan_summary(...) plus "dir"."""
    from safetensors.numpy import save_file

    quant.check_high_precision(high_precision)
    flat = _flat(variables)
    specs = export_specs(variables, experts=experts, dtype=dtype)
    shards = plan_shards(specs, max_shard_bytes)
    names = shard_file_names(len(shards))
    os.makedirs(out_dir, exist_ok=True)
    stale = [f for f in os.listdir(out_dir) if f.endswith(".safetensors") and f not in names]
    if stale:
        raise FileExistsError(f"{out_dir} holds {len(stale)} safetensors file(s) of another "
                              f"export (e.g. {stale[0]}): export into an empty directory")
    weight_map = {}
    for i, (shard, fname) in enumerate(zip(shards, names)):
        cache, tensors = {}, {}
        for s in shard:
            leaf = flat[s.source]
            if s.index is not None:  # one copy of a scanned span (sliced on its device)
                leaf = leaf[s.index]
            if s.kind == "dequant":
                scales = flat[s.source[:-1] + (s.source[-1][:-7] + "_scales",)]
                leaf = _dequant_pair(leaf, scales if s.index is None else scales[s.index])
            arr = _materialise(s, leaf, cache)
            if arr.shape != s.shape or arr.dtype != np.dtype(_NP_DTYPES[s.dtype]):
                raise AssertionError(f"{s.name}: planned {s.shape} {s.dtype}, got {arr.shape} "
                                     f"{arr.dtype}")
            tensors[s.name] = np.ascontiguousarray(arr)
            weight_map[s.name] = fname
        path = os.path.join(out_dir, fname)
        save_file(tensors, path, metadata={"format": "np"})
        if on_shard is not None:
            on_shard(i, path, sum(t.nbytes for t in tensors.values()))
        del tensors, cache
    summary = plan_summary(shards)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": summary["total_bytes"]},
                   "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config_json(cfg, specs, experts=experts, dtype=dtype,
                              high_precision=high_precision), f, indent=2)
    summary["dir"] = out_dir
    return summary


# --------------------------------------------------------------------------- import
def load_config(in_dir: str) -> ModelConfig:
    """The ModelConfig stored in in_dir/config.json."""
    path = os.path.join(in_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: not an export of scripts/export.py")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta.get('format')!r} v{meta.get('format_version')}"
                         f", expected {FORMAT!r} v{FORMAT_VERSION}")
    return ModelConfig.from_dict(meta["model"])


def import_safetensors(in_dir: str, *, experts: str = "stored", shardings=None):
    """Read an export: (ModelConfig, variables). Each tensor is read alone from its file and put
    on the device (or into `shardings`, a tree like the variables, e.g.
    model.sharding.model_shardings of the returned config's model) at the model's parameter
    dtype. experts="stored": as in the files (packed MXFP4 experts stay packed);
    "float": packed experts are dequantised to the model's param_dtype (for training) and the
    returned config has expert_format "bf16". Every tensor the model needs must be present with
    its shape, and nothing else: otherwise ValueError naming the tensor."""
    from safetensors import safe_open

    from model.transformer import Model, stack_layers, unstack_layers

    if experts not in ("stored", "float"):
        raise ValueError(f"experts={experts!r}: must be 'stored' or 'float'")
    cfg = load_config(in_dir)
    with open(os.path.join(in_dir, INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    # the files hold per-layer tensors; a scan_layers model is stacked after reading
    flat_cfg = cfg.replace(scan_layers=False)
    target = _flat(jax.tree.map(lambda x: x, _unbox(Model(flat_cfg).abstract_init())))
    final_shardings = shardings
    if shardings is not None and cfg.scan_layers:  # each copy: its span's minus the lead axis
        shardings = unstack_layers(cfg, shardings, take=lambda sh, _: NamedSharding(
            sh.mesh, PartitionSpec(*tuple(sh.spec)[1:])))
    want = {tensor_name(p): p for p in target}
    extra = sorted(set(weight_map) - set(want))
    missing = sorted(set(want) - set(weight_map))
    if extra or missing:
        what = f"unexpected tensor {extra[0]!r}" if extra else f"missing tensor {missing[0]!r}"
        raise ValueError(f"{in_dir}: {what} ({len(extra)} unexpected, {len(missing)} missing) "
                         f"for the model of its config.json; the files and config.json are "
                         f"from different exports or were edited")
    sh_flat = _flat(shardings) if shardings is not None else {}
    out = {}
    for fname in sorted(set(weight_map.values())):
        with safe_open(os.path.join(in_dir, fname), framework="numpy") as f:
            for name in f.keys():
                if weight_map.get(name) != fname:
                    raise ValueError(f"{fname} holds {name!r}, which the index maps to "
                                     f"{weight_map.get(name)!r}")
                path = want[name]
                t = target[path]
                arr = f.get_tensor(name)
                if tuple(arr.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(arr.shape)} in {fname}, the model "
                                     f"needs {tuple(t.shape)}")
                if arr.dtype != np.dtype(t.dtype):
                    if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype ==
                            ml_dtypes.bfloat16) or not jnp.issubdtype(t.dtype, jnp.floating):
                        raise ValueError(f"{name}: dtype {arr.dtype} in {fname}, the model "
                                         f"needs {t.dtype}")
                    arr = arr.astype(np.dtype(t.dtype))
                sh = sh_flat.get(path)
                out[path] = jax.device_put(arr, sh) if sh is not None else jnp.asarray(arr)
                del arr
    variables = unflatten_dict(out)
    if cfg.scan_layers:
        kw = {} if final_shardings is None else {"out_shardings": final_shardings}
        variables = jax.jit(lambda v: stack_layers(cfg, v), **kw)(variables)
    if experts == "float" and quant.has_packed_experts(variables.get("params", {})):
        pd = jnp.dtype(cfg.param_dtype)
        variables = dict(variables)
        variables["params"] = jax.jit(lambda p: quant.dequantize_experts(p, pd))(
            variables["params"])
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="bf16"))
    return cfg, variables


def _unbox(tree):
    import flax.linen as nn
    return nn.meta.unbox(tree)


def read_with_numpy(in_dir: str) -> dict:
    """Every tensor of an export as numpy arrays via safetensors' numpy loader (no JAX): for
    checks and small models only (it holds the whole model)."""
    from safetensors.numpy import load_file

    with open(os.path.join(in_dir, INDEX_FILE)) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for fname in files:
        out.update(load_file(os.path.join(in_dir, fname)))
    return out
