"""Cross-platform lowering checks of every compiled Pallas kernel path, from any host (even CPU).

`jax.export.export(jax.jit(fn), platforms=[P])` lowers a function for platform P without P being
present: each `pallas_call` goes through the real backend lowering in Python (Pallas -> Triton IR
for "cuda", Pallas -> Mosaic TPU IR for "tpu") and ends up as one custom call in the StableHLO
module. Nothing is compiled, so this catches lowering-time errors (block-shape rules, primitives
without a lowering rule, dtype problems, the wrong backend being picked) but not what only the
device compiler sees (Triton's / Mosaic's own passes, register or VMEM limits) or numerics.

Every case is checked forward and backward (`jax.value_and_grad` through the custom_vjp), and
the module must contain exactly the expected number of kernel custom calls (so a path that
silently fell back to XLA fails):
  tpu   `tpu_custom_call`. Lowered under an abstract mesh whose device is a TPU of kind
        `TPU_KIND` (Mosaic's block rules for rank-1 blocks read the chip's tiling; on a CPU host
        there is no TPU to ask).
  cuda  the Triton call (`__gpu$xla.gpu.triton`; `triton_kernel_call_ffi` on jaxlib > 0.10.2);
        a Mosaic GPU call (`mosaic_gpu*`) is an error: these kernels are written for Triton.
        Each embedded Triton module is also parsed and run through the MLIR verifier (Triton
        op verifiers: shapes, element types, pointer/tensor consistency).

Cases ("small": the shared arg-spec test shapes; "bench": benchmark-sized shapes):
  kda            ops.kda, fwd 2 kernels, bwd 5 (fwd recomputed + state_bwd + intra_bwd)
  dsa_indexer    ops.indexer_scores, fwd 1, bwd 1 (the backward is the XLA formula)
  dsa_attention  ops.sparse_attention_with_lse, fwd 1, bwd 2
  mxfp4_matmul   ops.mxfp4_matmul (heuristic tiles; bench also vmapped over experts as in the
                 MoE capacity path), fwd 1, bwd 1 (dx is XLA)
  mxfp4_grouped  ops.grouped_mxfp4_matmul (heuristic tiles), fwd 1, bwd 1

    python -m pallas_kernels.lowering [--sizes small bench] [--platforms cuda tpu]
                                      [--kernels kda ...] [--json OUT]

exits non-zero if any case fails (used by tests/pallas_kernels/test_lowering.py and by
`scripts/gpu_check.sh --dry-run`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
import traceback
from collections.abc import Callable

PLATFORMS = ("cuda", "tpu")
KERNEL_NAMES = ("kda", "dsa_indexer", "dsa_attention", "mxfp4_matmul", "mxfp4_grouped")
SIZES = ("small", "bench")
MODES = ("fwd", "bwd")

TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
TPU_KIND = "TPU v5 lite"  # v5e: 16 MiB scoped VMEM default, (8, 128) tiles
TPU_TARGETS = ("tpu_custom_call",)
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")


def family(platform: str) -> str:
    """Kernel family compiled for an export platform."""
    return {"cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}[platform]


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel entry point at one shape.

    make(kernel_family) -> f(*args) running the compiled (interpret=False) kernel; args are
    ShapeDtypeStructs (pytrees allowed); the backward differentiates sum(float outputs) w.r.t.
    `argnums`. n_fwd / n_bwd: kernel custom calls expected in each lowered module.
    """

    kernel: str
    size: str
    name: str
    make: Callable[[str], Callable]
    args: tuple
    argnums: tuple[int, ...]
    n_fwd: int
    n_bwd: int

    @property
    def id(self) -> str:
        return f"{self.kernel}:{self.name}"


# ------------------------------------------------------------------------------------------------
# Cases.
# ------------------------------------------------------------------------------------------------


def _sds(shape, dtype):
    import jax  # noqa: PLC0415

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _kda_cases(size: str) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.kda import arg_specs, ops  # noqa: PLC0415

    specs = ((*arg_specs.PALLAS, arg_specs.PALLAS_BF16) if size == "small"
             else (arg_specs.BENCH[1],))  # B=1 H=16 K=V=128 T=2048
    cases = []
    for spec in specs:
        B, T, H, K, V, dt = spec.B, spec.T, spec.H, spec.K, spec.V, jnp.dtype(spec.dtype)

        def make(fam, spec=spec):
            def f(q, k, v, g, beta, h0):
                return ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               impl="pallas", kernel=fam, interpret=False)
            return f

        args = (_sds((B, T, H, K), dt), _sds((B, T, H, K), dt), _sds((B, T, H, V), dt),
                _sds((B, T, H, K), dt), _sds((B, T, H), dt), _sds((B, H, K, V), jnp.float32))
        cases.append(Case("kda", size, spec.name, make, args, (0, 1, 2, 3, 4, 5), 2, 5))
    return cases


def _dsa_specs(size: str):
    from pallas_kernels.dsa import arg_specs  # noqa: PLC0415

    if size == "small":
        return (*arg_specs.TEST_SPECS, arg_specs.TEST_SPECS[0].with_dtype("bfloat16"))
    s4096 = next(s for s in arg_specs.bench_specs(quick=False) if s.s == 4096)
    return (s4096.with_dtype("bfloat16"),)  # H=16 D=576 v_dim=512 topk=256 S=4096


def _dsa_indexer_cases(size: str) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.dsa import ops  # noqa: PLC0415

    cases = []
    for spec in _dsa_specs(size):
        dt = jnp.dtype(spec.dtype)

        def make(fam):
            return lambda qi, ki, w: ops.indexer_scores(qi, ki, w, impl="pallas", kernel=fam,
                                                        interpret=False)

        args = (_sds((spec.b, spec.t, spec.hi, spec.di), dt), _sds((spec.b, spec.s, spec.di), dt),
                _sds((spec.b, spec.t, spec.hi), jnp.float32))
        cases.append(Case("dsa_indexer", size, spec.name, make, args, (0, 1, 2), 1, 1))
    return cases


def _dsa_attention_cases(size: str) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.dsa import ops  # noqa: PLC0415

    cases = []
    for spec in _dsa_specs(size):
        dt = jnp.dtype(spec.dtype)

        def make(fam, spec=spec):
            return lambda q, kv, idx: ops.sparse_attention_with_lse(
                q, kv, idx, scale=spec.scale, v_dim=spec.v_dim, impl="pallas", kernel=fam,
                interpret=False)

        args = (_sds((spec.b, spec.t, spec.h, spec.d), dt), _sds((spec.b, spec.s, spec.d), dt),
                _sds((spec.b, spec.t, spec.topk), jnp.int32))
        cases.append(Case("dsa_attention", size, spec.name, make, args, (0, 1), 1, 2))
    return cases


def _mx_weight(lead, n, k):
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.mxfp4.reference import MXFP4  # noqa: PLC0415

    return MXFP4(_sds((*lead, n, k // 32, 16), jnp.uint8), _sds((*lead, n, k // 32), jnp.uint8))


def _mxfp4_matmul_cases(size: str) -> list[Case]:
    from pallas_kernels.mxfp4 import arg_specs, ops  # noqa: PLC0415

    specs = (arg_specs.MATMUL_SPECS if size == "small" else (
        arg_specs.MatmulSpec("decode_m8", m=8, n=4096, k=4096),
        arg_specs.MatmulSpec("prefill_m2048", m=2048, n=4096, k=4096),
        arg_specs.MatmulSpec("decode_m8_k2880", m=8, n=5760, k=2880),  # gpt-oss-like ragged K
    ))
    cases = []
    for spec in specs:
        def make(fam):
            # heuristic tiles for the family (the specs' pinned tiles are interpret-test tiles)
            return lambda x, w: ops.mxfp4_matmul(x, w, impl="pallas", kernel=fam,
                                                 interpret=False)

        args = (_sds((*spec.lead, spec.m, spec.k), spec.dtype), _mx_weight((), spec.n, spec.k))
        cases.append(Case("mxfp4_matmul", size, spec.name, make, args, (0,), 1, 1))
    if size == "bench":  # the MoE capacity path (model/layers/moe.py): vmap over 8 experts
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        from pallas_kernels.mxfp4.reference import MXFP4  # noqa: PLC0415

        def make_vmap(fam):
            return lambda xs, w: jax.vmap(lambda xe, be, se: ops.mxfp4_matmul(
                xe, MXFP4(be, se), impl="pallas", kernel=fam, interpret=False))(
                    xs, w.blocks, w.scales)

        args = (_sds((8, 256, 2048), jnp.bfloat16), _mx_weight((8,), 4096, 2048))
        cases.append(Case("mxfp4_matmul", size, "vmap_e8_capacity", make_vmap, args, (0,), 1, 1))
    return cases


def _mxfp4_grouped_cases(size: str) -> list[Case]:
    import jax.numpy as jnp  # noqa: PLC0415

    from pallas_kernels.mxfp4 import arg_specs, ops  # noqa: PLC0415

    specs = (arg_specs.GROUPED_SPECS if size == "small" else (
        arg_specs.GroupedSpec("moe_m2048_e8", m=2048, n=4096, k=4096, group_sizes=(256,) * 8),
        arg_specs.GroupedSpec("moe_m64_e8", m=64, n=4096, k=4096, group_sizes=(8,) * 8),
    ))
    cases = []
    for spec in specs:
        def make(fam):
            return lambda x, w, gs: ops.grouped_mxfp4_matmul(x, w, gs, impl="pallas", kernel=fam,
                                                             interpret=False)

        e = len(spec.group_sizes)
        args = (_sds((spec.m, spec.k), spec.dtype), _mx_weight((e,), spec.n, spec.k),
                _sds((e,), jnp.int32))
        cases.append(Case("mxfp4_grouped", size, spec.name, make, args, (0,), 1, 1))
    return cases


_BUILDERS = {
    "kda": _kda_cases,
    "dsa_indexer": _dsa_indexer_cases,
    "dsa_attention": _dsa_attention_cases,
    "mxfp4_matmul": _mxfp4_matmul_cases,
    "mxfp4_grouped": _mxfp4_grouped_cases,
}


def cases(kernels=KERNEL_NAMES, sizes=SIZES) -> list[Case]:
    return [c for size in sizes for k in kernels for c in _BUILDERS[k](size)]


# One small shape per kernel for the fast test: the most irregular spec of each table.
REPRESENTATIVE = {
    "kda": "pallas_t130_k16_h0",  # T not a multiple of the chunk, initial state
    "dsa_indexer": "odd_chunk",  # odd T, S, heads and dims, q_offset
    "dsa_attention": "odd_chunk",
    "mxfp4_matmul": "ragged_k_bf16",  # K not a multiple of the K tile, partial M / N tiles
    "mxfp4_grouped": "moe_empty_groups",
}


def representative_cases() -> list[Case]:
    """Per kernel: its REPRESENTATIVE small case and its first benchmark-sized case."""
    out = []
    for k in KERNEL_NAMES:
        out.append(next(c for c in _BUILDERS[k]("small") if c.name == REPRESENTATIVE[k]))
        out.append(_BUILDERS[k]("bench")[0])
    return out


# ------------------------------------------------------------------------------------------------
# Export and check.
# ------------------------------------------------------------------------------------------------


def _fn(case: Case, platform: str, mode: str):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    f = case.make(family(platform))
    if mode == "fwd":
        return f

    def loss(*args):
        outs = jax.tree.leaves(f(*args))
        return sum(jnp.sum(o.astype(jnp.float32)) for o in outs
                   if jnp.issubdtype(o.dtype, jnp.floating))

    return jax.value_and_grad(loss, argnums=case.argnums)


def _target_device(platform: str, tpu_kind: str):
    """Context that makes Pallas' chip queries answer for the export target (TPU only)."""
    import contextlib  # noqa: PLC0415

    import jax  # noqa: PLC0415

    if platform != "tpu" or jax.default_backend() == "tpu":
        return contextlib.nullcontext()
    dev = jax.sharding.AbstractDevice(device_kind=tpu_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_lowering",), abstract_device=dev)
    return jax.sharding.use_abstract_mesh(mesh)


def export_text(case: Case, platform: str, mode: str, tpu_kind: str = TPU_KIND) -> str:
    """The lowered StableHLO module (text) of one case; raises what the lowering raises."""
    import jax  # noqa: PLC0415

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TRITON_TARGETS]
    with _target_device(platform, tpu_kind):
        exp = jax.export.export(jax.jit(_fn(case, platform, mode)), platforms=[platform],
                                disabled_checks=checks)(*case.args)
    return exp.mlir_module()


def verify_triton_modules(text: str) -> int:
    """Parse every Triton module embedded in a lowered module and run the MLIR verifier on it.
    Returns how many were verified; raises on the first that fails to parse or verify."""
    from jax._src.interpreters import mlir  # noqa: PLC0415
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.triton import dialect as tt_dialect  # noqa: PLC0415

    n = 0
    with mlir.make_ir_context() as ctx:
        tt_dialect.register_dialect(ctx)
        module = ir.Module.parse(text)

        def walk(op):
            nonlocal n
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        child = child.operation
                        if (child.name == "stablehlo.custom_call"
                                and "mhlo.backend_config" in child.attributes):
                            cfg = child.attributes["mhlo.backend_config"]
                            if "ir" in cfg:
                                kernel = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
                                if not kernel.operation.verify():
                                    raise ValueError("a Triton kernel module fails to verify")
                                n += 1
                        walk(child)

        walk(module.operation)
    return n


def kernel_calls(text: str, platform: str) -> dict[str, int]:
    """Custom-call targets in a lowered module -> count."""
    counts: dict[str, int] = {}
    for t in _CUSTOM_CALL.findall(text):
        counts[t] = counts.get(t, 0) + 1
    return counts


def check_calls(counts: dict[str, int], platform: str, expected: int) -> str | None:
    """None if the module holds exactly `expected` kernel calls of the platform's kind."""
    if platform == "tpu":
        n = sum(counts.get(t, 0) for t in TPU_TARGETS)
    else:
        mosaic = {t: c for t, c in counts.items() if t.startswith("mosaic_gpu")}
        if mosaic:
            return f"lowered through Mosaic GPU, not Triton: {mosaic}"
        n = sum(counts.get(t, 0) for t in TRITON_TARGETS)
    if n != expected:
        return f"expected {expected} kernel custom calls, found {n} (all custom calls: {counts})"
    return None


def run_case(case: Case, platform: str, mode: str) -> dict:
    """Export one case; -> {"ok", "seconds", "calls", "error"}."""
    t0 = time.perf_counter()
    res = {"kernel": case.kernel, "size": case.size, "name": case.name, "platform": platform,
           "mode": mode}
    try:
        text = export_text(case, platform, mode)
        counts = kernel_calls(text, platform)
        err = check_calls(counts, platform, case.n_fwd if mode == "fwd" else case.n_bwd)
        if err is None and platform == "cuda" and "__gpu$xla.gpu.triton" in counts:
            res["triton_verified"] = verify_triton_modules(text)
        res.update(ok=err is None, calls=counts, error=err)
    except Exception as e:  # noqa: BLE001 (reported, not hidden)
        msg = f"{type(e).__name__}: {e}"
        res.update(ok=False, calls={}, error=msg[:4000],
                   traceback=traceback.format_exc(limit=8)[-4000:])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platforms", nargs="+", default=list(PLATFORMS), choices=PLATFORMS)
    p.add_argument("--kernels", nargs="+", default=list(KERNEL_NAMES), choices=KERNEL_NAMES)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--json", help="write the per-case results here")
    args = p.parse_args(argv)
    results = []
    for case in cases(args.kernels, args.sizes):
        for platform in args.platforms:
            for mode in args.modes:
                r = run_case(case, platform, mode)
                results.append(r)
                status = "ok  " if r["ok"] else "FAIL"
                print(f"{status} {platform:4} {mode} {case.size:5} {case.id:40} "
                      f"{r['seconds']:6.2f}s {r['error'] or r['calls']}", flush=True)
    failed = [r for r in results if not r["ok"]]
    print(f"lowering: {len(results) - len(failed)}/{len(results)} ok", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
