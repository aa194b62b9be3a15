"""Process set-up that runs before jax is imported, below every other package: model,
pallas_kernels, rl, benchmarks, scripts and the tests import it, and it imports none of them.

  runtime/xla_env.py  XLA_FLAGS, the jemalloc re-execution, threefry unrolled on CPU
"""
