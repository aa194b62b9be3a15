"""Where the RL train step's compile time goes: the matched GRPO work's step (benchmarks/grpo_matched.py)
traced, lowered and compiled in separate timed stages, in one fresh process.

    python -m benchmarks.train_step_compile
    python -m benchmarks.train_step_compile --profile --run 2
    python -m benchmarks.train_step_compile --set rl.mtp_loss_weight=0.0 model.layer_pattern=DDDD
    python -m benchmarks.train_step_compile --set model.num_layers=32 model.scan_layers=True

The step is rl/train_step.py:make_train_step wired as grpo_matched wires it (same config, mesh,
state shardings, old_logp and ref_logp sources, MTP weight); the batch has the shapes and keys
rl.pipeline.build_train_batch gives that run (tokens and loss mask [N, P+G], advantages,
rollout log-probs, and the reference log-probs where the step does not compute them itself from
the reference variables, rl.ref_logp_pass) with seeded random values. `--set` overrides config fields as
in grpo_matched (ablations: rl.mtp_loss_weight=0.0, model.layer_pattern=KKKK / DDDD,
model.moe.num_experts=0; depth: model.num_layers=N with model.scan_layers=True / False, the
repeated layer groups scanned or unrolled).

The persistent compilation cache is off (a cold compile, as in grpo_matched's first
iteration). Prints one JSON record: for each stage (trace: Python -> jaxpr; lower: jaxpr -> StableHLO;
compile: XLA) wall seconds and this process's CPU seconds (XLA:CPU compiles partly in threads,
and other work on the machine inflates wall time: compare CPU seconds, and the load averages
recorded before and after); sizes (jaxpr equations, nested ones included; StableHLO lines;
instructions, fusions and while loops of the optimized HLO). --profile adds XLA's own phase
split from a jax.profiler trace of the compile (HLO passes, thunk emission, fusion kernels
compiled (XLA compiles each distinct fusion once: identical layers share kernels) and their
seconds, LLVM code generation); --run N runs the compiled step N times on copies of the state
(seconds, and a SHA-256 over every output: equal digests mean a restructuring kept every number
bit for bit).
Not covered: the rest of the first iteration (sampler, log-prob passes: grpo_matched).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import sys
import tempfile
import time

from benchmarks.grpo_matched import VARIANTS, run_config
from benchmarks.peers import emit, loadavg


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _jaxpr_eqns(jaxpr) -> int:
    """Equations of a jaxpr and of every jaxpr nested in them (scan/cond bodies, custom rules)."""
    from jax._src import core

    return sum(1 + sum(_jaxpr_eqns(sub) for sub in core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def _hlo_sizes(text: str) -> dict:
    lines = text.splitlines()
    return {"hlo_instructions": sum(" = " in line for line in lines),
            "hlo_fusions": text.count(" fusion("), "hlo_while_loops": text.count(" while(")}


def _xla_phases(trace_dir: str) -> dict:
    """XLA:CPU's compile phases (seconds, summed over threads) from a jax.profiler trace."""
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins/profile/*/*.trace.json.gz")))[-1]
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]

    def seconds(*names):
        return round(sum(e["dur"] for e in events if e["name"] in names) / 1e6, 3)

    fusions = [e for e in events if e["name"] == "FusionCompiler::Compile"]
    codegen = [e for e in events if e["name"] == "Codegen"]
    return {
        "hlo_passes_s": seconds("HLO passes through layout assignment (jit_step)",
                                "HLO passes after layout assignment (jit_step)"),
        "backend_s": seconds("CpuCompiler::RunBackend"),
        "thunk_emission_s": seconds("ThunkEmitter::EmitEntryComputation"),
        "fusion_kernels": len(fusions),
        "fusion_kernel_ops": sum(int(e.get("args", {}).get("op_count", 0)) for e in fusions),
        "fusion_kernels_s": seconds("FusionCompiler::Compile"),
        "llvm_functions": int(codegen[0].get("args", {}).get("num_compiled_functions", -1))
        if codegen else None,
        "llvm_codegen_s": seconds("Codegen"),
    }


def build(config):
    """(train step, state, global batch, on_mesh, old-log-prob source, the step's arguments after
    (state, batch): the reference variables where it computes the reference log-probs) as
    grpo_matched's grpo() builds them."""
    import numpy as np

    import train.rollouts
    import train.weights
    from benchmarks.grpo_matched import build_trainer, matched_train_step
    from model import sharding as shd
    from rl.pipeline import _prepare_advantages_jit

    r = config.rl
    model, algo, on_mesh, opt, _, init = build_trainer(config)
    init_vars, state = init()
    old_src, ref_src = train.rollouts.old_logp_source(r, algo), train.rollouts.ref_logp_source(r, algo)
    step = matched_train_step(config, model, algo, opt, state, train.rollouts.rollout_sampling(r, -1),
                              on_mesh)
    N, P, G = r.prompts_per_batch * r.group_size, r.max_prompt_len, r.max_new_tokens
    rng = np.random.default_rng(0)
    mask = np.zeros((N, P + G), bool)  # [N,L] every row: P prompt tokens, G completion targets
    mask[:, P:] = True
    logp = lambda: np.where(mask, -rng.random(mask.shape), 0.0).astype(np.float32)  # [N,L]
    prep = _prepare_advantages_jit(algo, rng.random(N).astype(np.float32), mask,
                                   group_ids=np.repeat(np.arange(N // r.group_size),
                                                       r.group_size),
                                   values=None, kl=None, lengths=np.full(N, G))
    batch = {"tokens": rng.integers(3, config.model.vocab_size, mask.shape).astype(np.int32),
             "loss_mask": mask, "advantages": np.asarray(prep.advantages),
             "rollout_logp": logp()}
    extra = ()
    if ref_src == "step":
        extra = (train.weights.reference_variables(init_vars, state),)
    elif algo.needs_ref:
        batch["ref_logp"] = logp()
    if old_src == "batch":
        batch["old_logp"] = logp()
    return step, state, shd.to_global(batch, **on_mesh), on_mesh, old_src, extra


def measure(args, config) -> dict:
    """The record of one probe (main's arguments)."""
    import jax
    import numpy as np

    from model import sharding as shd

    rec = {"variant": args.variant, "overrides": args.set,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "load_before": loadavg()}
    step, state, batch, on_mesh, old_src, extra = build(config)
    jax.block_until_ready(state)
    rec.update(old_logp=old_src, ref_logp_in_step=bool(extra),
               batch={k: list(np.shape(v)) for k, v in batch.items()})
    jitted = step._jit((state, batch, *extra))[1] if isinstance(step, shd.MeshJit) else step
    points = [(time.perf_counter(), _cpu())]
    with shd.use_mesh(on_mesh["mesh"], on_mesh["rules"]):
        traced = jitted.trace(state, batch, *extra)
        points.append((time.perf_counter(), _cpu()))
        lowered = traced.lower()
        points.append((time.perf_counter(), _cpu()))
        trace_dir = tempfile.mkdtemp(prefix="compile_trace_") if args.profile else None
        if trace_dir:
            jax.profiler.start_trace(trace_dir)
        compiled = lowered.compile()
        points.append((time.perf_counter(), _cpu()))
        if trace_dir:
            jax.profiler.stop_trace()
    for name, (w0, c0), (w1, c1) in zip(("trace", "lower", "compile"), points, points[1:]):
        rec[f"{name}_wall_s"], rec[f"{name}_cpu_s"] = round(w1 - w0, 3), round(c1 - c0, 3)
    rec.update(jaxpr_eqns=_jaxpr_eqns(traced.jaxpr.jaxpr),
               stablehlo_lines=lowered.as_text().count("\n"), **_hlo_sizes(compiled.as_text()))
    if trace_dir:
        rec["xla"] = _xla_phases(trace_dir)
    if args.run:
        host = jax.device_get(state)
        walls, cpus = [], []
        for _ in range(args.run):  # the step donates its state: a fresh copy per run
            fresh = jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), host, state)
            jax.block_until_ready(fresh)
            w0, c0 = time.perf_counter(), _cpu()
            out = jax.block_until_ready(compiled(fresh, batch, *extra))
            walls.append(round(time.perf_counter() - w0, 3))
            cpus.append(round(_cpu() - c0, 3))
        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(jax.device_get(out)):
            digest.update(np.ascontiguousarray(leaf).tobytes())
        rec.update(run_wall_s=walls, run_cpu_s=cpus, outputs_sha256=digest.hexdigest()[:16],
                   loss=float(out[1]["loss"]), grad_norm=float(out[1]["grad_norm"]))
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", default="hybrid", choices=VARIANTS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides, as in benchmarks.grpo_matched")
    p.add_argument("--profile", action="store_true", help="XLA's compile phases (jax.profiler)")
    p.add_argument("--run", type=int, default=0, help="run the compiled step N times")
    p.add_argument("--out", help="also write the JSON record here")
    args = p.parse_args(argv)
    if args.run < 0:
        p.error("--run must be >= 0")
    config = run_config(args.variant, args.set)  # a bad override fails before jax starts

    from runtime.xla_env import configure_xla_env

    configure_xla_env()  # the scripts' XLA flags
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    # a cold compile every time: no persistent cache, even where the caller (the test suite)
    # configured one (restored afterwards). jax decides once per process whether compiles use
    # the cache, so turning the option off is not enough in a process that has compiled before
    # (an earlier run's entry would be read back): reset_cache makes it decide again.
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        rec = measure(args, config)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
        compilation_cache.reset_cache()
    rec["load_after"] = loadavg()
    emit(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
