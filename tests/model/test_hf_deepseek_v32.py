"""DeepSeek-V3.2 checkpoints (model/hf/deepseek_v32.py): parity with transformers'
DeepseekV32ForCausalLM on the tiny random model scripts/hf_fixtures.py wrote
(tests/model/hf_fixtures/deepseek_v32: 3 layers, a dense first one, 8 experts in 2 groups with a
shared expert, an indexer keeping 8 of up to 40 keys, YaRN factor 4 over 16 positions), FP8 block-scaled weights, the export
round trip. The reference's numbers are in the fixture; no torch needed."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from model.hf import CheckpointError, export_hf, import_hf
from model.hf.safetensors_io import Checkpoint, write_file
from model.transformer import Model

FIXTURE = os.path.join(os.path.dirname(__file__), "hf_fixtures", "deepseek_v32")


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(os.path.join(FIXTURE, "reference.npz")))


@pytest.fixture(scope="module")
def imported():
    return import_hf(FIXTURE)


def test_config_translation(imported):
    cfg, _ = imported
    d = cfg.dsa
    assert cfg.layer_pattern == "D" and d.indexer and d.positions == "rope"
    assert (d.index_topk, d.index_rope_dim, d.latent_norm_eps, d.index_norm_eps) == (
        8, 8, 1e-6, 1e-6)
    assert cfg.moe.first_dense_layers == 1 and (cfg.moe.n_group, cfg.moe.topk_group) == (2, 1)
    assert (d.rope_scaling, d.rope_factor, d.rope_original_max_position) == ("yarn", 4.0, 16)


@pytest.mark.parametrize("scan", [False, True])
def test_fp32_logits_match_reference(ref, scan):
    cfg, v = import_hf(FIXTURE, scan_layers=scan)
    logits = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits)
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


def test_prefill_decode_greedy_matches_reference(imported, ref):
    """Past 8 tokens the indexer selects: decode through the cache picks the same keys."""
    cfg, v = imported
    model = Model(cfg)
    prompt, want = ref["prompt"], ref["greedy"]
    P, N = prompt.shape[1], want.shape[1]
    cache = model.init_cache(1, P + N)
    logits, cache, _ = jax.jit(model.prefill)(v, jnp.asarray(prompt), jnp.array([P]), cache)
    np.testing.assert_allclose(np.asarray(logits)[0], ref["greedy_logits"][0, :P], atol=1e-4)
    step = jax.jit(model.decode_step)
    tok, got, diffs = jnp.argmax(logits[:, P - 1], -1), [], []
    for t in range(N):
        got.append(int(tok[0]))
        lg, cache, _ = step(v, tok.astype(jnp.int32), cache)
        if t < N - 1:
            diffs.append(np.abs(np.asarray(lg)[0] - ref["greedy_logits"][0, P + t]).max())
        tok = jnp.argmax(lg, -1)
    assert got == want[0].tolist()
    assert max(diffs) <= 1e-4


def test_bf16_import_cosine_and_top1(ref):
    cfg, v = import_hf(FIXTURE, dtype="bfloat16")
    got = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits, np.float64)
    want = ref["logits"].astype(np.float64)
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.999
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_export_then_import_is_byte_identical(imported, tmp_path):
    cfg, v = imported
    export_hf(cfg, v, str(tmp_path / "out"))
    ours, theirs = Checkpoint(str(tmp_path / "out")), Checkpoint(FIXTURE)
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name in theirs.tensors:  # the rope rows are put back in interleaved order too
        assert ours.read(name).tobytes() == theirs.read(name).tobytes(), name
    cfg2, v2 = import_hf(str(tmp_path / "out"))
    assert cfg2 == cfg
    a, b = flatten_dict(v), flatten_dict(v2)
    assert a.keys() == b.keys()
    assert all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def _fp8_copy(tmp_path, names, block=(128, 128), drop_scale=False):
    """The fixture with `names` stored as F8_E4M3 + weight_scale_inv block scales; returns the
    directory and the dequantised values the import must produce."""
    d = tmp_path / "fp8"
    shutil.copytree(FIXTURE, d)
    src = Checkpoint(FIXTURE)
    tensors, expect = {}, {}
    rng = np.random.default_rng(0)
    for n in src.tensors:
        w = src.read(n)
        if n in names:
            o, i = w.shape
            s = rng.uniform(0.5, 2.0, (math.ceil(o / block[0]), math.ceil(i / block[1])))
            s = s.astype(np.float32)
            full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:o, :i]
            q = (w / full).astype(ml_dtypes.float8_e4m3fn)
            tensors[n] = q
            if not drop_scale:
                tensors[n + "_scale_inv"] = s
            expect[n] = q.astype(np.float32) * full
        else:
            tensors[n] = w
    write_file(str(d / "model.safetensors"),
               [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (d / "config.json").write_text(json.dumps(raw))
    return str(d), expect


def test_fp8_weights_are_dequantised_with_their_block_scales(tmp_path):
    """Small blocks (4 x 8) so that every weight holds several: each block's own scale."""
    q_a, wk = "model.layers.1.self_attn.q_a_proj.weight", "model.layers.2.self_attn.indexer.wk.weight"
    d, expect = _fp8_copy(tmp_path, {q_a, wk}, block=(4, 8))
    _, v = import_hf(d)
    np.testing.assert_array_equal(np.asarray(v["params"]["layer_1"]["attn"]["q_a"]["kernel"]),
                                  expect[q_a].T)
    np.testing.assert_array_equal(np.asarray(v["params"]["layer_2"]["attn"]["idx_k"]["kernel"]),
                                  expect[wk].T)


def test_fp8_without_scales_or_config_is_refused(tmp_path):
    q_a = "model.layers.1.self_attn.q_a_proj.weight"
    d, _ = _fp8_copy(tmp_path, {q_a}, drop_scale=True)
    with pytest.raises(CheckpointError, match=f"missing tensor '{q_a}_scale_inv'"):
        import_hf(d)
    raw = json.loads(open(os.path.join(d, "config.json")).read())
    del raw["quantization_config"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(CheckpointError, match=f"tensor '{q_a}': dtype float8_e4m3fn, but"):
        import_hf(d)


@pytest.mark.parametrize("edit,match", [
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 1024}},
     "mscale/mscale_all_dim"),
    ({"q_lora_rank": None}, "q_lora_rank=None"),
])
def test_unsupported_fields_are_named(tmp_path, edit, match):
    d = tmp_path / "c"
    shutil.copytree(FIXTURE, d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, **edit}))
    with pytest.raises(CheckpointError, match=match):
        import_hf(str(d))


def test_yarn_maps_onto_the_layers_yarn(tmp_path):
    d = tmp_path / "y"
    shutil.copytree(FIXTURE, d)
    raw = json.loads((d / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    raw["max_position_embeddings"] = 163840
    (d / "config.json").write_text(json.dumps(raw))
    cfg, _ = import_hf(str(d))
    a = cfg.dsa
    assert (a.rope_scaling, a.rope_factor, a.rope_original_max_position) == ("yarn", 40.0, 4096)


def test_mtp_layers_are_refused_or_dropped_on_request(tmp_path, ref):
    d = tmp_path / "m"
    shutil.copytree(FIXTURE, d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    src = Checkpoint(FIXTURE)
    tensors = {n: src.read(n) for n in src.tensors}
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    write_file(str(d / "model.safetensors"),
               [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=1: .*drop_mtp=True"):
        import_hf(str(d))
    cfg, v = import_hf(str(d), drop_mtp=True)
    logits = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits)
    assert np.abs(logits - ref["logits"]).max() <= 1e-4
    # a tensor of a layer that is neither trunk nor MTP is still unexpected
    tensors["model.layers.4.x.weight"] = np.zeros(2, np.float32)
    write_file(str(d / "model.safetensors"),
               [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.4.x.weight'"):
        import_hf(str(d), drop_mtp=True)
