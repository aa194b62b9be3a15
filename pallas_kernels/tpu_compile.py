"""Every Pallas TPU kernel compiled by the real TPU compiler, ahead of time, on a CPU host.

    python -m pallas_kernels.check --target=tpu:v5p                        # tiny, small, reference
    python -m pallas_kernels.check --target=tpu:v5p --presets tiny --json OUT.json

Needs libtpu (`pip install -e '.[tpu]'`): `jax.experimental.topologies.get_topology_desc` then
describes a TPU slice (no TPU attached) whose devices `jax.jit(f).lower(...).compile()` compiles
for, with the compiled program's memory and cost analysis. Run with JAX_PLATFORMS=cpu (the check's
command line sets it): without it, importing jax with libtpu present probes for a local TPU
(warnings, and a slower start) before falling back to the CPU.

Cases (`cases(preset)`): one kernel entry point at one per-device shape of a model preset
(configs/models.py; its kernel dimensions `PRESET_SHAPES`, plain numbers, which
tests/pallas_kernels/test_tpu_compile.py holds equal to `model.aot.kernel_shapes` of the preset's
config; a caller may pass its own `KernelShapes`: this module imports nothing from model/ or
configs/), through the same `ops.py` functions and block-config heuristics the model's
layers call (impl="pallas", kernel="tpu", interpret=False: what impl="auto" runs on a TPU):
  kda            ops.kda, [B,T,H,K/V] with the preset's KDA heads over the tensor axis
  dsa_indexer    ops.indexer_scores, the preset's indexer heads over the tensor axis, S = T
  dsa_attention  ops.sparse_attention_with_lse, absorbed MLA (D = kv_lora_rank + rope dim,
                 v_dim = kv_lora_rank), the preset's heads over tensor, top-k = index_topk
  mxfp4_grouped  ops.grouped_mxfp4_matmul, the routed experts of one device (experts over the
                 expert axis, expert_dim over tensor): gate/up (K = d_model) and down
                 (K = expert_dim) at M = B*T*k rows (sequence) and M = 32*k (decode rows)
  mxfp4_matmul   ops.mxfp4_matmul vmapped over the device's experts (the capacity dispatch of
                 model/layers/moe.py) at capacity rows ceil(1.25 * B*T*k / E)
Each is compiled forward ("fwd") and as value_and_grad of the sum of its float outputs ("bwd";
MXFP4: w.r.t. the activations only), inside `shard_map` over every device of the topology (the
per-device shape is what one device's kernel sees; a Mosaic call cannot be partitioned
automatically), under `jax.set_mesh` so Pallas' chip queries answer for the target chip.

Per-device shapes (`PRESETS`): the mesh each preset is sliced for (reference_2p8t: the RL
reference config's multihost_slice, tensor=4 and expert=8) and B x T per device.

Per row: ok / the compiler's error; the program's HBM memory analysis (arguments, outputs,
temporaries); the scoped VMEM the Mosaic kernels use and were granted (`used_scoped_memory_configs`
and `scoped_memory_configs` of every tpu_custom_call in the compiled HLO, memory space 1; the
largest) next to the chip's VMEM; XLA's
cost analysis (flops, bytes accessed: for a Mosaic call only what its pallas_call's cost estimate
says, so the forward flops of kernels without one are the surrounding XLA ops' alone). A row also
fails when its program holds no tpu_custom_call (the Pallas path was not taken).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
import traceback
from collections.abc import Callable

KERNEL_NAMES = ("kda", "dsa_indexer", "dsa_attention", "mxfp4_matmul", "mxfp4_grouped")
MODES = ("fwd", "bwd")
# --target -> topology name (get_topology_desc); the check compiles over every device of it
TARGETS = {"tpu:v5p": "v5p:2x2x1", "tpu:v5e": "v5e:2x2", "tpu:v6e": "v6e:2x2"}
# Slice names (TensorCores, as the cloud names them; one v5p chip = 2 cores = one JAX device)
# -> topology names.
SLICES = {"v5p-8": "v5p:2x2x1", "v5p-64": "v5p:2x4x4", "v5p-128": "v5p:4x4x4",
          "v5p-512": "v5p:4x8x8", "v5p-1024": "v5p:8x8x8"}
DECODE_ROWS = 32  # decode rows per device for the MXFP4 decode shapes


@dataclasses.dataclass(frozen=True)
class PresetSlice:
    """How a model preset's kernels are sliced onto one device: `tensor` splits heads and expert
    widths, `expert` the routed experts; batch x seq tokens per device."""

    tensor: int = 1
    expert: int = 1
    batch: int = 1
    seq: int = 512


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """The model dimensions the kernels see (whole model, before any device split): compute
    dtype and d_model; KDA heads, key/value widths and chunk; DSA indexer heads and width,
    attention heads, MLA kv_lora_rank, rope and q/k head widths, top-k; routed experts, their
    width and k per token."""

    dtype: str
    d_model: int
    kda_heads: int
    kda_k_dim: int
    kda_v_dim: int
    kda_chunk: int
    index_heads: int
    index_head_dim: int
    heads: int
    kv_lora_rank: int
    rope_dim: int
    qk_head_dim: int
    index_topk: int
    experts: int
    expert_dim: int
    experts_per_tok: int


# configs/models.py's presets as the kernels see them (model.aot.kernel_shapes builds the same
# from a ModelConfig; tests/pallas_kernels/test_tpu_compile.py holds the two equal)
PRESET_SHAPES = {
    "tiny": KernelShapes("float32", 128, 2, 64, 64, 64, 2, 32, 2, 64, 16, 48, 64, 8, 128, 2),
    "small": KernelShapes("bfloat16", 1024, 8, 128, 128, 64, 8, 64, 8, 256, 32, 96, 512, 32, 512,
                          4),
    "reference_2p8t": KernelShapes("bfloat16", 7168, 64, 128, 128, 64, 64, 128, 64, 512, 64, 192,
                                   2048, 1000, 2048, 8),
}

PRESETS = {
    "tiny": PresetSlice(seq=512),
    "small": PresetSlice(seq=4096),
    # configs/rl.py:reference: multihost_slice (fsdp=-1, expert=8, tensor=4); RL rows of
    # 1024 prompt + 3072 new tokens
    "reference_2p8t": PresetSlice(tensor=4, expert=8, seq=4096),
}


def require_libtpu() -> None:
    """Raise a clear error when libtpu (the TPU compiler) is not installed."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError("libtpu is not installed: the TPU compiler comes with it; install the "
                           "[tpu] extra (pip install -e '.[tpu]', jax[tpu] at the repo's jax "
                           "version) in a virtual environment of its own")


def topology_name(name: str) -> str:
    """A --target ("tpu:v5p"), a slice name ("v5p-64") or a topology name ("v5p:2x4x4") ->
    the topology name."""
    if name in TARGETS:
        return TARGETS[name]
    if name in SLICES:
        return SLICES[name]
    if ":" in name and not name.startswith("tpu:"):
        return name
    raise ValueError(f"unknown TPU target {name!r}: use one of {sorted(TARGETS)}, a slice name "
                     f"{sorted(SLICES)} or a topology name such as 'v5p:2x2x1'")


@functools.lru_cache(maxsize=8)
def topology_devices(name: str) -> tuple:
    """The devices of a TPU topology (no TPU needed; libtpu must be installed)."""
    require_libtpu()
    import os  # noqa: PLC0415

    from jax.experimental import topologies  # noqa: PLC0415

    # libtpu takes a lock file so that one process owns a local TPU; nothing here runs on one,
    # so several compiling processes (pytest workers) may load it at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    return tuple(topologies.get_topology_desc(platform="tpu",
                                              topology_name=topology_name(name)).devices)


def tpu_mesh(topology: str, shape: dict[str, int] | None = None):
    """A Mesh over a topology's devices; shape None -> one axis "d" over all of them."""
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415

    devs = topology_devices(topology)
    shape = shape or {"d": len(devs)}
    n = math.prod(shape.values())
    if n != len(devs):
        raise ValueError(f"mesh {shape} has {n} devices; topology {topology!r} has {len(devs)}")
    return Mesh(np.array(devs).reshape(tuple(shape.values())), tuple(shape))


# ------------------------------------------------------------------------------------------------
# Cases.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel entry point at one per-device shape. fn(*args) on per-device arrays; args:
    per-device ShapeDtypeStructs (pytrees allowed; every leaf is split on its leading dim over
    the mesh); argnums: what the backward differentiates."""

    kernel: str
    preset: str
    name: str
    fn: Callable
    args: tuple
    argnums: tuple[int, ...]

    @property
    def id(self) -> str:
        return f"{self.preset}/{self.kernel}:{self.name}"


def _sds(shape, dtype):
    import jax  # noqa: PLC0415

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _split(n: int, ways: int) -> int:
    return n // ways if n % ways == 0 else n  # the runtime's rule: an axis that does not divide
    # a dimension is skipped (model/sharding.py)


def _kda_case(preset, cfg, sl) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.kda import ops  # noqa: PLC0415

    B, T, H, K, V = (sl.batch, sl.seq, _split(cfg.kda_heads, sl.tensor), cfg.kda_k_dim,
                     cfg.kda_v_dim)
    dt = jnp.dtype(cfg.dtype)

    def f(q, k, v, g, beta, h0):
        return ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                       chunk_size=cfg.kda_chunk, impl="pallas", kernel="tpu", interpret=False)

    args = (_sds((B, T, H, K), dt), _sds((B, T, H, K), dt), _sds((B, T, H, V), dt),
            _sds((B, T, H, K), dt), _sds((B, T, H), dt), _sds((B, H, K, V), jnp.float32))
    return [Case("kda", preset, f"B{B}_T{T}_H{H}_K{K}_V{V}_{dt.name}", f, args,
                 (0, 1, 2, 3, 4, 5))]


def _dsa_cases(preset, cfg, sl) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.dsa import ops  # noqa: PLC0415

    B, T = sl.batch, sl.seq
    HI, Di = _split(cfg.index_heads, sl.tensor), cfg.index_head_dim
    H, D, L = _split(cfg.heads, sl.tensor), cfg.kv_lora_rank + cfg.rope_dim, cfg.kv_lora_rank
    topk = cfg.index_topk
    dt = jnp.dtype(cfg.dtype)
    scale = float(cfg.qk_head_dim ** -0.5)

    def indexer(qi, ki, w):
        return ops.indexer_scores(qi, ki, w, impl="pallas", kernel="tpu", interpret=False)

    def attention(q, kv, idx):
        return ops.sparse_attention_with_lse(q, kv, idx, scale=scale, v_dim=L, impl="pallas",
                                             kernel="tpu", interpret=False)

    return [
        Case("dsa_indexer", preset, f"B{B}_T{T}_S{T}_HI{HI}_D{Di}_{dt.name}", indexer,
             (_sds((B, T, HI, Di), dt), _sds((B, T, Di), dt), _sds((B, T, HI), jnp.float32)),
             (0, 1, 2)),
        Case("dsa_attention", preset, f"B{B}_T{T}_S{T}_H{H}_D{D}_v{L}_k{topk}_{dt.name}",
             attention, (_sds((B, T, H, D), dt), _sds((B, T, D), dt),
                         _sds((B, T, topk), jnp.int32)), (0, 1)),
    ]


def _mx_weight(e, n, k):
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.mxfp4.reference import MXFP4  # noqa: PLC0415

    return MXFP4(_sds((e, n, k // 32, 16), jnp.uint8), _sds((e, n, k // 32), jnp.uint8))


def _mxfp4_cases(preset, cfg, sl) -> list[Case]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.mxfp4 import ops  # noqa: PLC0415
    from pallas_kernels.mxfp4.reference import MXFP4  # noqa: PLC0415

    E, F, D, k = (_split(cfg.experts, sl.expert), _split(cfg.expert_dim, sl.tensor), cfg.d_model,
                  cfg.experts_per_tok)
    dt = jnp.dtype(cfg.dtype)

    def grouped(x, w, gs):
        return ops.grouped_mxfp4_matmul(x, w, gs, impl="pallas", kernel="tpu", interpret=False)

    def capacity(xs, w):
        return jax.vmap(lambda xe, be, se: ops.mxfp4_matmul(
            xe, MXFP4(be, se), impl="pallas", kernel="tpu", interpret=False))(
                xs, w.blocks, w.scales)

    out = []
    for rows_name, M in (("seq", sl.batch * sl.seq * k), ("decode", DECODE_ROWS * k)):
        for proj, (n, kk) in (("up", (F, D)), ("down", (D, F))):
            out.append(Case("mxfp4_grouped", preset, f"{proj}_{rows_name}_M{M}_E{E}_N{n}_K{kk}",
                            grouped, (_sds((M, kk), dt), _mx_weight(E, n, kk),
                                      _sds((E,), jnp.int32)), (0,)))
    C = -(-5 * sl.batch * sl.seq * k // (4 * E))  # capacity_factor 1.25
    for proj, (n, kk) in (("up", (F, D)), ("down", (D, F))):
        out.append(Case("mxfp4_matmul", preset, f"capacity_{proj}_E{E}_C{C}_N{n}_K{kk}",
                        capacity, (_sds((E, C, kk), dt), _mx_weight(E, n, kk)), (0,)))
    return out


_BUILDERS = {"kda": _kda_case, "dsa": _dsa_cases, "mxfp4": _mxfp4_cases}


def cases(preset: str, kernels=KERNEL_NAMES, shapes: KernelShapes | None = None) -> list[Case]:
    """The cases of one model preset (`PRESETS`: its per-device slice) for the named kernels, in
    KERNEL_NAMES order; shapes: the model's dimensions (default `PRESET_SHAPES[preset]`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    unknown = sorted(set(kernels) - set(KERNEL_NAMES))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; valid: {list(KERNEL_NAMES)}")
    cfg = shapes or PRESET_SHAPES[preset]
    sl = PRESETS[preset]
    every = [c for b in _BUILDERS.values() for c in b(preset, cfg, sl)]
    return [c for k in KERNEL_NAMES if k in kernels for c in every if c.kernel == k]


# ------------------------------------------------------------------------------------------------
# Compile and report.
# ------------------------------------------------------------------------------------------------

_SCOPED = {key: re.compile(rf'"{key}":\[(.*?)\]')
           for key in ("scoped_memory_configs", "used_scoped_memory_configs")}
_SIZE = re.compile(r'"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"')


def mosaic_vmem(hlo_text: str) -> dict:
    """From a compiled TPU program's HLO text: how many Mosaic kernels (tpu_custom_call) it
    holds, the most scoped VMEM (memory space 1) one of them uses (`used_scoped_memory_configs`)
    and the largest limit one was granted (`scoped_memory_configs`; 0: the compiler's default,
    no vmem_limit_bytes in the kernel's compiler params), in bytes."""
    calls = [ln for ln in hlo_text.splitlines() if 'custom_call_target="tpu_custom_call"' in ln]
    out = {"mosaic_calls": len(calls), "vmem_used_bytes": 0, "vmem_limit_bytes": 0}
    for ln in calls:
        for key, field in (("used_scoped_memory_configs", "vmem_used_bytes"),
                           ("scoped_memory_configs", "vmem_limit_bytes")):
            m = _SCOPED[key].search(ln)
            if m is None:
                continue
            for space, size in _SIZE.findall(m.group(1)):
                if space == "1":
                    out[field] = max(out[field], int(size))
    return out


def _global(mesh, args):
    """Per-device ShapeDtypeStructs -> global ones split on the leading dim over the mesh."""
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    n = mesh.size
    axes = tuple(mesh.axis_names)

    def g(s):
        return jax.ShapeDtypeStruct((n * s.shape[0], *s.shape[1:]), s.dtype,
                                    sharding=NamedSharding(mesh, P(axes)))

    return jax.tree.map(g, args)


def program(case: Case, mesh, mode: str) -> Callable:
    """The jitted program of one case: the op under shard_map over every mesh device (each leaf
    split on its leading dim), forward or value_and_grad of the sum of the float outputs."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    spec = P(tuple(mesh.axis_names))
    in_specs = jax.tree.map(lambda _: spec, case.args)
    out_specs = jax.tree.map(lambda _: spec, jax.eval_shape(case.fn, *case.args))
    f = jax.shard_map(case.fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=False)
    if mode == "fwd":
        return jax.jit(f)

    def loss(*args):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(f(*args))
                   if jnp.issubdtype(o.dtype, jnp.floating))

    return jax.jit(jax.value_and_grad(loss, argnums=case.argnums))


def compile_case(case: Case, mesh, mode: str) -> dict:
    """Compile one case for the mesh's TPU devices; -> a row (see the module docstring)."""
    import jax  # noqa: PLC0415

    from pallas_kernels import backend  # noqa: PLC0415

    row = {"preset": case.preset, "kernel": case.kernel, "name": case.name, "mode": mode,
           "devices": mesh.size, "device_kind": mesh.devices.flat[0].device_kind}
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh), backend.target_platform("tpu"):
            compiled = program(case, mesh, mode).lower(*_global(mesh, case.args)).compile()
        ma = compiled.memory_analysis()
        ca = compiled.cost_analysis() or {}
        row.update(mosaic_vmem(compiled.as_text()))
        row.update(
            argument_bytes=ma.argument_size_in_bytes, output_bytes=ma.output_size_in_bytes,
            temp_bytes=ma.temp_size_in_bytes, alias_bytes=ma.alias_size_in_bytes,
            flops=float(ca.get("flops", 0.0)), bytes_accessed=float(ca.get("bytes accessed", 0.0)))
        row["ok"] = row["mosaic_calls"] > 0
        row["error"] = None if row["ok"] else "no Mosaic kernel (tpu_custom_call) in the program"
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:4000],
                   traceback=traceback.format_exc(limit=8)[-4000:])
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def chip_vmem_bytes(mesh) -> int | None:
    """The target chip's VMEM per TensorCore (Pallas' table), or None when unknown."""
    import jax  # noqa: PLC0415
    from jax._src.pallas.mosaic import tpu_info  # noqa: PLC0415

    try:
        with jax.set_mesh(mesh):
            return tpu_info.get_tpu_info().vmem_capacity_bytes
    except Exception:  # noqa: BLE001 (an unknown chip: the column stays empty)
        return None


def run(target: str = "tpu:v5p", presets=tuple(PRESETS), kernels=KERNEL_NAMES, modes=MODES,
        verbose: bool = True) -> list[dict]:
    """Compile every case of the presets for `target`; -> rows."""
    mesh = tpu_mesh(target)
    rows = []
    for preset in presets:
        for case in cases(preset, kernels):
            for mode in modes:
                r = compile_case(case, mesh, mode)
                rows.append(r)
                if verbose:
                    print(format_row(r), flush=True)
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:.1f}"


def format_row(r: dict) -> str:
    head = f"{r['preset']:<15}{r['kernel']:<14}{r['name']:<44}{r['mode']:<4}"
    if not r["ok"]:
        return head + f" NO   {r['seconds']:6.1f}s {r['error']}"
    limit = _mib(r["vmem_limit_bytes"]) if r["vmem_limit_bytes"] else "dflt"
    return (head + f" yes  {r['seconds']:6.1f}s {_mib(r['vmem_used_bytes']):>7} {limit:>6} "
            f"{_mib(r['argument_bytes']):>9} {_mib(r['temp_bytes']):>9} "
            f"{r['flops'] / 1e9:>10.2f} {r['bytes_accessed'] / 1e9:>9.3f}")


def format_table(rows: list[dict], vmem_capacity: int | None = None) -> str:
    head = (f"{'preset':<15}{'kernel':<14}{'shape (per device)':<44}{'mode':<4} ok   "
            f"{'compile':>7} {'VMEM MiB':>7} {'limit':>6} {'args MiB':>9} {'temp MiB':>9} {'GFLOP':>10} "
            f"{'GB acc.':>9}")
    lines = [head, "-" * len(head), *map(format_row, rows)]
    kinds = sorted({r["device_kind"] for r in rows})
    ok = sum(r["ok"] for r in rows)
    cap = f"; the chip has {_mib(vmem_capacity)} MiB VMEM per core" if vmem_capacity else ""
    lines.append(f"{ok}/{len(rows)} compiled for {', '.join(kinds)} ({rows[0]['devices']} "
                 f"devices, shard_map) by the TPU compiler; VMEM = the most scoped VMEM a "
                 f"Mosaic kernel uses (used_scoped_memory_configs), limit = the largest granted "
                 f"(dflt: the compiler's default){cap}; args/temp = per-device HBM (memory "
                 f"analysis); GFLOP / GB accessed = XLA's cost analysis")
    return "\n".join(lines)


def main(target: str, presets, kernels, modes, json_path: str | None = None) -> int:
    rows = run(target, presets, kernels, modes)
    print(format_table(rows, chip_vmem_bytes(tpu_mesh(target))), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["ok"] for r in rows) else 1
