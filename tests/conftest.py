"""Shared test setup: a persistent JAX compilation cache under .cache/ (git-ignored), f32 matmuls,
XLA:CPU without LLVM optimisation passes (model/_xla_env.py: compile time dominates here).

Tests stay tiny (2 layers, d_model <= 128, T <= 64) so the whole suite fits in 15 minutes on
2 CPU cores.
"""

import pathlib

# jax 0.10.2's XLA:CPU "YNN" fusions segfault on some broadcast-multiply-sum gradients (seen in the
# KDA and DSA backward); disabling that fusion type avoids it (model/_xla_env.py, same for scripts).
from model._xla_env import configure_xla_env  # noqa: E402

configure_xla_env(fast_compile=True)
import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "jax"
CACHE.mkdir(parents=True, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def interpret() -> bool:
    """Pallas kernels run in interpret mode unless a GPU/TPU backend is present."""
    return jax.default_backend() == "cpu"


@pytest.fixture(scope="session")
def counting_model():
    """The 2-layer test model (indexer KL on) after 40 AdamW steps on counting sequences
    (token = 3 + (start + t) % 50), next-token + MTP loss: shared by the training test and the
    speculative-decoding tests (a trained MTP head drafts tokens worth accepting).
    Returns a namespace: model, variables, history (per-step metrics)."""
    import types

    import jax.numpy as jnp
    import optax

    from configs import models
    from model.config import ModelConfig
    from model.objectives import lm_loss
    from model.transformer import Model

    c = models.get_config("test")
    c.dsa.indexer_loss_weight = 0.1
    cfg = ModelConfig.from_dict(c)
    model = Model(cfg)
    variables = model.init(jax.random.key(0))
    starts = jax.random.randint(jax.random.key(5), (16, 1), 0, 50)
    tokens = (starts + jnp.arange(32)[None]) % 50 + 3
    mask = jnp.ones_like(tokens, bool)
    opt = optax.adamw(3e-3)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return lm_loss(model.apply({**variables, "params": p}, tokens), tokens, mask, cfg)
        (_, met), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        up, state = opt.update(g, state, params)
        return optax.apply_updates(params, up), state, met

    params, state, history = variables["params"], opt.init(variables["params"]), []
    for _ in range(40):
        params, state, met = step(params, state)
        history.append(met)
    return types.SimpleNamespace(model=model, variables={**variables, "params": params},
                                 history=history)
