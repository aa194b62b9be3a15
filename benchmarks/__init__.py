"""Benchmarks, one module per topic, each with `run(quick: bool) -> dict` (printed tables, the
numbers returned for --json). The entry point is scripts/bench.py (`python scripts/bench.py NAME
[--quick] [--json OUT]`); the sandbox parts also run alone with `python -m benchmarks.<module>`
from the repository root. They report ratios measured side by side in one run; speed targets
live here, never as timed assertions in tests, and the library packages hold no timing code
(the one shared kernel timer is pallas_kernels.check.median_seconds).

  kda               recurrent / chunked (autodiff) / chunked_vjp KDA, forward and backward
                    (--peer: ejkernel in its own venv; the Pallas kernel on GPU/TPU)
  dsa               token-sparse vs dense causal attention by length, crossover
  mxfp4             MXFP4 vs bf16 bytes and matmul time, model decode with MXFP4 experts
  moe               expert-parallel vs local MoE dispatch on 8 host devices (a child process)
  rl_loop           sampler with cache vs recompute, train step time, RL iteration split
  rollouts          prefix sharing and row refill vs the plain sampler
  speculative       MTP speculative (k drafts) vs plain decoding
  grpo_peer         GRPO iteration vs google-tunix on matched work (grpo_matched: the project
                    side; peers/: scripts run with the peer's own python, scripts/setup_peers.sh)
  sandbox_pool      isolated runs/s and latency vs a plain subprocess (calls the three below)
  sandbox_http      the HTTP server as its own process
  sandbox_load      mixed load with adversarial programs and reward hacks
  sandbox_sessions  multi-command sessions through the pool and the HTTP server
  loadgen           the closed-loop load generator the sandbox benchmarks share
"""
