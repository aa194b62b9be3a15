"""The QAT phase after SFT (sft.qat_steps, train/sft.py:run_sft) on the smoke config.

Covered: the phase runs after SFT with the experts fake-quantised (its first logged CE is the
QAT model's loss at SFT's final weights on its first batch, not the float model's), writes
sft/qat/, and its weights are the SFT weights that load_sft_variables (so RL's init_from="sft")
returns; a rerun restores both finished phases instead of training again; bad settings (a
negative or non-integer qat_steps, a model without routed or with packed experts, a workdir
whose QAT phase never ran) get errors naming the fix; the dry run reports the phase.
Not covered: QAT's effect on downstream accuracy (docs/scaling.md section 5 has the demo
numbers), the STE gradients themselves (tests/model/test_mxfp4_e2e.py).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train.data
import train.launch
import train.models
import train.sft
import train.weights
from model.config import ModelConfig
from model.tokenizer import load_tokenizer
from model.transformer import Model
from rl.train_step import make_sft_loss
from train.run_config import RunConfig


@pytest.fixture
def _config(cut_sft_config):
    """make(workdir, qat_steps=2): the cut SFT test config (conftest), 2 SFT steps."""
    return functools.partial(cut_sft_config, steps=2, checkpoint_every=2, qat_steps=2)


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_qat_phase_runs_after_sft_and_is_what_rl_starts_from(tmp_path, _config):
    config = _config(tmp_path)
    state = train.sft.run_sft(config, progress=False)
    sft = _metrics(tmp_path / "sft" / "metrics.jsonl")
    qat = _metrics(tmp_path / "sft" / "qat" / "metrics.jsonl")
    assert [m["step"] for m in sft] == [1, 2] and all("sft/ce" in m for m in sft)
    assert [m["step"] for m in qat] == [1, 2] and all("sft_qat/ce" in m for m in qat)
    assert train.weights.sft_checkpoint_dir(config) == str(tmp_path / "sft" / "qat" / "checkpoints")

    model = Model(ModelConfig.from_dict(config.model))
    final = train.weights.load_sft_variables(config, model)  # what RL's init_from="sft" restores
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(state.variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plain = config.copy_and_resolve_references()
    plain.sft.qat_steps = 0  # the same run read without the phase: SFT's own final weights
    before = train.weights.load_sft_variables(plain, model)
    moved = {jax.tree_util.keystr(p): not np.array_equal(np.asarray(a), np.asarray(b))
             for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(final["params"]),
                                  jax.tree.leaves(before["params"]))}
    assert any(v for k, v in moved.items() if "w_up" in k), "QAT did not train the experts"

    # the phase's forward is the fake-quantised one: its first logged CE (at SFT's final
    # weights, on the first batch of its stream) is the QAT model's loss, not the float one's
    tok = load_tokenizer(config.tokenizer)
    examples = train.data.sft_examples(config, train.data.load_task_splits(config)["train"])
    batch = {k: jnp.asarray(v) for k, v in
             next(train.sft.sft_stream(examples, tok, config.sft, config.seed + 2)).items()}
    ce = {name: float(jax.jit(make_sft_loss(m))(before["params"], before["router_state"],
                                                 batch)[1][0]["ce"])
          for name, m in (("qat", train.models.qat_model(model.cfg)), ("float", model))}
    assert qat[0]["sft_qat/ce"] == pytest.approx(ce["qat"], rel=1e-5, abs=1e-6)
    assert abs(ce["qat"] - ce["float"]) > 1e-4, ce

    # a rerun restores the finished phases: no step is trained or logged again
    again = train.sft.run_sft(config, progress=False)
    assert int(again.step) == 2
    assert len(_metrics(tmp_path / "sft" / "qat" / "metrics.jsonl")) == 2

    report = train.launch.validate_run_config(config, phases=("sft",))
    assert "SFT QAT phase: 2 steps" in report and "sft/qat/checkpoints" in report


def test_qat_phase_rejects_bad_settings(tmp_path, _config):
    for bad in (-1, 2.5, True, "2"):
        c = _config(tmp_path, qat_steps=0)
        del c.sft.qat_steps  # the field is typed int; a hand-written config may hold anything
        c.sft.qat_steps = bad
        with pytest.raises(ValueError, match="sft.qat_steps must be an int >= 0"):
            RunConfig.from_config(c)
    c = _config(tmp_path)
    c.sft.qat_lr = 0.0
    with pytest.raises(ValueError, match="needs sft.qat_lr > 0"):
        train.launch.validate_run_config(c, phases=("sft",))
    cfg = ModelConfig.from_dict(_config(tmp_path).model)
    with pytest.raises(ValueError, match="no routed experts"):
        train.models.qat_model(cfg.replace(moe=dataclasses.replace(cfg.moe, num_experts=0)))
    with pytest.raises(ValueError, match="float experts"):
        train.models.qat_model(cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="mxfp4")))
    # a run whose QAT phase never ran: RL must not silently start from the pre-QAT weights
    with pytest.raises(FileNotFoundError, match=r"sft/qat/checkpoints.*QAT phase"):
        train.weights.load_sft_variables(_config(tmp_path / "empty"), Model(cfg))
