"""Per-block rematerialisation (model.remat): gradients unchanged, the policy really changes what
JAX keeps for the backward pass, validation, and the planner using the configured policy.

Covered: model/transformer.py (block_class), model/plan.py (block_residual_bytes,
compiled_train_memory's program, per_device_plan's policy). Not covered here: that XLA's peak
memory falls. On XLA:CPU it does not with the default concurrency-optimised scheduler (see
model/plan.py:compiled_train_memory); the measured numbers are in docs/scaling.md.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ConfigError, ModelConfig
from model.plan import (
    MEMORY_FIELDS,
    block_residual_bytes,
    format_per_device,
    per_device_plan,
    train_grad_fn,
)
from model.transformer import Model

POLICIES = ("none", "full", "save_dots")


def _cfg(name="test", **over) -> ModelConfig:
    return models.build(name, **over)


@pytest.fixture(scope="module")
def compiled_grads():
    """Without remat and with "full": the training gradient of the test preset (B=2, T=16,
    indexer KL on so every aux term flows through the checkpointed blocks), compiled once; its
    gradients and XLA's memory analysis."""
    cfg = _cfg(dsa=dict(models.get_config("test").dsa.to_dict(), indexer_loss_weight=0.1))
    variables = Model(cfg).init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 3, 250)
    out = {}
    for p in ("none", "full"):  # save_dots shares the wrapper; one more compile is ~6 s cold
        compiled = jax.jit(train_grad_fn(cfg.replace(remat=p))).lower(variables, tokens).compile()
        ma = compiled.memory_analysis()
        out[p] = (compiled(variables, tokens), {f: getattr(ma, f) for f in MEMORY_FIELDS})
    return out


def test_remat_gradients_equal_without_remat(compiled_grads):
    ref, _ = compiled_grads["none"]
    got, mem = compiled_grads["full"]
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    assert mem["temp_size_in_bytes"] > 0 and mem["argument_size_in_bytes"] > 0
    assert any(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(ref))


@pytest.mark.parametrize("kind", ["K", "D"])
def test_policy_changes_what_is_saved_for_backward(kind):
    """Residuals JAX keeps from one block (traced, not compiled): "full" keeps only the block
    input (and the [B,T] masks), "save_dots" also the projection outputs, "none" everything."""
    cfg = _cfg()
    B, T = 1, 32
    saved = {p: block_residual_bytes(cfg, kind, True, p, B, T) for p in POLICIES}
    assert saved["full"] < saved["save_dots"] < saved["none"], saved
    block_input = B * T * cfg.d_model * 4
    assert block_input <= saved["full"] <= block_input + B * T * 8, saved


def test_remat_is_validated():
    with pytest.raises(ConfigError, match=r"model\.remat: unknown rematerialisation policy"):
        _cfg(remat="dots")
    assert _cfg("reference_2p8t").remat == "full"


def test_plan_uses_the_configured_policy():
    totals = {}
    for p in ("full", "none"):
        pd = per_device_plan(_cfg(remat=p), "fsdp=2,tensor=2", "h200", batch=4, seq=64)
        t = pd["train"]
        assert t["remat"] == p
        assert t["activations"] == t["activations_by_policy"][p]
        state = (t["params_bf16"] + t["grad_accumulator"] + t["master_f32"]
                 + t["adam_moments_f32"] + t["reference_policy"])
        # the transient peak: the backward's start (activations, ZeRO-3 gathers, EP buffers)
        # or its end (the gradients and one block's working set), whichever is larger
        start = t["activations"] + t["fsdp_gathered"] + t["ep_buffers"]
        assert t["state"] == state and t["total"] == state + t["step_peak"]
        assert t["backward_start"] == start and t["backward_end"] > t["grads"]
        assert t["step_peak"] == max(start, t["backward_end"])
        assert t["by_policy"][p]["total"] == t["total"]
        text = format_per_device(pd)
        assert f"activations (remat={p})" in text and f"[remat={p}]" in text
        totals[p] = t["total"]
    by = t["activations_by_policy"]
    assert by["full"] < by["save_dots"] < by["none"]
    assert totals["full"] < totals["none"]
