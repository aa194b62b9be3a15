"""The non-finite guard of the RL and SFT train steps, when the loss is finite but the gradient
is not (tests/rl/test_engine.py covers a NaN loss).

Covered: (1) a KDA decay parameter A_log of 100: exp(A_log) overflows, the gate is -inf and the
forward is still finite (every decay is exp(-inf) = 0), while the backward multiplies zero
cotangents by inf (NaN); (2) an advantage of 1e37 on one row: the token-mean loss stays near
-1e36 but the gradient overflows. Either update must be skipped: params, optimizer state and
router state unchanged, state.step not advanced, state.skipped counted; the same compiled step
applies a sane batch. The 1-layer KDA model of tests/rl/conftest.py (`small_lm`) keeps
compilation short. Not covered: the critic's value-gradient guard (tests/rl/test_ppo.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from rl.algorithms import get_algorithm
from rl.sampler import pack
from rl.train_step import (
    init_train_state,
    make_logp_fn,
    make_optimizer,
    make_sft_step,
    make_train_step,
)

OPTIM = ConfigDict(dict(lr=1e-3, warmup_steps=1, total_steps=10, final_lr_frac=0.1,
                        weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0))


@pytest.fixture(scope="module")
def setup(small_lm):
    model, variables = small_lm
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 200, (2, 4)).astype(np.int32)
    comps = rng.integers(3, 200, (2, 4)).astype(np.int32)
    tokens, mask = pack(prompts, np.full(2, 4), comps, np.ones((2, 4), bool), width=8)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    logp = make_logp_fn(model)(variables, tokens, mask)
    batch = {"tokens": tokens, "loss_mask": mask, "advantages": jnp.array([[1.0], [-1.0]]),
             "old_logp": logp, "ref_logp": logp, "rollout_logp": logp}
    return model, variables, batch


def _overflowing_gate(variables):
    """A_log of the KDA layer set to 100 (exp(100) = inf in float32)."""
    out = jax.tree.map(lambda x: x, variables)  # new containers, same arrays
    attn = out["params"]["layer_0"]["attn"]
    attn["A_log"] = jnp.full_like(attn["A_log"], 100.0)
    return out


def _assert_skipped(new, old_state, met):
    assert int(new.skipped) == 1 and int(new.step) == 0, (int(new.skipped), int(new.step))
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state, new.router_state)),
                    jax.tree.leaves((old_state.params, old_state.opt_state,
                                     old_state.router_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.isfinite(float(met["grad_norm"]))


def test_rl_step_skips_finite_loss_with_nonfinite_gradient(setup):
    model, variables, batch = setup
    opt = make_optimizer(OPTIM)
    step = make_train_step(model, get_algorithm("grpo"), opt, donate=False)

    state = init_train_state(variables, opt)
    sane, met = step(state, batch)
    assert int(sane.step) == 1 and int(sane.skipped) == 0 and np.isfinite(float(met["loss"]))

    gate = init_train_state(_overflowing_gate(variables), opt)
    big = {**batch, "advantages": batch["advantages"].at[0, 0].set(1e37)}
    for state, b in ((gate, batch), (init_train_state(variables, opt), big)):
        new, met = step(state, b)
        assert np.isfinite(float(met["loss"])), "precondition: the loss itself is finite"
        _assert_skipped(new, state, met)


def test_sft_step_skips_finite_loss_with_nonfinite_gradient(setup):
    model, variables, batch = setup
    opt = make_optimizer(OPTIM)
    step = make_sft_step(model, opt, donate=False)
    sft_batch = {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}
    state = init_train_state(_overflowing_gate(variables), opt)
    new, met = step(state, sft_batch)
    assert np.isfinite(float(met.get("loss", met["ce"]))), "precondition: the loss is finite"
    _assert_skipped(new, state, met)
    sane, _ = step(init_train_state(variables, opt), sft_batch)
    assert int(sane.step) == 1 and int(sane.skipped) == 0
