"""The RL run's pod programs compiled for a TPU slice ahead of time, on a CPU host (needs libtpu).

    from model.aot import compiled_memory
    from configs import rl as rl_configs
    c = rl_configs.get_config("smoke_8dev")
    c.model.moe.expert_parallel = "ragged_all_to_all"
    mem = compiled_memory(c, "v5p:2x2x1")      # or a slice name: "v5p-64", "v5p-512"
    mem["train_step"]["total_bytes"]           # per device, from XLA's memory analysis

Run the interpreter with JAX_PLATFORMS=cpu (nothing runs here; it keeps jax from probing for a
local TPU). Programs, each built by the function the RL loop builds it with (train/rl.py,
rl/train_step.py, rl/sampler.py) on the run config's mesh laid over the topology's devices
(`config.sharding.mesh`, -1 = the remaining devices), traced with `pallas_kernels.backend.
target_platform("tpu")` so impl="auto" dispatch picks what a TPU runs (the Pallas kernels where
their tables take the call):

  train_step   rl.train_step.make_train_step on the abstract RL state (abstract_rl_state: the
               optimizer's real dtypes and shardings) and a batch of prompts_per_batch x
               group_size rows of max_prompt_len + max_new_tokens tokens, with the loop's
               old-/ref-log-prob sources (old_logp_source, ref_logp_source: "step" takes the
               reference variables as a third argument)
  rollout      rl.sampler.Sampler's generate program (prefill + the decode loop) on the same
               rows' prompts (max_prompt_len wide) and rollout_sampling's config
  ref_forward  rl.train_step.make_logp_fn, the separate log-prob forward on the rows

When jax.make_mesh cannot lay the config's mesh on the slice's physical torus (an axis size that
would split a physical axis, e.g. fsdp=16 on v5p:8x8x8), the result records it under
"mesh_error" and the devices are taken in order instead.

Per program (`compile_program`): ok or the compiler's error; per device: arguments, outputs,
temporaries and aliased bytes from `Compiled.memory_analysis()`, total = arguments + outputs +
temporaries - aliased (the measure tests/rl/test_sharded_rl.py holds the planner to); XLA's
flops and bytes accessed; compile seconds. `fits(total, device)` compares with HBM.

Not covered: the multi-turn agent's extend program, the rollout-time old-log-prob forward of
algorithms with a critic, several processes (one compile describes every process's program).
"""

from __future__ import annotations

import time
import traceback

from model.config import ModelConfig

# HBM per JAX device (one chip; v5p and v4 chips are one megacore device)
HBM_BYTES = {"TPU v5": 95 * 2**30, "TPU v5p": 95 * 2**30, "TPU v4": 32 * 2**30,
             "TPU v5 lite": 16 * 2**30, "TPU v6 lite": 32 * 2**30}
PROGRAMS = ("train_step", "rollout", "ref_forward")


def apply_overrides(config, overrides: dict | None):
    """A copy of the run config with dotted-path overrides ({"model.moe.qat": True}); an unknown
    path raises."""
    c = config.copy_and_resolve_references()
    for key, v in (overrides or {}).items():
        node = c
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        if leaf not in node:
            raise KeyError(f"run config has no field {key!r}")
        node[leaf] = v
    return c


def _memory(compiled) -> dict:
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
    answer for the mesh's TPU), compile it and report (see the module docstring)."""
    import jax  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = lower()
        compiled = lowered.compile()
        row = {"ok": True, "error": None, **_memory(compiled)}
        row["mosaic_calls"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000],
               "traceback": traceback.format_exc(limit=6)[-3000:]}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _batch_specs(n: int, length: int, old_src: str, ref_src: str, sharding) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    def arr(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    batch = {"tokens": arr((n, length), jnp.int32), "loss_mask": arr((n, length), jnp.bool_),
             "advantages": arr((n, 1), jnp.float32),
             "rollout_logp": arr((n, length), jnp.float32)}
    if old_src == "batch":
        batch["old_logp"] = arr((n, length), jnp.float32)
    if ref_src == "batch":
        batch["ref_logp"] = arr((n, length), jnp.float32)
    return batch


def compiled_memory(run_config, topology: str, *, programs=PROGRAMS,
                    overrides: dict | None = None, on_program=None) -> dict:
    """Compile the run config's pod programs for a TPU topology; -> {"topology", "devices",
    "device_kind", "mesh", "hbm_bytes", program: row} with one row per program (see the module
    docstring). topology: a topology name ("v5p:4x8x8") or a slice name ("v5p-512",
    pallas_kernels.tpu_compile.SLICES); overrides: dotted config paths applied first;
    on_program(name, row): called as each program's compile ends (progress of long compiles)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from model import sharding as shd  # noqa: PLC0415
    from model.transformer import Model  # noqa: PLC0415
    from pallas_kernels import (
        backend,  # noqa: PLC0415
        tpu_compile,  # noqa: PLC0415
    )
    from rl.algorithms import algo_from_config  # noqa: PLC0415
    from rl.sampler import Sampler  # noqa: PLC0415
    from rl.train_step import make_logp_fn, make_train_step  # noqa: PLC0415
    from train.rl import train_width  # noqa: PLC0415
    from train.rollouts import old_logp_source, ref_logp_source, rollout_sampling  # noqa: PLC0415
    from train.run_config import RunConfig  # noqa: PLC0415
    from train.state import abstract_rl_state, rl_optimizers  # noqa: PLC0415

    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown programs {unknown}; valid: {list(PROGRAMS)}")
    c = RunConfig.from_config(apply_overrides(run_config, overrides))
    devices = tpu_compile.topology_devices(topology)
    kind = devices[0].device_kind
    out = {"topology": tpu_compile.topology_name(topology), "devices": len(devices),
           "device_kind": kind, "hbm_bytes": HBM_BYTES.get(kind)}
    try:
        mesh, rules = shd.mesh_from_config(c, devices=list(devices))
    except NotImplementedError as e:
        # jax.make_mesh could not lay the logical mesh on the physical torus (an axis would
        # split a physical one): recorded, and the devices taken in order instead (the memory
        # analysis does not depend on which device holds which shard)
        out["mesh_error"] = f"{type(e).__name__}: {e}"[:600]
        import numpy as np  # noqa: PLC0415
        from jax.sharding import AxisType, Mesh  # noqa: PLC0415

        full = shd.mesh_shape(shd.parse_mesh(c.sharding.mesh), len(devices))
        mesh = Mesh(np.array(devices).reshape(tuple(full[a] for a in shd.MESH_AXES)),
                    shd.MESH_AXES, axis_types=(AxisType.Auto,) * len(shd.MESH_AXES))
        rules = shd.rules_from_config(c)
    out["mesh"] = dict(mesh.shape)
    r = c.rl
    model = Model(ModelConfig.from_dict(c.model))
    algo = algo_from_config(r.algo)
    n = r.prompts_per_batch * r.group_size
    length = train_width(r)
    sampling = rollout_sampling(r, eos_id=2)
    rows = shd.batch_sharding(mesh, n, rules)
    # dispatch reads the target platform while the programs are traced
    with backend.target_platform("tpu"):
        state = abstract_rl_state(c, model, algo, mesh=mesh, rules=rules)
        if "train_step" in programs:
            opt, critic, value_opt = rl_optimizers(c, algo)
            old_src, ref_src = old_logp_source(r, algo), ref_logp_source(r, algo)
            step = make_train_step(
                model, algo, opt, micro_batches=r.micro_batches, sampling=sampling,
                critic=critic, value_optimizer=value_opt,
                state_shardings=jax.tree.map(lambda x: x.sharding, state), old_logp=old_src,
                ref_logp=ref_src, mtp_loss_weight=r.get("mtp_loss_weight", None), mesh=mesh,
                rules=rules)
            batch = _batch_specs(n, length, old_src, ref_src, rows)
            extra = (state.variables,) if ref_src == "step" else ()
            out["train_step"] = compile_program(lambda: step.lower(state, batch, *extra), mesh)
            out["train_step"].update(old_logp=old_src, ref_logp=ref_src)
            if on_program:
                on_program("train_step", out["train_step"])
        if "rollout" in programs:
            sampler = Sampler(model, sampling, mesh=mesh, rules=rules)
            prompts = jax.ShapeDtypeStruct((n, r.max_prompt_len), jnp.int32, sharding=rows)
            lengths = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows)
            rep = shd.replicated(mesh)
            key = jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32,
                                       sharding=rep)
            temp = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
            ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rows)
            prog = sampler._generate  # the plain (no prefix sharing) generate program
            mesh_jit = prog.__closure__ and next(
                (cell.cell_contents for cell in prog.__closure__
                 if isinstance(cell.cell_contents, dict)), None)
            if not mesh_jit:
                raise RuntimeError("rl.sampler's mesh program changed shape: update model/aot.py")
            out["rollout"] = compile_program(lambda: mesh_jit[False].lower(
                state.variables, prompts, lengths, key, temp, ids), mesh)
            if on_program:
                on_program("rollout", out["rollout"])
        if "ref_forward" in programs:
            fwd = make_logp_fn(model, sampling, mesh=mesh, rules=rules)
            tok = jax.ShapeDtypeStruct((n, length), jnp.int32, sharding=rows)
            mask = jax.ShapeDtypeStruct((n, length), jnp.bool_, sharding=rows)
            out["ref_forward"] = compile_program(lambda: fwd.lower(state.variables, tok, mask),
                                                 mesh)
            if on_program:
                on_program("ref_forward", out["ref_forward"])
    return out


def fits(total_bytes: int, hbm_bytes: int | None, headroom: float = 0.10) -> bool | None:
    """Whether a per-device total fits HBM less `headroom` (None: HBM unknown)."""
    if hbm_bytes is None:
        return None
    return total_bytes <= hbm_bytes * (1 - headroom)


def format_memory(result: dict) -> str:
    """One line per program: ok, per-device GiB (args / temp / total) and the fit."""
    gib = 2**30
    lines = [f"{result['topology']} ({result['devices']} x {result['device_kind']}, mesh "
             f"{result['mesh']}):"]
    if "mesh_error" in result:
        lines.append(f"  the run's make_mesh failed on this topology (devices taken in order "
                     f"instead): {result['mesh_error'][:300]}")
    for p in PROGRAMS:
        row = result.get(p)
        if row is None:
            continue
        if not row["ok"]:
            lines.append(f"  {p:<12} FAILED ({row['seconds']} s): {row['error'][:600]}")
            continue
        fit = fits(row["total_bytes"], result["hbm_bytes"])
        lines.append(f"  {p:<12} args {row['argument_bytes'] / gib:8.2f} GiB  temp "
                     f"{row['temp_bytes'] / gib:8.2f} GiB  total {row['total_bytes'] / gib:8.2f} "
                     f"GiB  fits: {fit}  ({row['seconds']} s, {row['mosaic_calls']} Mosaic calls)")
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m model.aot --config configs/rl.py:smoke_8dev --topology v5p:2x2x2 [--json OUT]
    [--set model.moe.qat=true ...] [--programs train_step rollout ref_forward]"""
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs: no local TPU to probe for
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a run config, configs/rl.py:<variant>")
    p.add_argument("--topology", required=True, help="topology or slice name: v5p:4x8x8, v5p-512")
    p.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    p.add_argument("--set", nargs="*", default=[], metavar="PATH=VALUE",
                   help="config overrides (values parsed as JSON, else kept as strings)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    path, _, variant = args.config.partition(":")
    if path != "configs/rl.py":
        p.error("--config must be configs/rl.py:<variant>")
    from configs import rl as rl_configs  # noqa: PLC0415

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set takes PATH=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    def progress(name, row):
        keep = {k: v for k, v in row.items() if k != "traceback"}
        print(f"{name}: {json.dumps(keep)}", flush=True)

    result = compiled_memory(rl_configs.get_config(variant or None), args.topology,
                             programs=args.programs, overrides=overrides, on_program=progress)
    print(format_memory(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: ({kk: vv for kk, vv in v.items() if kk != "traceback"}
                           if isinstance(v, dict) else v) for k, v in result.items()}, f,
                      indent=2)
    return 0 if all(result[p]["ok"] for p in args.programs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
