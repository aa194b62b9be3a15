"""Kimi-Linear checkpoints (model/hf): parity with transformers' KimiLinearForCausalLM on the tiny
random model scripts/hf_fixtures.py wrote (tests/model/hf_fixtures/kimi_linear: its
save_pretrained output and reference.npz, the reference's logits and greedy continuation), the
export -> import round trip, and bad checkpoints. No torch needed: the reference's numbers are in
the fixture."""

import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from model.hf import CheckpointError, export_hf, import_hf
from model.hf.safetensors_io import Checkpoint, write_file
from model.transformer import Model

FIXTURE = os.path.join(os.path.dirname(__file__), "hf_fixtures", "kimi_linear")


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(os.path.join(FIXTURE, "reference.npz")))


@pytest.fixture(scope="module")
def imported():
    return import_hf(FIXTURE)


def test_config_translation(imported):
    cfg, _ = imported
    assert cfg.layer_pattern == "KD" and cfg.num_layers == 5
    assert cfg.moe.first_dense_layers == 1 and cfg.moe.n_group == 2 and cfg.moe.topk_group == 1
    assert cfg.moe.num_shared_experts == 1 and cfg.moe.router == "sigmoid"
    assert not cfg.dsa.indexer and cfg.dsa.positions == "nope" and cfg.dsa.q_lora_rank == 0


@pytest.mark.parametrize("scan", [False, True])
def test_fp32_logits_match_reference(ref, scan):
    cfg, v = import_hf(FIXTURE, scan_layers=scan)
    assert cfg.scan_layers == scan and (len(cfg.layer_groups()) < 5) == scan
    logits = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits)
    assert np.abs(logits - ref["logits"]).max() <= 1e-4


def test_prefill_decode_greedy_matches_reference(imported, ref):
    """Prefill the prompt, then 32 greedy decode steps through the cache: the same tokens as the
    reference's greedy continuation, each step's logits equal to the reference's full forward."""
    cfg, v = imported
    model = Model(cfg)
    prompt, want = ref["prompt"], ref["greedy"]  # [1,8], [1,32]
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
    assert cfg.param_dtype == "bfloat16"
    assert v["params"]["layer_0"]["attn"]["qkv"]["kernel"].dtype == jnp.bfloat16
    got = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits, np.float64)
    want = ref["logits"].astype(np.float64)
    cos = np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.999
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("scan", [False, True])
def test_export_then_import_is_byte_identical(imported, tmp_path, scan):
    cfg, v = import_hf(FIXTURE, scan_layers=scan) if scan else imported
    summary = export_hf(cfg, v, str(tmp_path / "out"))
    assert summary["files"] == 1
    # the same tensor names, shapes and bytes as transformers' own save_pretrained wrote
    ours, theirs = Checkpoint(str(tmp_path / "out")), Checkpoint(FIXTURE)
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name in theirs.tensors:
        assert ours.read(name).tobytes() == theirs.read(name).tobytes(), name
    cfg2, v2 = import_hf(str(tmp_path / "out"), scan_layers=scan)
    assert cfg2 == cfg
    a, b = flatten_dict(v), flatten_dict(v2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.asarray(a[k]).tobytes() == np.asarray(
            b[k]).tobytes(), k


def test_export_sharded_files_and_bf16(imported, tmp_path):
    cfg, v = imported
    s = export_hf(cfg, v, str(tmp_path / "o"), dtype="bfloat16", max_shard_bytes=100_000)
    assert s["files"] > 1 and os.path.exists(tmp_path / "o" / "model.safetensors.index.json")
    ck = Checkpoint(str(tmp_path / "o"))
    assert {str(t.dtype) for t in ck.tensors.values()} == {"bfloat16"}
    cfg2, v2 = import_hf(str(tmp_path / "o"))
    assert cfg2.num_layers == cfg.num_layers
    with pytest.raises(FileExistsError):
        export_hf(cfg, v, str(tmp_path / "o"))


def test_export_refuses_what_the_layout_cannot_hold(imported, tmp_path):
    cfg, v = imported
    bad = cfg.replace(kda=cfg.kda.__class__(**{**cfg.kda.__dict__, "gate_lower_bound": -5.0}))
    with pytest.raises(CheckpointError, match="kda.gate_lower_bound=-5.0"):
        export_hf(bad, v, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


# --------------------------------------------------------------------------- bad checkpoints
def _copy(tmp_path, tensors=None, config=None):
    """The fixture copied to tmp_path/ckpt with its tensors and config.json edited."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    if tensors is not None:
        src = Checkpoint(FIXTURE)
        arrays = tensors({n: src.read(n) for n in src.tensors})
        write_file(str(d / "model.safetensors"),
                   [(n, a.shape, a.dtype, lambda a=a: a) for n, a in arrays.items()])
    if config is not None:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config(raw)))
    return str(d)


def _without(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _edit(**kv):
    return lambda raw: {**raw, **kv}


KDA_Q = "model.layers.2.self_attn.q_proj.weight"


@pytest.mark.parametrize("case,match", [
    (dict(tensors=_without(KDA_Q)), f"missing tensor '{KDA_Q}'"),
    (dict(tensors=lambda t: {**t, "model.layers.9.mlp.extra.weight": np.zeros(2, np.float32)}),
     "unexpected tensor 'model.layers.9.mlp.extra.weight'"),
    (dict(tensors=lambda t: {**t, KDA_Q: t[KDA_Q][:, :32]}),
     rf"tensor '{KDA_Q}': shape \[32, 32\].*needs \[32, 64\]"),
    (dict(tensors=lambda t: {**t, KDA_Q: t[KDA_Q].astype(np.int32)}),
     f"tensor '{KDA_Q}': dtype int32"),
    (dict(config=_edit(model_type="llama")), "model_type='llama' is not supported"),
    (dict(config=_edit(tie_word_embeddings=True)), "tie_word_embeddings=True"),
    (dict(config=_edit(hidden_act="gelu")), "hidden_act='gelu'"),
    (dict(config=_edit(num_nextn_predict_layers=1)), "num_nextn_predict_layers=1"),
    (dict(config=_edit(sliding_window=128)), "sliding_window=128: unknown field"),
    (dict(config=_edit(mlp_layer_types=["sparse", "dense"] + ["sparse"] * 3)),
     "mlp_layer_types="),
    (dict(config=_edit(num_experts_per_token=3)), "moe.topk_group"),
])
def test_bad_checkpoint_names_what_is_wrong(tmp_path, case, match):
    d = _copy(tmp_path, **case)
    with pytest.raises(CheckpointError, match=match):
        import_hf(d)


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b[:4], "no 8-byte header length"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length .* does not fit"),
    (lambda b: b[:8] + b"#" + b[9:], "not JSON"),
    (lambda b: b[:-100], "data_offsets"),
])
def test_corrupt_safetensors_header(tmp_path, mutate, match):
    d = _copy(tmp_path)
    p = os.path.join(d, "model.safetensors")
    with open(p, "rb") as f:
        raw = f.read()
    with open(p, "wb") as f:
        f.write(mutate(raw))
    with pytest.raises(CheckpointError, match=f"model.safetensors: .*{match}"):
        import_hf(d)


# --------------------------------------------------------------------------- scripts/convert.py
def _convert(*argv):
    import importlib
    import sys

    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
    sys.path.insert(0, os.path.abspath(scripts))
    try:
        convert = importlib.import_module("convert")
    finally:
        sys.path.pop(0)
    return convert.main(list(argv))


def test_convert_dry_run_and_bad_input_write_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert _convert("--from_hf", FIXTURE, "--out", str(out), "--dry_run") == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 139 and not out.exists()
    bad = _copy(tmp_path, tensors=_without(KDA_Q))
    assert _convert("--from_hf", bad, "--out", str(out)) == 1
    assert f"missing tensor '{KDA_Q}'" in capsys.readouterr().err and not out.exists()
    assert _convert("--from_hf", bad, "--out", str(out), "--dry_run") == 1 and not out.exists()


def test_convert_both_ways(tmp_path, capsys, ref):
    own, hf = str(tmp_path / "own"), str(tmp_path / "hf")
    assert _convert("--from_hf", FIXTURE, "--out", own) == 0
    assert _convert("--to_hf", own, "--out", hf, "--like", FIXTURE) == 0
    raw = json.loads(open(os.path.join(hf, "config.json")).read())
    assert (raw["pad_token_id"], raw["bos_token_id"], raw["eos_token_id"]) == (0, 1, 2)
    # the project's export holds the experts as bf16 (model.interchange): logits move a little
    cfg, v = import_hf(hf)
    logits = np.asarray(Model(cfg).apply(v, jnp.asarray(ref["ids"])).logits)
    assert np.abs(logits - ref["logits"]).max() <= 5e-3


# --------------------------------------------------------------------------- the new options
@pytest.mark.parametrize("moe,match", [
    (dict(n_group=3), "moe.n_group"),
    (dict(n_group=2, topk_group=3), "moe.topk_group"),
    (dict(n_group=2, router="softmax"), "moe.n_group"),
])
def test_group_routing_config_is_validated(imported, moe, match):
    import dataclasses

    from model.config import ConfigError

    cfg, _ = imported
    with pytest.raises(ConfigError, match=match):
        cfg.replace(moe=dataclasses.replace(cfg.moe, **moe))


def test_mla_without_indexer_or_q_lora_is_validated(imported):
    import dataclasses

    from model.config import ConfigError

    cfg, _ = imported
    with pytest.raises(ConfigError, match="dsa.q_lora_rank"):  # the indexer reads the q latent
        cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer=True, index_n_heads=2,
                                            index_head_dim=8, index_topk=4))
    with pytest.raises(ConfigError, match="dsa.indexer_loss_weight"):
        cfg.replace(dsa=dataclasses.replace(cfg.dsa, indexer_loss_weight=0.1))


def test_group_limited_route_picks_within_the_best_groups():
    from model.layers.moe import route

    # groups {0,1} (top-2 sum 0.9+0.1) and {2,3} (0.6+0.5): experts 2 and 3, although 0 is best
    scores = jnp.array([[0.9, 0.1, 0.6, 0.5]])
    logits = jnp.log(scores / (1 - scores))
    _, idx, _ = route(logits, jnp.zeros(4), router="sigmoid", top_k=2, norm_topk_prob=True,
                      scaling=1.0, n_group=2, topk_group=1)
    assert sorted(idx[0].tolist()) == [2, 3]
    _, idx, _ = route(logits, jnp.zeros(4), router="sigmoid", top_k=2, norm_topk_prob=True,
                      scaling=1.0)
    assert sorted(idx[0].tolist()) == [0, 2]


_MESH_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from flax.traverse_util import flatten_dict
from model import sharding as shd
from model.hf import import_hf
from model.transformer import Model
fixture = sys.argv[1]
mesh = shd.make_mesh("fsdp=2,expert=2")
cfg, v = import_hf(fixture, scan_layers=True, mesh=mesh)
want = flatten_dict(shd.model_shardings(Model(cfg), mesh))
got = flatten_dict(v)
assert got.keys() == want.keys()
split = 0
for k in got:
    assert got[k].sharding.is_equivalent_to(want[k], got[k].ndim), k
    split += not got[k].sharding.is_fully_replicated
ref = np.load(fixture + "/reference.npz")
with shd.use_mesh(mesh):
    logits = jax.jit(Model(cfg).apply)(v, jnp.asarray(ref["ids"])).logits
print(json.dumps({"split": split, "leaves": len(got),
                  "diff": float(np.abs(np.asarray(logits) - ref["logits"]).max())}))
"""


def test_import_onto_a_mesh():
    """On 4 CPU devices (fsdp=2, expert=2), a scan_layers import: every variable lands on the
    model's own sharding and the logits still match the reference."""
    import subprocess
    import sys

    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count", "--_x")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _MESH_CHILD, FIXTURE], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["split"] > 10 and res["diff"] <= 1e-4, res
