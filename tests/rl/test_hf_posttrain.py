"""Post-training a released checkpoint (configs/rl.py:hf): a tiny Kimi-Linear checkpoint in
transformers' layout with its Kimi-format tokenizer and chat template
(tests/model/hf_fixtures/kimi_chat, written by tests/model/hf_tokenizer_fixtures.py) resolves
into the run's model section and tokenizer, RL starts from its weights (rl.init_from="hf"),
trains, and the trained weights export back to the same layout (scripts/export.py --mode=hf)
with the checkpoint's tokenizer files, importing to the same bytes and the same logits.
transformers loading that export with the engine's logits is the `hf_reference` test below
(deselected where transformers is not installed; scripts/hf_fixtures.py verify --expect runs
the same check by hand). About 60 s on 2 cores, most of it compiling the RL step."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train.launch
import train.models
import train.rl
import train.weights
from configs import rl as rl_configs
from model.hf import import_hf
from model.tokenizer import load_tokenizer
from train import run_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
CKPT = str(ROOT / "tests" / "model" / "hf_fixtures" / "kimi_chat")


def _config(workdir, **rl):
    c = rl_configs.get_config("hf")
    c.hf_dir = CKPT
    c.workdir = str(workdir)
    c.rl.update(dict(steps=2, checkpoint_every=2, **rl))
    c.eval.every = 100  # no evaluation between the two steps
    return c


def test_an_hf_run_needs_its_checkpoint_directory(tmp_path):
    c = rl_configs.get_config("hf")
    with pytest.raises(ValueError, match="--config.hf_dir=DIR"):
        train.launch.validate_run_config(c, ("rl",))
    c.hf_dir = str(tmp_path / "nothing")
    with pytest.raises(ValueError, match="is not a directory"):
        train.launch.validate_run_config(c, ("rl",))


def test_resolved_config_is_the_checkpoints():
    c = _config("unused")
    run_config.resolve_checkpoint(c)
    run_config.resolve_checkpoint(c)  # a second call changes nothing
    cfg = train.models.model_config(c)
    raw = json.loads((pathlib.Path(CKPT) / "config.json").read_text())
    assert (cfg.d_model, cfg.vocab_size, cfg.num_layers) == (
        raw["hidden_size"], raw["vocab_size"], raw["num_hidden_layers"])
    assert c.tokenizer == CKPT and load_tokenizer(c.tokenizer).vocab_size == 316
    assert "released checkpoint" in train.launch.check_rl_start(c)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two RL steps from the checkpoint's weights, then --mode=hf export of the RL checkpoint."""
    workdir = tmp_path_factory.mktemp("hf_run")
    c = run_config.RunConfig.from_config(_config(workdir))  # the checkpoint's model section
    train.rl.run_rl(c, progress=False)
    out = workdir / "export_hf"
    cmd = [sys.executable, str(ROOT / "scripts" / "export.py"), "--mode=hf",
           "--config=configs/rl.py:hf", f"--config.hf_dir={CKPT}", f"--config.workdir={workdir}",
           "--checkpoint=rl", f"--out={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    model = train.models.config_model(c)
    return c, model, train.weights.load_rl_variables(c, model), out


@pytest.mark.slow
def test_rl_from_the_checkpoint_trains_and_exports_to_the_same_bytes(trained):
    c, model, v, out = trained
    v0 = train.weights.checkpoint_variables(c, model)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree.leaves(v), jax.tree.leaves(v0)))
    assert moved > 0  # RL changed the imported weights
    cfg, back = import_hf(str(out))
    assert cfg == model.cfg
    for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert sorted(f for f in os.listdir(out) if not f.endswith(".safetensors")) == [
        "config.json", "tiktoken.model", "tokenizer_config.json"]
    src = json.loads((pathlib.Path(CKPT) / "config.json").read_text())
    got = json.loads((out / "config.json").read_text())
    assert {k: got[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


@pytest.mark.hf_reference
def test_transformers_loads_the_trained_export_with_the_engines_logits(trained, tmp_path):
    import torch
    import transformers

    c, model, v, out = trained
    ids = np.random.default_rng(0).integers(0, 316, size=(2, 24)).astype(np.int32)
    ours = np.asarray(model.apply(v, jnp.asarray(ids), with_mtp=False).logits)
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        theirs = ref(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) <= 1e-4
