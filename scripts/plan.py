"""Plan a model without allocating it, from the command line: parameters, bytes, shards,
decode-state memory, and the per-device memory on a mesh.

    python scripts/plan.py --config configs/models.py:reference_2p8t          # ~20 s on CPU
    python scripts/plan.py --config configs/models.py:reference_2p8t --json
    python scripts/plan.py --config configs/rl.py:grpo_tiny                    # uses config.model
    python scripts/plan.py --config configs/rl.py:reference --devices 512 --device tpu-v5p \
        --batch 256 --seq 4096          # an RL config: its mesh, optimizer numerics, reference
    python scripts/plan.py --config configs/models.py:reference_2p8t \
        --mesh fsdp=16,expert=8,tensor=8 --device h200 --batch 256 --seq 4096   # per-device table
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false python scripts/plan.py \
        --config configs/models.py:tiny --compiled_memory --batch 1 --seq 2048  # XLA's numbers

The planner itself is model/plan.py (its docstring says what is counted and what is assumed);
an RL or SFT config adds its run (train/run_plan.py). This file holds the flags, the printed
report, and the pod launches of docs/scaling.md (`LAUNCHES`, `launch_plans`,
`format_launch_table`: --launch_table).
"""

from __future__ import annotations

import json
import math

from runtime.xla_env import configure_xla_env

configure_xla_env()  # before jax is imported (--compiled_memory compiles gradients on CPU)
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from model import sharding as shd  # noqa: E402
from model.plan import (  # noqa: E402
    fmt_bytes,
    format_compiled_memory,
    format_per_device,
    model_cfg,
    per_device_plan,
    plan,
)
from train.run_plan import run_batch_from_config, run_plan_from_config  # noqa: E402

# The pod launches of docs/scaling.md section 3 for configs/rl.py:reference (and the slice that
# is too small): (what, mesh, device, devices per process, config.rl overrides). `launch_plans`
# plans each with the config's own batch; the page's table is `format_launch_table`'s output.
LAUNCHES = (
    ("1024 x H200 (128 nodes of 8)", "fsdp=16,expert=8,tensor=8", "h200", 8, {}),
    ("2048 x TPU v5p (v5p-4096, 512 hosts)", "fsdp=64,expert=8,tensor=4", "tpu-v5p", 4,
     {"prompts_per_batch": 512, "max_new_tokens": 1024}),
    ("512 x TPU v5p (v5p-1024, 128 hosts)", "fsdp=16,expert=8,tensor=4", "tpu-v5p", 4, {}),
)


def launch_plans(launches=LAUNCHES, variant: str = "reference") -> list[dict]:
    """Per-device plans of configs/rl.py:<variant> for each launch: the config's rows and row
    width (run_batch_from_config), its run (run_plan_from_config), and the rows per process."""
    from configs import rl as rl_configs
    from train.launch import process_layout

    out = []
    for what, mesh, device, per_process, overrides in launches:
        c = rl_configs.get_config(variant)
        c.sharding.mesh = mesh
        c.rl.update(overrides)
        rows, seq = run_batch_from_config(c)
        shape = shd.mesh_shape(mesh)
        processes = math.prod(shape.values()) // per_process
        blocks, per = process_layout(shape, rows, processes, shd.rules_from_config(c))
        pd = per_device_plan(model_cfg(c), mesh, device, rows, seq,
                             rules=shd.rules_from_config(c), run=run_plan_from_config(c))
        out.append({"what": what, "mesh": mesh, "device": device, "processes": processes,
                    "rows": rows, "seq": seq, "micro_batches": int(c.rl.micro_batches),
                    "rows_per_process": per, "group_size": int(c.rl.group_size),
                    "overrides": overrides, "plan": pd})
    return out


def format_launch_table(plans: list[dict]) -> str:
    """The markdown table of launch_plans (docs/scaling.md section 4)."""
    def gb(n):
        return f"{n / 1e9:.1f}"

    lines = ["| devices | mesh | rows x tokens (micro-batches) | rows per process | train state "
             "| training | rollouts (MXFP4 experts) | usable | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        t, r, pd = p["plan"]["train"], p["plan"]["rollout"], p["plan"]
        state = t["params_bf16"] + t["master_f32"] + t["adam_moments_f32"] + \
            t["reference_policy"]
        ok = t["fits"] and r["fits"]
        verdict = "fits" if ok else "does NOT fit: " + ", ".join(
            f"{what} over by {gb(v['over_by'])} GB" for what, v in (("training", t),
                                                                      ("rollouts", r))
            if not v["fits"])
        extra = "".join(f", `--config.rl.{k}={v}`" for k, v in p["overrides"].items())
        lines.append(
            f"| {p['what']} | `{p['mesh']}`{extra} | {p['rows']} x {p['seq']} "
            f"({p['micro_batches']}) | {p['rows_per_process']} (groups of {p['group_size']}) | "
            f"{gb(state)} GB | {gb(t['total'])} GB | {gb(r['total'])} GB "
            f"(gathered {gb(r['gathered_weights'])}, decode {gb(r['decode_state'])}) | "
            f"{gb(pd['usable_bytes'])} GB | {verdict} |")
    return "\n".join(lines)


def define_flags() -> None:
    """The command line's flags, defined when the planner runs as a script (importing the
    module, as the run scripts' launch checks do, defines none)."""
    global _CONFIG, _JSON, _SHARD_GB, _MESH, _DEVICE, _BATCH, _SEQ, _COMPILED, _DEVICES, _DRY
    global _HEADROOM, _LAUNCHES
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
    _COMPILED = flags.DEFINE_bool("compiled_memory", False, "also compile the training gradient "
                                  "at --batch x --seq for every remat policy on this host's backend "
                                  "and print XLA's memory analysis next to the planner's estimate "
                                  "(small configs; see compiled_train_memory)")
    _DEVICES = flags.DEFINE_integer("devices", 0, "device count for a config mesh with a -1 axis")
    _DRY = flags.DEFINE_bool("dry_run", False, "only validate the config and flags (model config, "
                             "mesh for the device count) and exit without planning")
    _LAUNCHES = flags.DEFINE_bool("launch_table", False, "print the per-device table of the "
                                  "reference launches of docs/scaling.md (LAUNCHES) and exit")
    _HEADROOM = flags.DEFINE_float("headroom", 0.10, "fraction of HBM kept free (XLA workspace, "
                                   "collective buffers, fragmentation)")


def main(_):
    if _LAUNCHES.value:
        print(format_launch_table(launch_plans()))
        return
    cfg = model_cfg(_CONFIG.value)
    kw = {}
    mesh = _MESH.value
    if not mesh and "sharding" in _CONFIG.value:  # an RL/SFT config: its mesh and its run
        mesh = _CONFIG.value.sharding.mesh
        if "-1" in mesh.replace(" ", ""):
            if not _DEVICES.value:
                raise app.UsageError(f"sharding.mesh={mesh!r} has a -1 axis: pass --devices")
            mesh = shd.mesh_shape(mesh, _DEVICES.value)
    if _DRY.value:
        shape = shd.mesh_shape(mesh) if mesh else None
        print(f"model {cfg.name}: {cfg.num_layers} layers '{''.join(cfg.layer_kinds())}'"
              + (f", mesh {shape} on {_DEVICE.value}" if shape else "") + ": OK")
        return
    if mesh:
        kw = dict(mesh=mesh, device=_DEVICE.value, batch=_BATCH.value, seq=_SEQ.value,
                  headroom=_HEADROOM.value)
        if "rl" in _CONFIG.value:
            kw["run"] = run_plan_from_config(_CONFIG.value)
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
    print(f"  bytes bf16          {fmt_bytes(out['bytes_bf16']):>20}")
    print(f"  bytes MXFP4 experts {fmt_bytes(out['bytes_mxfp4']):>20}  "
          f"-> {out['num_shards']} shards of {fmt_bytes(out['shard_bytes'])}")
    print("  decode state per sequence:")
    for s, d in out["decode_state_bytes"].items():
        print(f"    {int(s):>8,d} tokens: hybrid {fmt_bytes(d['hybrid']):>12} | all-DSA "
              f"{fmt_bytes(d['all_dsa']):>12} | all-MHA {fmt_bytes(d['all_mha']):>12}")
    if "per_device" in out:
        print(format_per_device(out["per_device"]))
    if _COMPILED.value:
        print(format_compiled_memory(cfg, _BATCH.value, _SEQ.value))


if __name__ == "__main__":
    define_flags()
    app.run(main)
