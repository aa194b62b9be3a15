"""ejkernel 0.0.80.3's chunked "kernel delta attention" (XLA) on the KDA benchmark shapes.

Run with the PEER's python from the repository root (its own venv, jax 0.10.2 like the project):

    ~/peer-venvs/ejkernel/bin/python -m benchmarks.peers.ejkernel_kda --T 512 --reps 3

The project's driver (benchmarks/kda.py --peer) starts it with --serve and alternates with it:
after compiling and one warm-up of each mode it prints one JSON line {"ready": ...}, then for
every line "fwd" or "fwdbwd" read on stdin it times one call and prints {"mode", "s" (wall),
"cpu_s" (this process's CPU seconds, all threads), "foreign_cores"}; "quit" (or end of input) stops it. Without --serve it times `reps` rounds
itself and prints one JSON record.

Inputs: the recipe of pallas_kernels/kda/arg_specs.py:make_args (B=1, [B,T,H,K] layout, q and k
L2-normalised, v normal, g = -gate * U(0, 2) per key channel, beta = sigmoid(normal), same keys),
rebuilt here because this process does not import the project. ejkernel's op takes ONE decay
per head and token ([B,T,H]): it gets the first key channel's gate g[..., 0], so it does less work
than KDA's per-channel gate (the README of the peer scripts says the same). fwd+bwd: jax.grad of
sum(o^2) w.r.t. q, k, v, its gate and beta, like the project side.

Agreement first: on a small case (T=256, per-head gates of about -0.1) its output is compared
with a plain lax.scan KDA recurrence fed the same gate on every key channel; the max abs
difference is part of the "ready" record (a wrong call would show here, not as a fast number).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.peers import cpu_point, foreign_cores, loadavg


def make_inputs(jax, jnp, B, T, H, K, V, gate, seed=0):
    """arg_specs.make_args' recipe (f32, no initial state)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (B, T, H, K), jnp.float32))
    k = unit(jax.random.normal(ks[1], (B, T, H, K), jnp.float32))
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.float32)
    g = -gate * jax.random.uniform(ks[3], (B, T, H, K), jnp.float32, 0.0, 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    return q, k, v, g, beta


def scan_kda(jax, jnp, q, k, v, g, beta):
    """Token-by-token KDA (per-channel gate g [B,T,H,K]); the agreement oracle."""
    scale = q.shape[-1] ** -0.5

    def step(S, x):  # S: [B,H,K,V]
        qt, kt, vt, gt, bt = x
        S = S * jnp.exp(gt)[..., None]
        r = vt - jnp.einsum("bhk,bhkv->bhv", kt, S)
        S = S + jnp.einsum("bhk,bhv->bhkv", bt[..., None] * kt, r)
        return S, jnp.einsum("bhk,bhkv->bhv", scale * qt, S)

    B, _, H, K = q.shape
    S0 = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    return jnp.moveaxis(jax.lax.scan(step, S0, xs)[1], 0, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--gate", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=64, help="ejkernel's chunk_size")
    p.add_argument("--reps", type=int, default=5, help="rounds without --serve")
    p.add_argument("--serve", action="store_true", help="time one call per stdin line")
    args = p.parse_args(argv)

    import importlib.metadata as md

    import jax
    import jax.numpy as jnp
    from ejkernel.kernels._xla.kernel_delta_attention import kernel_delta_attention

    B, T, H, K = 1, args.T, args.H, args.K
    V = K

    def op(q, k, v, gh, beta):
        return kernel_delta_attention(q, k, v, beta, gh, use_qk_l2norm=False, use_chunked=True,
                                      chunk_size=args.chunk)[0]

    # Agreement: per-head gates, so KDA and the peer's op compute the same thing.
    q, k, v, g, beta = make_inputs(jax, jnp, B, 256, H, K, V, 0.1, seed=1)
    gh = g[..., 0]
    g_same = jnp.broadcast_to(gh[..., None], g.shape)
    o_peer = jax.jit(op)(q, k, v, gh, beta)
    o_ref = jax.jit(lambda *a: scan_kda(jax, jnp, *a))(q, k, v, g_same, beta)
    agree = {"T": 256, "max_abs_diff_vs_scan": float(jnp.max(jnp.abs(o_peer - o_ref))),
             "out_max_abs": float(jnp.max(jnp.abs(o_ref)))}

    q, k, v, g, beta = make_inputs(jax, jnp, B, T, H, K, V, args.gate)
    xs = (q, k, v, g[..., 0], beta)  # the first key channel's gate
    fns = {"fwd": jax.jit(op),
           "fwdbwd": jax.jit(jax.grad(lambda *a: jnp.sum(jnp.square(op(*a))),
                                      argnums=(0, 1, 2, 3, 4)))}
    compile_s = {}
    for name, f in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(*xs))
        compile_s[name] = time.perf_counter() - t0
        jax.block_until_ready(f(*xs))  # warm

    def timed(name):
        a = cpu_point()
        jax.block_until_ready(fns[name](*xs))
        b = cpu_point()
        return {"mode": name, "s": b[0] - a[0], "cpu_s": b[2] - a[2],
                "foreign_cores": foreign_cores(a, b)}

    head = {"peer": "ejkernel", "versions": {n: md.version(n) for n in ("ejkernel", "jax", "jaxlib")},
            "B": B, "T": T, "H": H, "K": K, "V": V, "gate": args.gate, "chunk": args.chunk,
            "agreement": agree, "first_call_s": compile_s}
    if args.serve:
        print(json.dumps({"ready": head}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd not in fns:
                print(json.dumps({"error": f"unknown command {cmd!r}: send fwd, fwdbwd or quit"}),
                      flush=True)
                continue
            print(json.dumps(timed(cmd)), flush=True)
        return 0
    samples = {n: [] for n in fns}
    for _ in range(args.reps):
        for n in fns:
            samples[n].append(timed(n)["s"])
    head.update(samples=samples, median_s={n: statistics.median(s) for n, s in samples.items()},
                loadavg=loadavg())
    print(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
