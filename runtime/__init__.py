"""The lowest layer, below every other package: model, pallas_kernels, rl, train, benchmarks,
scripts and the tests import it, and it imports none of them.

  runtime/xla_env.py  process set-up that runs before jax is imported: XLA_FLAGS, the jemalloc
                      re-execution, threefry unrolled on CPU
  runtime/mesh.py     the mesh axes, logical-axis rules and the active mesh (use_mesh) shared by
                      the model and its Pallas kernels (model.sharding re-exports them)
"""
