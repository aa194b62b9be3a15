"""MXFP4 experts end to end: safetensors interchange (round trip, an independent numpy reader,
bad input), the MXFP4 inference model against the bf16 model on dequantised weights, expert
bytes, and QAT (forward = the PTQ export's forward, straight-through gradients).

Model: the 2-layer test preset (d_model 64, 4 experts of width 64, MTP block), f32.
Elsewhere: the MXFP4 sampler's log-probs against the dequantised (QAT) model's, and RL with
MXFP4 rollouts (tests/rl/test_mxfp4_rollouts.py); the reference model's shard plan
(scripts/export.py --mode=plan, docs/scaling.md).
"""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from configs import models
from model import interchange, quant
from model.config import ModelConfig
from model.transformer import Model, moe_layer_names

# E2M1 magnitudes by 3-bit code, written here independently of pallas_kernels/mxfp4
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float64)


def numpy_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [E, out, nb, 16], scales uint8 [E, out, nb] -> W [E, in, out] float64."""
    lo, hi = blocks & 0x0F, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # even element = low
    mag = _E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    w = mag * np.exp2(scales.astype(np.float64) - 127.0)[..., None]  # [E, out, nb, 32]
    w = w.reshape(*scales.shape[:-1], scales.shape[-1] * 32)  # [E, out, in]
    return np.swapaxes(w, -1, -2)


@pytest.fixture(scope="module")
def base():
    cfg = ModelConfig.from_dict(models.get_config("test"))
    model = Model(cfg)
    return cfg, model, model.init(jax.random.key(0))


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def exported(base, tmp_path_factory):
    cfg, _, variables = base
    out = str(tmp_path_factory.mktemp("export"))
    written = []
    summary = interchange.export_safetensors(
        variables, cfg, out, max_shard_bytes=60_000,
        on_shard=lambda i, p, n: written.append((p, n)))
    return out, summary, written


def test_export_layout_and_streaming(base, exported):
    cfg, _, variables = base
    out, summary, written = exported
    with open(os.path.join(out, interchange.INDEX_FILE)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == summary["files"] == len(written) > 3
    assert files == interchange.shard_file_names(len(files))
    sizes = {os.path.basename(p): n for p, n in written}
    biggest = summary["largest_tensor"][1]
    # one shard's tensors at a time: no file (= the writer's working set) above the cap,
    # unless it is one tensor larger than the cap
    assert all(n <= max(60_000, biggest) for n in sizes.values())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    # the dry-run plan from shapes alone (jax.eval_shape) is what the export wrote
    abstract = interchange._unbox(base[1].abstract_init())
    plan = interchange.plan_shards(interchange.export_specs(abstract), 60_000)
    assert [sum(t.nbytes for t in sh) for sh in plan] == [n for _, n in written]
    assert {t.name: f for sh, f in zip(plan, files) for t in sh} == index["weight_map"]
    # experts as MXFP4 pairs, no float expert tensor
    names = set(index["weight_map"])
    assert not any(n.rsplit(".", 1)[-1] in quant.EXPERT_KEYS for n in names)
    assert sum(n.endswith("_blocks") for n in names) == sum(n.endswith("_scales") for n in names)
    assert sum(n.endswith("_blocks") for n in names) == 3 * len(moe_layer_names(cfg))  # 3 each
    # config.json rebuilds the model config (experts now packed)
    cfg2 = interchange.load_config(out)
    assert cfg2 == quant.mxfp4_config(cfg)
    with open(os.path.join(out, interchange.CONFIG_FILE)) as f:
        meta = json.load(f)
    assert meta["quantization_config"]["quant_method"] == "mxfp4"
    assert "router" in meta["quantization_config"]["modules_to_not_convert"]


def test_round_trip_bit_identical(base, exported, tmp_path):
    cfg, _, variables = base
    out, summary, _ = exported
    cfg2, loaded = interchange.import_safetensors(out)
    ref = flatten_dict(quant.ptq_variables(variables))
    got = flatten_dict(loaded)
    assert set(ref) == set(got)
    for k in ref:
        a, b = np.asarray(ref[k]), np.asarray(got[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert a.tobytes() == b.tobytes(), k  # bit-identical, experts and everything else
    # re-exporting the import writes byte-identical files
    again = str(tmp_path / "again")
    interchange.export_safetensors(loaded, cfg2, again, max_shard_bytes=60_000)
    for f in interchange.shard_file_names(summary["files"]):
        assert _sha(os.path.join(out, f)) == _sha(os.path.join(again, f)), f
    # experts="float": dequantised to the param dtype = the fake-quantised (QAT) weights
    cfg3, fl = interchange.import_safetensors(out, experts="float")
    assert cfg3.moe.expert_format == "bf16"
    fq = flatten_dict(quant.fake_quant_experts(variables["params"]))
    for k, v in flatten_dict(fl["params"]).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(fq[k]), err_msg=str(k))


def test_export_bf16_experts_and_bf16_tensors(base, tmp_path):
    """experts="bf16" writes a packed model's experts dequantised [E, in, out]; dtype="bfloat16"
    casts every other float tensor; the import restores the f32 model from them."""
    cfg, _, variables = base
    q = quant.ptq_variables(variables)
    out = str(tmp_path / "bf16")
    interchange.export_safetensors(q, quant.mxfp4_config(cfg), out, max_shard_bytes=1 << 20,
                                   experts="bf16", dtype="bfloat16")
    cfg2, loaded = interchange.import_safetensors(out)
    assert cfg2.moe.expert_format == "bf16" and cfg2 == cfg
    files = interchange.read_with_numpy(out)
    assert all(str(a.dtype) == "bfloat16" for a in files.values() if a.dtype.kind != "u")
    want = flatten_dict(quant.fake_quant_experts(variables))
    for k, v in flatten_dict(loaded).items():
        ref = np.asarray(jnp.asarray(want[k]).astype(jnp.bfloat16).astype(v.dtype))
        np.testing.assert_array_equal(np.asarray(v), ref, err_msg=str(k))


def test_independent_reader_matches_project_decoder(base, exported):
    _, _, variables = base
    out, _, _ = exported
    tensors = interchange.read_with_numpy(out)  # safetensors' numpy loader, no JAX
    deq = flatten_dict(quant.dequantize_experts(quant.ptq_variables(variables)["params"],
                                                jnp.float32))
    n = 0
    for name, blocks in tensors.items():
        if not name.endswith("_blocks"):
            continue
        w = numpy_decode(blocks, tensors[name[:-7] + "_scales"])
        path = tuple(name.split(".")[1:-1]) + (name.split(".")[-1][:-7],)
        mine = np.asarray(deq[path], np.float64)
        assert w.shape == mine.shape
        np.testing.assert_array_equal(w, mine, err_msg=name)  # exactly equal
        assert np.count_nonzero(w) > 0.9 * w.size
        n += 1
    assert n == 3 * len(moe_layer_names(base[0]))


def test_import_rejects_mismatched_files(exported, tmp_path):
    out, _, _ = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(out):
        (bad / f).write_bytes(open(os.path.join(out, f), "rb").read())
    # a config.json from another model: the tensors no longer match it
    meta = json.loads((bad / interchange.CONFIG_FILE).read_text())
    meta["model"]["moe"]["num_experts"] = 8
    (bad / interchange.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shape"):
        interchange.import_safetensors(str(bad))
    meta["model"]["moe"]["num_experts"] = 4
    meta["model"]["num_layers"] = 3
    meta["model"]["layer_pattern"] = "KDK"
    (bad / interchange.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="missing tensor"):
        interchange.import_safetensors(str(bad))
    # exporting into a directory that holds another export's shards
    with pytest.raises(FileExistsError):
        interchange.export_safetensors({"params": {"x": jnp.zeros(3)}}, None, out,
                                       max_shard_bytes=1)


def test_high_precision_list_is_validated():
    assert quant.check_high_precision(quant.DEFAULT_HIGH_PRECISION) == ("experts",)
    assert quant.check_high_precision(quant.MODULE_GROUPS) == ()
    with pytest.raises(ValueError, match="no MXFP4 path"):
        quant.check_high_precision("router,embeddings,lm_head,norms,shared_experts,dense_ffn")
    with pytest.raises(ValueError, match="unknown module group"):
        quant.check_high_precision("router,attn")


# --------------------------------------------------------------------------- inference, QAT
def _tokens():
    return jax.random.randint(jax.random.key(3), (2, 16), 3, 200)


_FWD = {}


def _fwd(model):
    """One jitted trunk forward (no MTP) per model config: [B,T] tokens -> logits."""
    if model.cfg not in _FWD:
        _FWD[model.cfg] = jax.jit(lambda v, t: model.apply(v, t, with_mtp=False).logits)
    return _FWD[model.cfg]


def test_mxfp4_model_matches_dequantised_bf16_model(base):
    cfg, model, variables = base
    mx_model, q_vars = quant.inference_model(cfg, variables, experts="mxfp4")
    assert mx_model.cfg.moe.expert_format == "mxfp4"
    # only packed experts: no float copy of any expert kept
    assert not quant.has_float_experts(q_vars["params"])
    b = quant.expert_bytes(q_vars["params"])
    assert b["expert_ratio_vs_bf16"] == pytest.approx(4.25 / 16)
    assert b["other"] == quant.expert_bytes(variables["params"])["other"]
    tokens = _tokens()
    got = _fwd(mx_model)(q_vars, tokens)
    deq = dict(variables, params=quant.fake_quant_experts(variables["params"]))
    want = _fwd(model)(deq, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    # and the quantisation is visible: the unquantised model differs
    plain = _fwd(model)(variables, tokens)
    assert float(jnp.max(jnp.abs(plain - want))) > 1e-3


def test_qat_forward_is_dequantised_forward(base):
    import dataclasses

    cfg, model, variables = base
    qat = Model(cfg.replace(moe=dataclasses.replace(cfg.moe, qat=True)))
    tokens = _tokens()
    fq = dict(variables, params=quant.fake_quant_experts(variables["params"]))
    got, want = np.asarray(_fwd(qat)(variables, tokens)), np.asarray(_fwd(model)(fq, tokens))
    # equal up to f32 rounding: the two programs fuse the quantiser differently (bit-equal with
    # XLA:CPU's fusion emitters, 2e-6 apart with the elemental emitter the suite compiles with)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # the tolerance is far below what skipping the quantiser changes
    plain = np.asarray(_fwd(model)(variables, tokens))
    assert np.max(np.abs(plain - want)) > 1e-3


def test_qat_gradients_pass_straight_through():
    """MoE layer with qat=True: d loss(fake_quant(W)) / dW equals loss'(fake_quant(W)) (the
    straight-through estimator: identity through the quantiser, nothing quantised or zeroed)."""
    import dataclasses

    import flax.linen as nn

    from model.layers.moe import MoE

    cfg = ModelConfig.from_dict(models.get_config("test")).moe
    x = jax.random.normal(jax.random.key(0), (2, 8, 64))
    valid = jnp.ones((2, 8), bool)
    plain, qat = MoE(cfg, 64), MoE(dataclasses.replace(cfg, qat=True), 64)
    v = nn.meta.unbox(plain.init(jax.random.key(1), x, valid=valid))

    def loss(m):
        return lambda p: jnp.sum(jnp.sin(m.apply(dict(v, params=p), x, valid=valid)[0]))

    fq = quant.fake_quant_experts(v["params"])
    l_qat, g_qat = jax.jit(jax.value_and_grad(loss(qat)))(v["params"])
    l_fq, g_fq = jax.jit(jax.value_and_grad(loss(plain)))(fq)
    assert float(l_qat) == float(l_fq)
    g_qat, g_fq = flatten_dict(g_qat), flatten_dict(g_fq)
    for k in quant.EXPERT_KEYS:
        g = np.asarray(g_qat[(k,)])
        np.testing.assert_allclose(g, np.asarray(g_fq[(k,)]), rtol=1e-5, atol=1e-8)
        assert np.mean(g != 0) > 0.5, k  # gradients flow to (almost) every expert weight
        # not the quantised gradient: differentiating through a float4 cast would zero or
        # round it; the STE's gradient is not on the MXFP4 grid of its own blocks
        assert not np.array_equal(g, np.asarray(quant.fake_quant_experts({k: g_qat[(k,)]})[k]))
