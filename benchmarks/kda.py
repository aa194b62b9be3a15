"""KDA benchmark: the recurrent scan, the chunked form (autodiff backward), the chunked form with
the hand-written backward (`chunked_vjp`), the Pallas kernel on GPU/TPU, and optionally the
ejkernel peer, side by side.

    python scripts/bench.py kda [--quick]           # project implementations
    python -m benchmarks.kda --peer [--rounds 5]    # + ejkernel on the issue's shape

Shapes come from `arg_specs.BENCH` (`BENCH_QUICK` when quick): the DESIGN.md target (B=1, H=4,
K=V=128, T=2048) and B=1, H=16, K=V=128 at T in {2048, 8192}; f32, gates of about -1 per token.
Per shape, in one process, every implementation runs once per round in a rotated order
(alternating, so load changes hit all alike), forward and forward+backward (jax.grad of sum(o^2)
w.r.t. q, k, v, g, beta); medians over rounds of wall seconds and of the CPU seconds of the
process that ran the call (all its threads: the work, less sensitive to other load), with the
load average per round and the cores other processes kept busy per sample (`foreign_cores`). The recurrent fwd+bwd rematerialises
every 64 tokens (a plain scan keeps a [B,H,K,V] state per token: 8.6 GB at H=16, T=8192).
Ratios printed: chunked_vjp / chunked and chunked / recurrent (speed-ups, > 1 is faster).

Prefill mode (--prefill): the short cached calls of a sampler (prefill, an agent turn's
extension; `KDAConfig.recurrent_max_len` picks between the two), on `arg_specs.make_args`
inputs (gates of about -1 per token) from a random f32 state with the final state out, for
the chunked form (`chunked_vjp`'s forward) and the token recurrence:
per (B, H, K=V, T) of `PREFILL_SHAPES` the first call's seconds (trace + compile + run, the
compilation cache off) and the median run time over alternating rounds.

    python -m benchmarks.kda --prefill [--rounds 15]

Peer mode (--peer, or KDA_BENCH_PEER=1 under scripts/bench.py): on the issue's shape only
(BENCH[0]), ejkernel 0.0.80.3's chunked XLA op runs in its own process with its own python
(benchmarks/peers/ejkernel_kda.py --serve; interpreter: $KDA_PEER_PYTHON, default
~/peer-venvs/ejkernel/bin/python), same XLA_FLAGS, and is timed once per round in the same
rotation (this process waits while it runs). It gets the first key channel's gate (one decay
per head: less work than KDA's per-channel gate). Ratios printed: peer time / project time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

if __name__ == "__main__":  # XLA flags before jax (scripts/bench.py does this itself)
    from runtime.xla_env import configure_xla_env

    configure_xla_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.peers import cpu_point, foreign_cores, loadavg  # noqa: E402
from pallas_kernels.kda import arg_specs, chunked_vjp, reference  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PEER_PYTHON_ENV = "KDA_PEER_PYTHON"
PEER_ENV = "KDA_BENCH_PEER"
DEFAULT_PEER_PYTHON = "~/peer-venvs/ejkernel/bin/python"


def _impls(on_accel: bool) -> dict:
    """name -> (forward fn, the forward differentiated for fwd+bwd); fn(q, k, v, g, b) -> o."""
    impls = {
        "recurrent": (
            lambda q, k, v, g, b: reference.kda_recurrent(q, k, v, g, b)[0],
            lambda q, k, v, g, b: reference.kda_recurrent(q, k, v, g, b, remat_every=64)[0],
        ),
        "chunked": (lambda q, k, v, g, b: reference.kda_chunked(q, k, v, g, b)[0],) * 2,
        "chunked_vjp": (lambda q, k, v, g, b: chunked_vjp.kda_chunked_vjp(q, k, v, g, b)[0],) * 2,
    }
    if on_accel:
        from pallas_kernels.kda import pallas_kda  # noqa: PLC0415

        f = lambda q, k, v, g, b: pallas_kda.kda_pallas(q, k, v, g, b, interpret=False)[0]
        impls["pallas"] = (f, f)
    return impls


class PeerProcess:
    """benchmarks/peers/ejkernel_kda.py --serve under the peer's python: one timed call per
    request. Raises RuntimeError (what went wrong, how to fix it) if it cannot start."""

    def __init__(self, spec, python: str | None = None):
        py = os.path.expanduser(python or os.environ.get(PEER_PYTHON_ENV) or DEFAULT_PEER_PYTHON)
        if not os.path.exists(py):
            raise RuntimeError(
                f"no peer interpreter at {py}: make the ejkernel venv (python3 -m venv "
                f"~/peer-venvs/ejkernel && ~/peer-venvs/ejkernel/bin/pip install "
                f"ejkernel==0.0.80.3 jax==0.10.2 jaxlib==0.10.2) or set {PEER_PYTHON_ENV}")
        if spec.B != 1 or spec.K != spec.V or spec.dtype != "float32":
            raise RuntimeError(f"the peer script takes B=1, K=V, f32; got {spec}")
        cmd = [py, "-m", "benchmarks.peers.ejkernel_kda", "--serve", "--T", str(spec.T),
               "--H", str(spec.H), "--K", str(spec.K), "--gate", str(spec.gate)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process ended before it was ready: {' '.join(cmd)} "
                               f"(exit code {self.proc.wait()}; its stderr is above)")
        self.info = json.loads(line)["ready"]

    def time(self, mode: str) -> tuple[float, float]:
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        if "error" in r:
            raise RuntimeError(r["error"])
        return r["s"], r["cpu_s"], r["foreign_cores"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _rounds(calls: dict, rounds: int) -> dict:
    """calls: name -> () -> (wall s, CPU s of the process that ran it, foreign cores). Every
    name once per round, order rotated. Returns {"samples", "cpu_samples", "foreign_cores",
    "loadavg_per_round", "median_s", "median_cpu_s"}."""
    names = list(calls)
    samples = {n: [] for n in names}
    cpu = {n: [] for n in names}
    foreign = {n: [] for n in names}
    loads = []
    for r in range(rounds):
        loads.append(loadavg())
        for n in names[r % len(names):] + names[: r % len(names)]:
            s, c, f = calls[n]()
            samples[n].append(s)
            cpu[n].append(c)
            foreign[n].append(round(f, 2))
    return {"samples": samples, "cpu_samples": cpu, "foreign_cores": foreign,
            "loadavg_per_round": loads,
            "median_s": {n: statistics.median(v) for n, v in samples.items()},
            "median_cpu_s": {n: statistics.median(v) for n, v in cpu.items()}}


def _local_call(fn, args):
    def call():
        a = cpu_point()
        jax.block_until_ready(fn(*args))
        b = cpu_point()
        return b[0] - a[0], b[2] - a[2], foreign_cores(a, b)

    return call


def _ratio(times: dict, name: str) -> float:
    """"<mode>_<a>_speedup_over_<b>" -> times[<mode>/<b>] / times[<mode>/<a>]."""
    mode, rest = name.split("_", 1)
    a, b = rest.split("_speedup_over_")
    return times[f"{mode}/{b}"] / times[f"{mode}/{a}"]


# (B, H, K = V, T): the demo's prefill (K 48, prompts of 72 tokens, groups of 4 -> 8 distinct
# prompts; 32 rows without prefix sharing), the matched benchmark's K 64, and K 128 (`small`)
PREFILL_SHAPES = ((8, 2, 48, 72), (32, 2, 48, 72), (8, 2, 48, 128), (8, 4, 64, 32),
                  (8, 4, 64, 128), (32, 4, 64, 32), (8, 4, 128, 64), (8, 4, 128, 128))


def prefill(rounds: int = 15, shapes=PREFILL_SHAPES) -> dict:
    """The --prefill table (module docstring): {"B,H,K,T": {impl: {"first_s", "run_ms"},
    "max_abs_diff": the largest difference between the two forms' outputs and final states}}."""
    impls = {"chunked": chunked_vjp.kda_chunked_vjp, "recurrent": reference.kda_recurrent}
    out = {}
    print(f"prefill (cached call, f32 state in and out): first call s / median run ms over "
          f"{rounds} alternating rounds")
    for B, H, K, T in shapes:
        a = arg_specs.make_args(arg_specs.KDASpec("prefill", B=B, T=T, H=H, K=K, V=K, gate=1.0))
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["initial_state"])
        fns, row, outs = {}, {}, {}
        for name, fn in impls.items():
            fns[name] = jax.jit(lambda q, k, v, g, b, s, fn=fn: fn(
                q, k, v, g, b, initial_state=s, output_final_state=True))
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(fns[name](*args))
            row[name] = {"first_s": time.perf_counter() - t0}
        # the two forms compute the same outputs and final state (up to f32 rounding)
        row["max_abs_diff"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
            outs["chunked"], outs["recurrent"]))
        times = {n: [] for n in fns}
        for r in range(rounds):
            for name in list(fns)[r % 2:] + list(fns)[:r % 2]:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[name](*args))
                times[name].append(time.perf_counter() - t0)
        for name in fns:
            row[name]["run_ms"] = statistics.median(times[name]) * 1e3
        c, r = row["chunked"], row["recurrent"]
        print(f"  B={B:<3} H={H} K=V={K:<3} T={T:<4} chunked {c['first_s']:.2f} s / "
              f"{c['run_ms']:.2f} ms   recurrent {r['first_s']:.2f} s / {r['run_ms']:.2f} ms"
              f"   max |diff| {row['max_abs_diff']:.1e}")
        out[f"{B},{H},{K},{T}"] = row
    return out


def run(quick: bool = False, peer: bool | None = None, rounds: int | None = None) -> dict:
    peer = os.environ.get(PEER_ENV) == "1" if peer is None else peer
    specs = (arg_specs.BENCH[0],) if peer else (arg_specs.BENCH_QUICK if quick else arg_specs.BENCH)
    rounds = rounds or (3 if quick else 5)
    on_accel = jax.default_backend() != "cpu"
    impls = _impls(on_accel)
    results = {"backend": jax.default_backend(), "rounds": rounds, "shapes": {}}
    for spec in specs:
        a = arg_specs.make_args(spec)
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
        calls = {}
        for name, (fwd, fwd_for_grad) in impls.items():
            loss = lambda *xs, fn=fwd_for_grad: jnp.sum(jnp.square(fn(*xs).astype(jnp.float32)))
            fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
            f = jax.jit(fwd)
            for fn in (f, fb):  # compile + one warm-up each
                jax.block_until_ready(fn(*args))
                jax.block_until_ready(fn(*args))
            calls[f"fwd/{name}"] = _local_call(f, args)
            calls[f"fwdbwd/{name}"] = _local_call(fb, args)
        proc = None
        if peer:
            proc = PeerProcess(spec)
            calls["fwd/ejkernel"] = functools.partial(proc.time, "fwd")
            calls["fwdbwd/ejkernel"] = functools.partial(proc.time, "fwdbwd")
        try:
            row = _rounds(calls, rounds)
        finally:
            if proc is not None:
                proc.close()
        if proc is not None:
            row["peer"] = proc.info
        med, cpu = row["median_s"], row["median_cpu_s"]
        print(f"{spec.name}: B={spec.B} T={spec.T} H={spec.H} K={spec.K} V={spec.V} f32, "
              f"median of {rounds} alternating rounds; load {row['loadavg_per_round']}")
        print(f"  {'impl':>12} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd+bwd tok/s':>14}"
              f" {'fwd cpu ms':>11} {'fwd+bwd cpu ms':>15}")
        for name in [n.split("/", 1)[1] for n in med if n.startswith("fwd/")]:
            tf, tfb = med[f"fwd/{name}"], med[f"fwdbwd/{name}"]
            print(f"  {name:>12} {tf * 1e3:>9.1f} {tfb * 1e3:>11.1f} {spec.tokens / tfb:>14,.0f}"
                  f" {cpu[f'fwd/{name}'] * 1e3:>11.1f} {cpu[f'fwdbwd/{name}'] * 1e3:>15.1f}")
        names = ["fwdbwd_chunked_vjp_speedup_over_chunked",
                 "fwdbwd_chunked_vjp_speedup_over_recurrent", "fwd_chunked_speedup_over_recurrent"]
        if peer:
            names += ["fwd_chunked_speedup_over_ejkernel", "fwdbwd_chunked_speedup_over_ejkernel",
                      "fwdbwd_chunked_vjp_speedup_over_ejkernel"]
        ratios = {k: _ratio(med, k) for k in names}
        by_cpu = {k: _ratio(cpu, k) for k in ratios}
        for k, v in ratios.items():
            print(f"  {k}: {v:.2f}x wall ({by_cpu[k]:.2f}x by CPU seconds)")
        row["ratios_by_cpu_s"] = by_cpu
        row["ratios"] = ratios
        results["shapes"][spec.name] = {"B": spec.B, "T": spec.T, "H": spec.H, "K": spec.K,
                                        "V": spec.V, **row}
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="BENCH_QUICK shapes, 3 rounds")
    p.add_argument("--peer", action="store_true", help="add ejkernel on the issue's shape")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 5, quick 3, prefill 15)")
    p.add_argument("--prefill", action="store_true",
                   help="short cached calls: chunked form vs token recurrence")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    if args.prefill:
        jax.config.update("jax_enable_compilation_cache", False)  # first calls compile
        res = prefill(rounds=args.rounds or 15)
    else:
        res = run(quick=args.quick, peer=args.peer, rounds=args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
