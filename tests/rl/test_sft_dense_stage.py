"""SFT's DSA dense stage (sft.dense_steps, train/sft.py:run_sft / sft_dense_steps) on the smoke
config.

Covered: the first dense_steps steps train the dense-attention model (their logged CE is that
model's loss on their batch, not the sparse model's) and the later steps the sparse one, over one
train state and one schedule (the step after the stage continues from the stage's last weights);
a rerun of the finished phase trains nothing again; bad settings (out of [0, sft.steps], not an
int, a model without a sparse DSA layer) get errors naming the fix; the dry run reports the stage.
Not covered: what the stage does to the demo's skills (README, "Agents": measured there).
"""

import json

import jax
import jax.numpy as jnp
import pytest

import train.data
import train.launch
import train.models
import train.sft
import train.state
from configs import rl as rl_configs
from model.config import ModelConfig
from model.tokenizer import load_tokenizer
from model.transformer import Model
from rl.checkpoint import Checkpointer
from rl.train_step import init_train_state, make_optimizer, make_sft_loss
from train.run_config import RunConfig


@pytest.fixture
def _config(cut_sft_config):
    """make(workdir, dense_steps=2): the cut SFT test config (conftest) with top-k 8 of rows up
    to 128 tokens wide (the sparse and dense paths differ), 3 SFT steps."""
    def make(workdir, dense_steps=2):
        c = cut_sft_config(workdir, steps=3, checkpoint_every=1, dense_steps=dense_steps)
        c.model.dsa.index_topk = 8
        return c
    return make


def _ce(model, variables, batch) -> float:
    loss = jax.jit(make_sft_loss(model))
    return float(loss(variables["params"], variables["router_state"], batch)[1][0]["ce"])


@pytest.mark.slow
def test_dense_stage_trains_the_dense_model_first_then_the_sparse_one(tmp_path, _config):
    config = _config(tmp_path)
    train.sft.run_sft(config, progress=False)
    logged = [json.loads(line)["sft/ce"]
              for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 3

    model = Model(ModelConfig.from_dict(config.model))
    dense = train.models.warmup_model(model.cfg)
    tok = load_tokenizer(config.tokenizer)
    examples = train.data.sft_train_examples(config)
    stream = train.sft.sft_stream(examples, tok, config.sft, config.seed)
    batches = [{k: jnp.asarray(v) for k, v in next(stream).items()} for _ in range(3)]

    # step 1: the logged CE is the dense model's at the initial weights, not the sparse one's
    init = model.init(jax.random.key(config.seed))
    ce0 = {"dense": _ce(dense, init, batches[0]), "sparse": _ce(model, init, batches[0])}
    assert abs(ce0["dense"] - ce0["sparse"]) > 1e-4, ce0
    assert logged[0] == pytest.approx(ce0["dense"], rel=1e-5, abs=1e-6)

    # step 3 (after the 2-step stage): the sparse model's CE at the weights of step 2
    opt = make_optimizer(train.state.optim_config(config.sft.lr, config.sft.warmup_steps, config.sft.steps,
                                     config.sft.weight_decay, train.state.optim_numerics(config)))
    ckpt = Checkpointer(str(tmp_path / "sft" / "checkpoints"), keep=2)
    at2 = ckpt.restore(2, jax.eval_shape(lambda: init_train_state(init, opt))).state.variables
    ckpt.close()
    ce2 = {"dense": _ce(dense, at2, batches[2]), "sparse": _ce(model, at2, batches[2])}
    assert abs(ce2["dense"] - ce2["sparse"]) > 1e-4, ce2
    assert logged[2] == pytest.approx(ce2["sparse"], rel=1e-5, abs=1e-6)

    again = train.sft.run_sft(config, progress=False)  # finished: restored, nothing trained
    assert int(again.step) == 3
    assert len((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()) == 3
    report = train.launch.validate_run_config(config, phases=("sft",))
    assert "SFT dense stage: the first 2 of 3 steps attend densely" in report


def test_dense_stage_rejects_bad_settings(tmp_path, _config):
    cfg = ModelConfig.from_dict(_config(tmp_path).model)
    for bad in (-1, 4, 1.5, True, "2"):
        c = _config(tmp_path, dense_steps=0)
        del c.sft.dense_steps  # the field is typed int; a hand-written config may hold anything
        c.sft.dense_steps = bad
        with pytest.raises(ValueError, match=r"sft.dense_steps must be an int in \[0, sft.steps="):
            RunConfig.from_config(c)
    c = _config(tmp_path)
    c.model.layer_pattern = "K"  # no DSA layer: nothing would differ
    with pytest.raises(ValueError, match="needs a model with a DSA layer.*sft.dense_steps=0"):
        train.launch.validate_run_config(c, phases=("sft",))
    c = _config(tmp_path)
    c.model.dsa.indexer_stage = "dense_warmup"  # dense throughout already
    with pytest.raises(ValueError, match="dense_warmup"):
        train.launch.validate_run_config(c, phases=("sft",))
    assert train.sft.sft_dense_steps(RunConfig.from_config(_config(tmp_path, dense_steps=0)), cfg) == 0


def test_demo_sft_is_dense_throughout_and_follows_its_step_count():
    for name, steps in (("demo", 1200), ("agent", 1200)):
        c = rl_configs.get_config(name)
        assert (c.sft.steps, c.sft.dense_steps, c.sft.indexer_warmup_steps) == (steps, steps, 0)
    c = rl_configs.get_config("demo")
    c.sft.steps = 300  # --config.sft.steps=300: the stage follows
    assert c.sft.dense_steps == 300
    c.sft.dense_steps = 100  # setting the stage breaks only its own link
    assert (c.sft.steps, train.sft.sft_dense_steps(c, train.models.model_config(c))) == (300, 100)
