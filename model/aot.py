"""Model-level pieces of compiling for a TPU slice ahead of time on a CPU host (needs libtpu for
the compile itself): a run's mesh laid over a topology's devices, a slice's topology name for a
device count, one program's compile and its memory analysis, the fit in HBM, and the kernel
dimensions of a model config.

The RL pod programs (train step, rollout, reference forward) are compiled by train/aot.py, which
builds them with the RL loop's functions; pallas_kernels/tpu_compile.py compiles the kernels.
This module imports nothing from rl/ or configs/.

Memory (`memory_row`): per device, arguments, outputs, temporaries and aliased bytes from
`Compiled.memory_analysis()`, total = arguments + outputs + temporaries - aliased (the measure
the planner is held to); XLA's flops and bytes accessed. `fits(total, hbm)` compares with HBM.
"""

from __future__ import annotations

import math
import time
import traceback

from model.config import ModelConfig
from pallas_kernels import tpu_compile

# HBM per JAX device (one chip; v5p and v4 chips are one megacore device)
HBM_BYTES = {"TPU v5": 95 * 2**30, "TPU v5p": 95 * 2**30, "TPU v4": 32 * 2**30,
             "TPU v5 lite": 16 * 2**30, "TPU v6 lite": 32 * 2**30}
# planner device name (model/plan.py:DEVICES) -> the TPU generation of its topology names
TPU_GENERATIONS = {"tpu-v5p": "v5p", "tpu-v6e": "v6e"}


def slice_topology(device: str, chips: int) -> str | None:
    """The topology name of a slice of `chips` chips of a planner TPU device ("tpu-v5p",
    "tpu-v6e"), as the cloud shapes them: v5p a 3-D torus from 2x2x1 doubling its smallest
    axis (8 -> 2x2x2, 512 -> 8x8x8, 2048 -> 8x16x16), v6e a 2-D grid from 1x1 (256 -> 16x16).
    None for a device that is not a TPU, or a chip count no slice has (not a power of two; v5p
    below 4 chips, v6e above 256)."""
    gen = TPU_GENERATIONS.get(device)
    if gen is None or chips < 1 or chips & (chips - 1):
        return None
    if gen == "v5p":
        if chips < 4:
            return None
        dims = [2, 2, 1]
        while math.prod(dims) < chips:
            i = min(range(3), key=lambda j: (dims[j], -j))  # the smallest axis, the last of ties
            dims[i] *= 2
        return "v5p:" + "x".join(map(str, dims))
    if chips > 256:
        return None
    dims = [1, 1]
    while math.prod(dims) < chips:
        dims[0 if dims[0] < dims[1] else 1] *= 2
    return "v6e:" + "x".join(map(str, dims))


def topology_mesh(run_config, devices) -> tuple:
    """(mesh, rules, mesh_error) of a run config's `sharding` laid over a topology's devices.
    When jax.make_mesh cannot lay the mesh on the physical torus (an axis size that would split
    a physical axis, e.g. fsdp=16 on v5p:8x8x8), mesh_error holds its message and the devices
    are taken in order instead (the memory analysis does not depend on which device holds which
    shard; the launch would fail there the same way)."""
    import numpy as np  # noqa: PLC0415
    from jax.sharding import AxisType, Mesh  # noqa: PLC0415

    from model import sharding as shd  # noqa: PLC0415

    try:
        mesh, rules = shd.mesh_from_config(run_config, devices=list(devices))
        return mesh, rules, None
    except NotImplementedError as e:
        error = f"{type(e).__name__}: {e}"[:600]
    full = shd.mesh_shape(shd.parse_mesh(run_config.sharding.mesh), len(devices))
    mesh = Mesh(np.array(devices).reshape(tuple(full[a] for a in shd.MESH_AXES)),
                shd.MESH_AXES, axis_types=(AxisType.Auto,) * len(shd.MESH_AXES))
    return mesh, shd.rules_from_config(run_config), error


def memory_row(compiled) -> dict:
    """A compiled program's per-device memory and cost analysis (see the module docstring)."""
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis() or {}
    out = {"argument_bytes": ma.argument_size_in_bytes, "output_bytes": ma.output_size_in_bytes,
           "temp_bytes": ma.temp_size_in_bytes, "alias_bytes": ma.alias_size_in_bytes,
           "flops": float(ca.get("flops", 0.0)),
           "bytes_accessed": float(ca.get("bytes accessed", 0.0))}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                          - out["alias_bytes"])
    return out


def compile_program(lower, mesh) -> dict:
    """lower() -> jax Lowered; trace it under `jax.set_mesh(mesh)` (Pallas' chip queries then
    answer for the mesh's TPU), compile it and report: ok or the compiler's error, memory_row,
    the Mosaic calls in the program, compile seconds."""
    import jax  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = lower()
        compiled = lowered.compile()
        row = {"ok": True, "error": None, **memory_row(compiled)}
        row["mosaic_calls"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
               "traceback": traceback.format_exc(limit=6)[-3000:]}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def fits(total_bytes: int, hbm_bytes: int | None, headroom: float = 0.10) -> bool | None:
    """Whether a per-device total fits HBM less `headroom` (None: HBM unknown)."""
    if hbm_bytes is None:
        return None
    return total_bytes <= hbm_bytes * (1 - headroom)


def kernel_shapes(cfg: ModelConfig) -> tpu_compile.KernelShapes:
    """The dimensions the Pallas kernels see in a model (pallas_kernels.tpu_compile's cases)."""
    k, d, m = cfg.kda, cfg.dsa, cfg.moe
    return tpu_compile.KernelShapes(
        dtype=cfg.dtype, d_model=cfg.d_model, kda_heads=k.num_heads, kda_k_dim=k.k_dim,
        kda_v_dim=k.v_dim, kda_chunk=k.chunk_size, index_heads=d.index_n_heads,
        index_head_dim=d.index_head_dim, heads=d.num_heads, kv_lora_rank=d.kv_lora_rank,
        rope_dim=d.qk_rope_head_dim, qk_head_dim=d.qk_head_dim, index_topk=d.index_topk,
        experts=m.num_experts, expert_dim=m.expert_dim, experts_per_tok=m.num_experts_per_tok)
