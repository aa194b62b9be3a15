"""Benchmarks: `python scripts/bench.py NAME [NAME ...] [--quick] [--json OUT]`.

Every benchmark reports ratios measured side by side in one run (never absolute targets inside
tests). The benchmarks live in benchmarks/ (one module per topic); this file only dispatches:

  kda      recurrent / chunked / chunked_vjp KDA fwd and fwd+bwd (and the Pallas kernel on
           GPU/TPU; `python -m benchmarks.kda --peer` adds ejkernel)
  dsa      token-sparse vs dense causal attention by length, crossover
  mxfp4    MXFP4 vs bf16 bytes and matmul time (decode M=8, prefill M=2048)
  sandbox  isolated runs/s and latency vs a plain subprocess, and through the HTTP server
  rl       sampler with cache vs recompute, train step time, RL iteration split
  rollouts prefix sharing and row refill vs the plain sampler (RL and eval batch shapes);
           multi-turn episodes with the turn cache vs re-reading the context every turn
  spec     MTP speculative (k = 1, 2, 3 drafts) vs plain decoding: tokens/s, acceptance per
           draft position, trunk passes per token, greedy outputs identical
  moe      expert-parallel dispatch vs local dispatch on 8 host devices
  peer     GRPO iteration split and decode tokens/s vs google-tunix 0.1.7 on matched work
           (fresh processes per side; the peer's venv: bash scripts/setup_peers.sh)
"""

import argparse
import importlib
import json

import _common  # XLA flags before jax, compilation cache

_common.setup_jax()

BENCHMARKS = {
    "kda": "benchmarks.kda",
    "dsa": "benchmarks.dsa",
    "mxfp4": "benchmarks.mxfp4",
    "sandbox": "benchmarks.sandbox_pool",
    "rl": "benchmarks.rl_loop",
    "rollouts": "benchmarks.rollouts",
    "spec": "benchmarks.speculative",
    "moe": "benchmarks.moe",
    "peer": "benchmarks.grpo_peer",
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("names", nargs="+", choices=sorted(BENCHMARKS) + ["all"])
    p.add_argument("--json", help="write all results to this JSON file")
    p.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = p.parse_args(argv)
    names = sorted(BENCHMARKS) if "all" in args.names else args.names
    results = {}
    for name in names:
        mod = importlib.import_module(BENCHMARKS[name])
        print(f"== {name} ==", flush=True)
        results[name] = mod.run(quick=args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
