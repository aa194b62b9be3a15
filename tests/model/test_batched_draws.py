"""model/batched_draws.py: random draws batched into a few threefry hashes give jax.random's
values bit for bit (jax.random's own functions, the model's init on presets with every layer
kind, scanned layers whose draws stay unbatched), and the batching really happens (the batched
program holds one hash per dependency level instead of one per draw)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.batched_draws import batch_random_draws
from model.transformer import Model

# each unrolled hash (runtime/xla_env.py) xors its two key words with this constant once
_PARITY = str(0x1BD11BDA)


def _hashes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(f"dense<{_PARITY}>")


def _draws(key):
    k1, k2 = jax.random.split(key)
    keys = jax.random.split(jax.random.fold_in(key, 3), 5)  # a key array
    scanned = jax.lax.scan(lambda c, k: (c, jax.random.normal(k, (4,))), 0, keys)[1]
    return {
        "bits": jax.random.bits(k1, (1001,)), "scalar": jax.random.bits(k2, ()),
        "normal": jax.random.normal(jax.random.fold_in(k1, 7), (7, 13)),
        "uniform": jax.random.uniform(jax.random.fold_in(key, 3), (2, 3, 5), minval=-1.0),
        "trunc": jax.random.truncated_normal(keys[2], -2.0, 2.0, (33,)),
        "gumbel": jax.random.gumbel(keys[4], (32, 65)),
        "split": jax.random.key_data(jax.random.split(k2, (2, 3))),
        "bits8": jax.random.bits(k2, (9,), jnp.uint8),          # not batched: 8-bit
        "vmapped": jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys),  # key array
        "scanned": scanned,                                       # inside a loop
    }


def _assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_jax_random_draws_batched_equal_jax():
    key = jax.random.key(11)
    plain, batched = jax.jit(_draws)(key), jax.jit(batch_random_draws(_draws))(key)
    _assert_equal(batched, plain)
    # 3 levels (the key's split and fold_in; the draws and splits of those keys; the draws from
    # the split keys) and the 3 hashes batching leaves alone (the loop's, the vmapped, 8-bit)
    n_plain, n_batched = _hashes(_draws, key), _hashes(batch_random_draws(_draws), key)
    assert (n_plain, n_batched) == (13, 6)


def test_draws_split_over_several_hash_calls_equal_jax(monkeypatch):
    """With MAX_BATCH below a level's counters the level's draws run as several hash calls
    (each part keyed by its own index within its call): still jax's bits."""
    import model.batched_draws as bd

    monkeypatch.setattr(bd, "MAX_BATCH", 600)
    key = jax.random.key(12)
    _assert_equal(jax.jit(batch_random_draws(_draws))(key), jax.jit(_draws)(key))
    assert _hashes(batch_random_draws(_draws), key) > 6


def test_empty_draws_and_side_effects_run_as_jax_runs_them(capfd):
    def f(key):
        a, b = jax.random.split(key)
        return jax.random.normal(a, (0, 3)), jax.random.uniform(b, (5,))

    def g(key):
        x = jax.random.normal(key, (4,))
        jax.debug.print("drawn {}", x.sum() * 0 + 4)
        return x, jax.random.bits(jax.random.fold_in(key, 1), (3,))

    key = jax.random.key(2)
    for fn in (f, g):
        _assert_equal(jax.jit(batch_random_draws(fn))(key), jax.jit(fn)(key))
    assert capfd.readouterr().out.count("drawn 4") == 2
    assert _hashes(batch_random_draws(g), key) == _hashes(g, key)  # not batched: the effect


@pytest.mark.parametrize("name,over", [
    ("test", {}),
    ("tiny", {"num_layers": 4, "scan_layers": True}),  # stacked layers: draws under a vmap
])
def test_model_init_batched_equals_unbatched(name, over):
    model = Model(models.build(name, **over))
    rng = jax.random.key(5)
    batched, plain = model.init(rng), model.init(rng, batch_draws=False)
    _assert_equal(batched, plain)
    init_fn = lambda r: model.net.init({"params": r}, jnp.zeros((1, 8), jnp.int32))
    n_plain, n_batched = _hashes(init_fn, rng), _hashes(batch_random_draws(init_fn), rng)
    assert n_batched * 4 <= n_plain, (n_plain, n_batched)
