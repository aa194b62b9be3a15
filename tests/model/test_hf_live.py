"""Live parity with transformers, run only where torch and transformers are installed (they are
not in the project's environment; tests/model/test_hf_kimi_linear.py and test_hf_deepseek_v32.py
check the same against the checked-in fixtures without them). For each family: a fresh tiny
random model from transformers' classes (scripts/hf_fixtures.py's configs, another seed than the
fixtures'), save_pretrained -> import_hf -> logits equal; export_hf -> from_pretrained with no
missing or unexpected weights -> the same logits."""

import importlib
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from model.hf import export_hf, import_hf, token_ids
from model.transformer import Model

# torch and transformers: imported by the tests (tests/conftest.py deselects them where
# transformers is not installed)
pytestmark = pytest.mark.hf_reference


@pytest.fixture(scope="module")
def fixtures_module():
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
    sys.path.insert(0, os.path.abspath(scripts))
    try:
        return importlib.import_module("hf_fixtures")
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v32"])
def test_live_round_trip(fixtures_module, family, tmp_path):
    import torch

    H = fixtures_module
    torch.manual_seed(7)
    ref_model = H._model_class(family)._from_config(
        H.FAMILIES[family](), attn_implementation="eager", dtype=torch.float32).eval()
    H.randomise(ref_model, 7)
    src = str(tmp_path / "src")
    ref_model.save_pretrained(src)
    ids = np.random.default_rng(7).integers(3, H.VOCAB, size=(2, 20)).astype(np.int32)
    want = H.full_logits(ref_model, ids)

    cfg, v = import_hf(src)
    got = np.asarray(Model(cfg).apply(v, jnp.asarray(ids)).logits)
    assert np.abs(got - want).max() <= 1e-4

    out = str(tmp_path / "out")
    export_hf(cfg, v, out, extra=token_ids(src))
    back, info = H._model_class(family).from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert np.abs(H.full_logits(back.eval(), ids) - want).max() <= 1e-4
