"""The RL run's pod programs compiled for a TPU slice ahead of time, on a CPU host (needs libtpu),
and the launch check's memory: compiled where it can be, else planned.

    from train.aot import compiled_memory
    from configs import rl as rl_configs
    c = rl_configs.get_config("smoke_8dev")
    c.model.moe.expert_parallel = "ragged_all_to_all"
    mem = compiled_memory(c, "v5p:2x2x1")      # or a slice name: "v5p-64", "v5p-512"
    mem["train_step"]["total_bytes"]           # per device, from XLA's memory analysis

Run the interpreter with JAX_PLATFORMS=cpu (nothing runs here; it keeps jax from probing for a
local TPU). Programs, each built by the function the RL loop builds it with (train/rl.py,
rl/train_step.py, rl/sampler.py) on the run config's mesh laid over the topology's devices
(`config.sharding.mesh`, -1 = the remaining devices; model.aot.topology_mesh), traced with
`pallas_kernels.backend.target_platform("tpu")` so impl="auto" dispatch picks what a TPU runs
(the Pallas kernels where their tables take the call):

  train_step   rl.train_step.make_train_step on the abstract RL state (abstract_rl_state: the
               optimizer's real dtypes and shardings) and a batch of prompts_per_batch x
               group_size rows of max_prompt_len + max_new_tokens tokens, with the loop's
               old-/ref-log-prob sources (old_logp_source, ref_logp_source: "step" takes the
               reference variables as a third argument)
  rollout      rl.sampler.Sampler's generate program (prefill + the decode loop) on the same
               rows' prompts (max_prompt_len wide) and rollout_sampling's config
  ref_forward  rl.train_step.make_logp_fn, the separate log-prob forward on the rows

Per program: model.aot.compile_program's row (ok or the compiler's error; per-device memory;
compile seconds). The planner's figure for each program is model/plan.py's
per_device_plan(...)["programs"] (tests/rl/tpu_plan_check.py compares the two).

Not covered: the multi-turn agent's extend program, the rollout-time old-log-prob forward of
algorithms with a critic, several processes (one compile describes every process's program).
"""

from __future__ import annotations

import importlib.util

from model import aot
from model import sharding as shd
from model.config import ModelConfig
from model.config_base import set_dotted
from model.transformer import Model
from rl.algorithms import algo_from_config
from rl.sampler import Sampler
from rl.train_step import make_logp_fn, make_train_step
from train.rl import train_width
from train.rollouts import old_logp_source, ref_logp_source, rollout_sampling
from train.run_config import RunConfig
from train.run_plan import planned_memory
from train.state import abstract_rl_state, rl_optimizers

PROGRAMS = ("train_step", "rollout", "ref_forward")
MEMORY_SOURCES = ("auto", "planner", "compiled")


def apply_overrides(config, overrides: dict | None):
    """A copy of the run config with dotted-path overrides ({"model.moe.qat": True}); an unknown
    path raises."""
    c = config.copy_and_resolve_references()
    set_dotted(c, overrides or {}, "run config")
    return c


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
    docstring; "mesh_error" when the mesh could not be laid on the torus). topology: a topology
    name ("v5p:4x8x8") or a slice name ("v5p-512", pallas_kernels.tpu_compile.SLICES);
    overrides: dotted config paths applied first; on_program(name, row): called as each
    program's compile ends (progress of long compiles)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels import backend, tpu_compile  # noqa: PLC0415

    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"unknown programs {unknown}; valid: {list(PROGRAMS)}")
    c = RunConfig.from_config(apply_overrides(run_config, overrides))
    devices = tpu_compile.topology_devices(topology)
    kind = devices[0].device_kind
    out = {"topology": tpu_compile.topology_name(topology), "devices": len(devices),
           "device_kind": kind, "hbm_bytes": aot.HBM_BYTES.get(kind)}
    mesh, rules, mesh_error = aot.topology_mesh(c, devices)
    if mesh_error:
        out["mesh_error"] = mesh_error
    out["mesh"] = dict(mesh.shape)
    r = c.rl
    model = Model(ModelConfig.from_dict(c.model))
    algo = algo_from_config(r.algo)
    n = r.prompts_per_batch * r.group_size
    length = train_width(r)
    sampling = rollout_sampling(r, eos_id=2)
    rows = shd.batch_sharding(mesh, n, rules)

    def done(name, row):
        out[name] = row
        if on_program:
            on_program(name, row)

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
                ref_logp=ref_src, mtp_loss_weight=r.mtp_loss_weight, mesh=mesh,
                rules=rules)
            batch = _batch_specs(n, length, old_src, ref_src, rows)
            extra = (state.variables,) if ref_src == "step" else ()
            row = aot.compile_program(lambda: step.lower(state, batch, *extra), mesh)
            done("train_step", {**row, "old_logp": old_src, "ref_logp": ref_src})
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
                raise RuntimeError("rl.sampler's mesh program changed shape: update train/aot.py")
            done("rollout", aot.compile_program(lambda: mesh_jit[False].lower(
                state.variables, prompts, lengths, key, temp, ids), mesh))
        if "ref_forward" in programs:
            fwd = make_logp_fn(model, sampling, mesh=mesh, rules=rules)
            tok = jax.ShapeDtypeStruct((n, length), jnp.int32, sharding=rows)
            mask = jax.ShapeDtypeStruct((n, length), jnp.bool_, sharding=rows)
            done("ref_forward", aot.compile_program(
                lambda: fwd.lower(state.variables, tok, mask), mesh))
    return out


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
        fit = aot.fits(row["total_bytes"], result["hbm_bytes"])
        lines.append(f"  {p:<12} args {row['argument_bytes'] / gib:8.2f} GiB  temp "
                     f"{row['temp_bytes'] / gib:8.2f} GiB  total {row['total_bytes'] / gib:8.2f} "
                     f"GiB  fits: {fit}  ({row['seconds']} s, {row['mosaic_calls']} Mosaic calls)")
    return "\n".join(lines)


def libtpu_available() -> bool:
    """Whether the TPU compiler (libtpu) is importable in this environment."""
    return importlib.util.find_spec("libtpu") is not None


def launch_memory(config, phase: str, shape: dict, device: str, *, source: str = "auto") -> dict:
    """The launch check's per-device memory of a phase on a mesh of `shape` of `device`s ->
    {"train", "rollout" (RL; None otherwise), "usable", "source", ...}.

    source "auto": for an RL phase on a TPU device (model.aot.slice_topology names a slice of
    that many chips) with libtpu installed, the compiled programs (`compiled_memory`: the train
    step's total; the rollout program's total plus the train state it does not take as
    arguments, i.e. the train step's arguments beyond the rollout's, as the sampler runs next
    to the train state); anything else, the planner (train.run_plan.planned_memory). "compiled"
    demands the compile (ValueError naming why it cannot), "planner" skips it. A program the
    compiler rejects (e.g. out of HBM) is reported with the compiler's message."""
    if source not in MEMORY_SOURCES:
        raise ValueError(f"memory source must be one of {MEMORY_SOURCES}, got {source!r}")
    chips = 1
    for v in shape.values():
        chips *= int(v)
    topology = aot.slice_topology(device, chips)
    why_not = (None if phase == "rl" and topology and libtpu_available() else
               f"phase {phase!r} has no compiled programs (RL only)" if phase != "rl" else
               f"{device} x {chips} is not a TPU slice this module can name" if not topology else
               "libtpu is not installed (the [tpu] extra, docs/tpu_compile.md)")
    if source == "planner" or (source == "auto" and why_not):
        m = planned_memory(config, phase, shape, device)
        if source == "auto" and device in aot.TPU_GENERATIONS:
            m["source"] = f"planner; not compiled: {why_not}"
        return m
    if why_not:
        raise ValueError(f"compiled memory for {phase} on {device} x {chips}: {why_not}")
    mesh = ",".join(f"{a}={n}" for a, n in shape.items())
    res = compiled_memory(config, topology, overrides={"sharding.mesh": mesh})
    bad = [f"{p}: {res[p]['error'][:400]}" for p in ("train_step", "rollout")
           if not res[p]["ok"]]
    if bad:
        raise ValueError(f"the TPU compiler rejects {phase} on {topology} with mesh {mesh}: "
                         + "; ".join(bad))
    t, r = res["train_step"], res["rollout"]
    state_outside = max(t["argument_bytes"] - r["argument_bytes"], 0)
    from model.plan import DEVICES  # noqa: PLC0415

    usable = int(DEVICES[device]["hbm"] * 0.9)  # the planner's usable (10% headroom)
    return {"train": t["total_bytes"], "rollout": r["total_bytes"] + state_outside,
            "usable": usable, "source": f"compiled for {topology} by libtpu",
            "compiled": res}


def main(argv=None) -> int:
    """python -m train.aot --config configs/rl.py:smoke_8dev --topology v5p:2x2x2 [--json OUT]
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
    if not os.path.isfile(path):
        p.error(f"--config {args.config!r}: no config file {path!r} (e.g. configs/rl.py:<variant>)")
    spec = importlib.util.spec_from_file_location("run_config_file", path)
    config_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_file)  # a config file is data: loaded by path, as --config is

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

    result = compiled_memory(config_file.get_config(variant or None), args.topology,
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
