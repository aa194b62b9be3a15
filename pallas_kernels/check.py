"""Every Pallas kernel against its reference and its XLA path: one numerics and speed table.

    python -m pallas_kernels.check                      # small shapes (interpret mode on CPU)
    python -m pallas_kernels.check --size bench         # benchmark shapes (meant for GPU/TPU)
    python -m pallas_kernels.check --kernels kda --json OUT.json
    python -m pallas_kernels.check --target=tpu:v5p     # compile for a TPU, no TPU (libtpu)

Used by notebooks/kernels.ipynb and scripts/gpu_check.sh (the same cases, the same numbers).

Cases (`cases(size)`), one kernel entry point at one shape each, from the shared arg-spec tables:
  kda            ops.kda (o, final state) w.r.t. q, k, v, g, beta, initial state
  dsa_indexer    ops.indexer_scores w.r.t. q_idx, k_idx, w
  dsa_attention  ops.sparse_attention_with_lse (o, lse) w.r.t. q, kv (indices from the reference
                 indexer + top-k)
  mxfp4_matmul   ops.mxfp4_matmul w.r.t. x (MXFP4 weights get no gradient)
  mxfp4_grouped  ops.grouped_mxfp4_matmul w.r.t. x
"small" takes, per kernel, the most irregular test shape (`lowering.REPRESENTATIVE`: T not a
multiple of the chunk, odd sizes, a ragged K tail, empty expert groups); "bench" the benchmark
shapes (KDA H=16 K=V=128 T=2048, DSA S=4096 bf16, MXFP4 decode and prefill at 8192^2, an
8-expert grouped matmul).

Per case:
  numerics  the Pallas path (impl="pallas": interpret mode unless the platform compiles the
            kernel, `pallas_kernels.backend`) and the oracle run on the same inputs: outputs and
            gradients (a VJP with fixed random cotangents, one program for both) compared by
            relative RMS error, sqrt(mean((x - ref)^2) / mean(ref^2)), over the entries where
            the oracle is finite (the pattern of non-finite entries must match exactly). The
            oracle is `reference.kda_recurrent` for KDA (the token-by-token scan) and the XLA
            path for the others (the pure-jnp reference), always in f32 (bf16 inputs are
            upcast). A case passes when every error is below `TOLERANCE[dtype]` (5e-3 f32,
            3e-2 bf16: the loosest bounds of tests/pallas_kernels, which hold each kernel to
            its own tighter ones).
  speed     median wall time after a warm-up call of the forward and of forward+backward for
            the Pallas path and for the XLA path (impl="xla": the chunked form for KDA, the
            jnp references otherwise); speedup = XLA time / Pallas time. In interpret mode
            (every CPU run) Pallas times measure the Python interpreter of the kernel, not the
            kernel: `format_table` says so and the speedups are not a performance result.

--target=tpu:v5p (or tpu:v5e, tpu:v6e, a topology name such as v5p:2x2x1) checks something
else: every Pallas TPU kernel at the model presets' per-device shapes compiled by the real TPU
compiler on this host (no numerics, nothing run): compiled or the compiler's error, scoped VMEM,
HBM memory and cost analysis per kernel and shape (`pallas_kernels.tpu_compile`; --presets,
--modes fwd bwd). Needs libtpu (the [tpu] extra); exits non-zero on any compile error.

Not covered here: the lowering of each kernel for a platform not present (`python -m
pallas_kernels.lowering`), edge cases the tests pin (rows with no valid key, NaN blocks, decode
parity) and the benchmark tables (`scripts/bench.py kda dsa mxfp4`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

if __name__ == "__main__":  # a command-line run: XLA's CPU flags are set before jax is imported
    import os
    import sys

    from runtime.xla_env import configure_xla_env

    configure_xla_env()
    if any(a.startswith("--target") for a in sys.argv[1:]):
        # compiling for a TPU topology from this host: no local TPU to probe for
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import lowering  # noqa: E402

SIZES = ("small", "bench")
TOLERANCE = {"float32": 5e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel entry point at one shape.

    make_args() -> tuple of inputs; fn(impl, interpret) -> f(*args) returning an array or a tuple
    of arrays (impl "pallas", "xla" or "oracle"; interpret only matters for "pallas"); argnums:
    the inputs gradients are taken for; out_names / arg_names: labels of the floating outputs
    and of all inputs (error keys: "o", "dq", ...).
    """

    kernel: str
    name: str
    dtype: str
    make_args: Callable[[], tuple]
    fn: Callable[[str, bool | None], Callable]
    argnums: tuple[int, ...]
    out_names: tuple[str, ...]
    arg_names: tuple[str, ...]

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


# ------------------------------------------------------------------------------------------------
# Cases.
# ------------------------------------------------------------------------------------------------


def _kda_case(spec) -> Case:
    from pallas_kernels.kda import arg_specs, ops  # noqa: PLC0415

    def make_args():
        a = arg_specs.make_args(spec)
        h0 = a["initial_state"]
        if h0 is None:  # always pass one, so the gradient w.r.t. the initial state is checked too
            h0 = jnp.zeros((spec.B, spec.H, spec.K, spec.V), jnp.float32)
        return a["q"], a["k"], a["v"], a["g"], a["beta"], h0

    def fn(impl, interpret):
        impl = {"oracle": "recurrent"}.get(impl, impl)

        def f(q, k, v, g, beta, h0):
            return ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, impl=impl,
                           interpret=interpret if impl == "pallas" else None)
        return f

    return Case("kda", spec.name, spec.dtype, make_args, fn, (0, 1, 2, 3, 4, 5),
                ("o", "final_state"), ("q", "k", "v", "g", "beta", "h0"))


def _dsa_cases(spec) -> list[Case]:
    from pallas_kernels.dsa import arg_specs, ops, reference  # noqa: PLC0415

    def indexer_args():
        a = arg_specs.make_args(spec)
        return a["q_idx"], a["k_idx"], a["w"]

    def indexer_fn(impl, interpret):
        impl = "xla" if impl == "oracle" else impl
        kw = dict(interpret=interpret) if impl == "pallas" else {}
        return lambda qi, ki, w: ops.indexer_scores(qi, ki, w, impl=impl, **kw)

    def attention_args():
        a = arg_specs.make_args(spec)
        scores = reference.indexer_scores(a["q_idx"], a["k_idx"], a["w"])
        idx = ops.select_topk(scores, spec.topk, q_offset=spec.offset_array)
        return a["q"], a["kv"], idx

    def attention_fn(impl, interpret):
        impl = "xla" if impl == "oracle" else impl
        kw = dict(interpret=interpret) if impl == "pallas" else {}
        return lambda q, kv, idx: ops.sparse_attention_with_lse(
            q, kv, idx, scale=spec.scale, v_dim=spec.v_dim, impl=impl, **kw)

    return [Case("dsa_indexer", spec.name, spec.dtype, indexer_args, indexer_fn, (0, 1, 2),
                 ("scores",), ("q_idx", "k_idx", "w")),
            Case("dsa_attention", spec.name, spec.dtype, attention_args, attention_fn, (0, 1),
                 ("o", "lse"), ("q", "kv", "indices"))]


def _mxfp4_fn(op):
    def fn(impl, interpret):
        impl = "xla" if impl == "oracle" else impl
        kw = dict(interpret=interpret) if impl == "pallas" else {}
        return lambda x, *rest: op(x, *rest, impl=impl, **kw)
    return fn


def _mxfp4_matmul_case(spec) -> Case:
    from pallas_kernels.mxfp4 import arg_specs, ops  # noqa: PLC0415

    return Case("mxfp4_matmul", spec.name, spec.dtype, lambda: arg_specs.make_matmul_args(spec),
                _mxfp4_fn(ops.mxfp4_matmul), (0,), ("y",), ("x", "w"))


def _mxfp4_grouped_case(spec) -> Case:
    from pallas_kernels.mxfp4 import arg_specs, ops  # noqa: PLC0415

    return Case("mxfp4_grouped", spec.name, spec.dtype, lambda: arg_specs.make_grouped_args(spec),
                _mxfp4_fn(ops.grouped_mxfp4_matmul), (0,), ("y",), ("x", "w", "group_sizes"))


def cases(size: str = "small", kernels=lowering.KERNEL_NAMES) -> list[Case]:
    """The cases of one size ("small" or "bench") for the named kernels, in KERNEL_NAMES order."""
    from pallas_kernels.dsa import arg_specs as dsa_specs  # noqa: PLC0415
    from pallas_kernels.kda import arg_specs as kda_specs  # noqa: PLC0415
    from pallas_kernels.mxfp4 import arg_specs as mx_specs  # noqa: PLC0415

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    unknown = sorted(set(kernels) - set(lowering.KERNEL_NAMES))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; valid: {list(lowering.KERNEL_NAMES)}")
    rep = lowering.REPRESENTATIVE
    if size == "small":
        kda = [s for s in kda_specs.PALLAS if s.name == rep["kda"]]
        dsa = [dsa_specs.TEST_SPECS_BY_NAME[rep["dsa_attention"]]]
        mm = [s for s in mx_specs.MATMUL_SPECS if s.name == rep["mxfp4_matmul"]]
        grouped = [s for s in mx_specs.GROUPED_SPECS if s.name == rep["mxfp4_grouped"]]
    else:
        kda = [kda_specs.BENCH[1]]  # B=1 H=16 K=V=128 T=2048
        s4096 = next(s for s in dsa_specs.bench_specs(quick=False) if s.s == 4096)
        dsa = [s4096.with_dtype("bfloat16")]
        mm = list(mx_specs.BENCH_SPECS["device"])  # decode M=8 and prefill M=2048, N=K=8192
        grouped = [mx_specs.GroupedSpec("moe_m2048_e8", m=2048, n=4096, k=4096,
                                        group_sizes=(256,) * 8)]
    # small shapes: heuristic tiles (the specs' pinned tiles are for the interpret tests)
    mm = [dataclasses.replace(s, config=None) for s in mm]
    grouped = [dataclasses.replace(s, config=None) for s in grouped]
    out = {"kda": [_kda_case(s) for s in kda],
           "dsa_indexer": [c for s in dsa for c in _dsa_cases(s) if c.kernel == "dsa_indexer"],
           "dsa_attention": [c for s in dsa for c in _dsa_cases(s) if c.kernel == "dsa_attention"],
           "mxfp4_matmul": [_mxfp4_matmul_case(s) for s in mm],
           "mxfp4_grouped": [_mxfp4_grouped_case(s) for s in grouped]}
    return [c for k in lowering.KERNEL_NAMES if k in kernels for c in out[k]]


# ------------------------------------------------------------------------------------------------
# Numerics and timing.
# ------------------------------------------------------------------------------------------------


def rel_rms(x, ref) -> float:
    """sqrt(mean((x - ref)^2) / mean(ref^2)) over the entries where ref is finite; inf when the
    non-finite entries of x and ref differ (a NaN or inf where the oracle has none, or the
    reverse)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {x.shape} vs the reference's {ref.shape}")
    fin = np.isfinite(ref)
    same = np.array_equal(fin, np.isfinite(x)) and np.array_equal(x[~fin], ref[~fin],
                                                                  equal_nan=True)
    if not same:
        return float("inf")
    x, ref = x[fin], ref[fin]
    if x.size == 0:
        return 0.0
    return float(np.sqrt(np.mean((x - ref) ** 2) / max(np.mean(ref**2), 1e-300)))


def _floats(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def fwd_bwd(f: Callable, argnums: tuple[int, ...]) -> Callable:
    """jit(args, cotangents) -> (outputs, gradients w.r.t. argnums): one forward and one VJP.
    cotangents: one array per floating output (in the order of jax.tree.leaves)."""

    @jax.jit
    def run(args, cts):
        def diff(*xs):
            full = list(args)
            for i, x in zip(argnums, xs, strict=True):
                full[i] = x
            return f(*full)

        outs, vjp = jax.vjp(diff, *(args[i] for i in argnums))
        leaves, treedef = jax.tree.flatten(outs)
        it = iter(cts)
        ct_leaves = [(jnp.where(jnp.isfinite(o), next(it).astype(o.dtype), 0)
                      if jnp.issubdtype(o.dtype, jnp.floating)
                      else np.zeros(o.shape, jax.dtypes.float0)) for o in leaves]
        return outs, vjp(jax.tree.unflatten(treedef, ct_leaves))

    return run


def _upcast(args):
    return tuple(jax.tree.map(lambda a: a.astype(jnp.float32)
                              if jnp.issubdtype(a.dtype, jnp.floating) else a, x) for x in args)


def median_seconds(fn: Callable, *args, reps: int = 5, budget_s: float = 1.0) -> float:
    """Median wall seconds of fn(*args) over at least `reps` calls (more while within
    budget_s, at most 50), after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < reps or (time.perf_counter() < end and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_case(case: Case, *, interpret: bool | None = None, timing: bool = True,
               reps: int = 5, seed: int = 0) -> dict:
    """Numerics (and with timing=True, speed) of one case; see the module docstring.
    interpret: None -> interpret unless this platform compiles the kernel."""
    from pallas_kernels import backend  # noqa: PLC0415

    _, interp = backend.resolve(None, interpret)
    args = case.make_args()
    out_shapes = jax.eval_shape(case.fn("xla", None), *args)
    rng = np.random.default_rng(seed)
    cts = [jnp.asarray(rng.standard_normal(o.shape).astype(np.float32))
           for o in _floats(out_shapes)]
    pallas = fwd_bwd(case.fn("pallas", interp), case.argnums)
    oracle = fwd_bwd(case.fn("oracle", None), case.argnums)
    got, want = pallas(args, cts), oracle(_upcast(args), cts)
    fwd = {n: rel_rms(x, y) for n, x, y in zip(case.out_names, _floats(got[0]),
                                                 _floats(want[0]), strict=True)}
    bwd = {"d" + case.arg_names[i]: rel_rms(x, y) for i, x, y in zip(
        case.argnums, _floats(got[1]), _floats(want[1]), strict=True)}
    errors = {**fwd, **bwd}
    row = {"kernel": case.kernel, "case": case.name, "dtype": case.dtype,
           "backend": jax.default_backend(), "interpret": interp,
           "max_fwd_err": max(fwd.values()), "max_bwd_err": max(bwd.values(), default=0.0),
           "errors": errors, "tolerance": case.tolerance}
    row["ok"] = all(e < case.tolerance for e in errors.values())
    if timing:
        budget = 0.2 if interp else 1.0
        xla = fwd_bwd(case.fn("xla", None), case.argnums)
        f_pallas, f_xla = jax.jit(case.fn("pallas", interp)), jax.jit(case.fn("xla", None))
        row["pallas_fwd_ms"] = 1e3 * median_seconds(f_pallas, *args, reps=reps, budget_s=budget)
        row["xla_fwd_ms"] = 1e3 * median_seconds(f_xla, *args, reps=reps, budget_s=budget)
        row["pallas_fwd_bwd_ms"] = 1e3 * median_seconds(pallas, args, cts, reps=reps,
                                                        budget_s=budget)
        row["xla_fwd_bwd_ms"] = 1e3 * median_seconds(xla, args, cts, reps=reps, budget_s=budget)
        row["speedup_fwd"] = row["xla_fwd_ms"] / row["pallas_fwd_ms"]
        row["speedup_fwd_bwd"] = row["xla_fwd_bwd_ms"] / row["pallas_fwd_bwd_ms"]
    return row


def run(size: str = "small", kernels=lowering.KERNEL_NAMES, *, interpret: bool | None = None,
        timing: bool = True, reps: int = 5, verbose: bool = True) -> list[dict]:
    """check_case over cases(size, kernels); an exception in one case becomes a failed row
    (ok False, its error message) and the others still run."""
    rows = []
    for case in cases(size, kernels):
        t0 = time.perf_counter()
        try:
            row = check_case(case, interpret=interpret, timing=timing, reps=reps)
        except Exception as e:  # noqa: BLE001 (reported in the row, not hidden)
            row = {"kernel": case.kernel, "case": case.name, "dtype": case.dtype,
                   "backend": jax.default_backend(), "ok": False,
                   "error": f"{type(e).__name__}: {e}"[:2000]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        if verbose:
            print(f"{'ok  ' if row['ok'] else 'FAIL'} {case.kernel}:{case.name} "
                  f"({row['seconds']:.1f} s)" + (f" {row['error']}" if "error" in row else ""),
                  flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a text table, with a line saying whether the Pallas times are interpreted."""
    timed = any("pallas_fwd_ms" in r for r in rows)
    head = (f"{'kernel':<14}{'case':<22}{'dtype':<9}{'fwd err':>9}{'bwd err':>9}{'tol':>8} "
            f"{'ok':<4}")
    if timed:
        head += (f"{'pallas fwd':>11}{'xla fwd':>10}{'x':>6}{'pallas f+b':>11}{'xla f+b':>10}"
                 f"{'x':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kernel']:<14}{r['case']:<22}{r['dtype']:<9}FAILED: {r['error']}")
            continue
        line = (f"{r['kernel']:<14}{r['case']:<22}{r['dtype']:<9}{r['max_fwd_err']:>9.1e}"
                f"{r['max_bwd_err']:>9.1e}{r['tolerance']:>8.0e} {'yes' if r['ok'] else 'NO':<4}")
        if "pallas_fwd_ms" in r:
            line += (f"{r['pallas_fwd_ms']:>9.2f}ms{r['xla_fwd_ms']:>8.2f}ms"
                     f"{r['speedup_fwd']:>5.2f}x{r['pallas_fwd_bwd_ms']:>9.2f}ms"
                     f"{r['xla_fwd_bwd_ms']:>8.2f}ms{r['speedup_fwd_bwd']:>5.2f}x")
        lines.append(line)
    backends = sorted({r.get("backend", "?") for r in rows})
    if any(r.get("interpret") for r in rows):
        lines.append(f"backend {', '.join(backends)}: Pallas kernels ran in INTERPRET mode "
                     "(errors are real; Pallas times measure the interpreter, not the kernel, "
                     "so the speedups are not a performance result)")
    else:
        lines.append(f"backend {', '.join(backends)}: compiled Pallas kernels; times are medians "
                     "after a warm-up; x = XLA time / Pallas time")
    ok = sum(bool(r.get("ok")) for r in rows)
    lines.append(f"numerics: {ok}/{len(rows)} cases within tolerance (relative RMS error of "
                 "outputs and gradients against the f32 oracle)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=SIZES)
    p.add_argument("--kernels", nargs="+", default=list(lowering.KERNEL_NAMES),
                   choices=lowering.KERNEL_NAMES)
    p.add_argument("--no-timing", dest="timing", action="store_false",
                   help="numerics only")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--target", help="compile for this TPU instead of checking numerics here: "
                   "tpu:v5p, tpu:v5e, tpu:v6e or a topology name (pallas_kernels.tpu_compile)")
    p.add_argument("--presets", nargs="+", default=None,
                   help="with --target: model presets whose per-device shapes are compiled "
                   "(default: tiny small reference_2p8t)")
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"],
                   help="with --target: forward and/or forward+backward programs")
    args = p.parse_args(argv)
    if args.target:
        from pallas_kernels import tpu_compile  # noqa: PLC0415

        presets = args.presets or list(tpu_compile.PRESETS)
        bad = sorted(set(presets) - set(tpu_compile.PRESETS))
        if bad:
            p.error(f"unknown presets {bad}; valid: {sorted(tpu_compile.PRESETS)}")
        return tpu_compile.main(args.target, presets, args.kernels, args.modes, args.json)
    if args.presets:
        p.error("--presets needs --target (it picks TPU compile shapes)")
    rows = run(args.size, args.kernels, timing=args.timing)
    print(format_table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
