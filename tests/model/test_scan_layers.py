"""Scanned layer groups (`model.scan_layers`, model/config.py:layer_groups): repeated periods of
the layer pattern stored stacked on a leading "layers" axis and run as one lax.scan.

Covered: the span layout of the presets and its invariants over many layouts; the scanned
model against the per-layer model holding the same numbers (stack_layers): training forward
(logits, MTP logits, MoE counts and losses, indexer KL), gradients, prefill + decode, speculative
verify + commit, the indexer-recall diagnostics, one SFT step (optimizer and the aux-free router
bias of stacked layers); the layout conversions and their errors; shardings (the stacking axis
is unsplit, every other dim as in the per-layer layout); MXFP4 PTQ and a safetensors export
round trip of a stacked model; the checkpoint-mismatch hint; the 2.8T preset's shapes.
The scanned model is a 4-layer "KD" test model: one span of 2 copies of a 2-layer group (and,
in one test, an 8-layer one with a span of dense layers and a span of MoE layers).
Not covered here: compile time (benchmarks/train_step_compile.py, docs/speed.md).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import configs.models as presets
from model import interchange, quant
from model import sharding as shd
from model.config import ModelConfig
from model.transformer import (
    Model,
    layer_location,
    moe_layer_locations,
    stack_layers,
    unstack_layers,
)

CFG = ModelConfig.from_dict(presets.get_config("test")).replace(num_layers=4)
SCANNED = CFG.replace(scan_layers=True)


def _close(a, b, atol=2e-5, rtol=2e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def pair():
    flat_model, scan_model = Model(CFG), Model(SCANNED)
    v_flat = flat_model.init(jax.random.key(0))
    # a non-zero router bias, so that a misplaced layer's bias would show
    v_flat = {**v_flat, "router_state": jax.tree.map(
        lambda b: b + jnp.arange(b.shape[-1], dtype=b.dtype) * 0.01, v_flat["router_state"])}
    v_scan = stack_layers(SCANNED, v_flat)
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, 250)
    return flat_model, scan_model, v_flat, v_scan, tokens


def test_layer_groups_of_presets():
    small = ModelConfig.from_dict(presets.get_config("small")).replace(scan_layers=True)
    assert small.layer_groups() == ((0, 1, 1), (1, 4, 3), (13, 1, 1), (14, 1, 1), (15, 1, 1))
    ref = ModelConfig.from_dict(presets.get_config("reference_2p8t")).replace(scan_layers=True)
    assert ref.layer_groups() == ((0, 1, 1), (1, 4, 15), (61, 1, 1), (62, 1, 1), (63, 1, 1))
    assert SCANNED.layer_groups() == ((0, 2, 2),)
    assert CFG.layer_groups() == tuple((i, 1, 1) for i in range(4))
    assert layer_location(SCANNED, 3) == ("layers_0_3", "block_1", 1)
    assert layer_location(small, 0) == ("layer_0", None, None)
    assert layer_location(small, 6) == ("layers_1_12", "block_1", 1)


@pytest.mark.parametrize("pattern", ["K", "KD", "KKKD", "KDKK", "DKD"])
@pytest.mark.parametrize("first_dense", [0, 1, 3])
def test_layer_groups_cover_every_layer_with_identical_copies(pattern, first_dense):
    for n in range(max(1, first_dense), 19):
        cfg = CFG.replace(num_layers=n, layer_pattern=pattern, scan_layers=True,
                          moe=dataclasses.replace(CFG.moe, first_dense_layers=first_dense,
                                                  dense_dim=64))
        kinds = cfg.layer_kinds()
        sig = [(kinds[i], cfg.is_moe_layer(i)) for i in range(n)]
        covered = []
        for s, p, r in cfg.layer_groups():
            covered += range(s, s + p * r)
            if r > 1:
                assert p == len(pattern) and r >= 2
                for t in range(1, r):
                    assert sig[s + t * p:s + (t + 1) * p] == sig[s:s + p]
        assert covered == list(range(n))


def test_stacked_variables_are_the_scanned_init_layout(pair):
    _, scan_model, v_flat, v_scan, _ = pair
    fresh = scan_model.init(jax.random.key(0))
    assert jax.tree.structure(fresh) == jax.tree.structure(v_scan)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(v_scan)):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert v_scan["params"]["layers_0_3"]["block_1"]["attn"]["kv_a"]["kernel"].shape[0] == 2
    assert v_scan["router_state"]["layers_0_3"]["block_0"]["ffn"]["bias"].shape == (2, 4)
    back = unstack_layers(SCANNED, v_scan)
    assert jax.tree.structure(back) == jax.tree.structure(v_flat)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(v_flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # copies get their own init keys: the two copies of a block differ
    k = fresh["params"]["layers_0_3"]["block_0"]["attn"]["qkv"]["kernel"]
    assert not np.allclose(np.asarray(k[0]), np.asarray(k[1]))


def test_stack_layers_names_a_missing_layer(pair):
    _, _, v_flat, _, _ = pair
    params = dict(v_flat["params"])
    del params["layer_2"]
    with pytest.raises(ValueError, match="layer_2"):
        stack_layers(SCANNED, {"params": params})


def test_training_forward_and_gradients_match_per_layer_model(pair):
    flat_model, scan_model, v_flat, v_scan, tokens = pair
    o_flat, o_scan = flat_model.apply(v_flat, tokens), scan_model.apply(v_scan, tokens)
    for f in ("logits", "mtp_logits", "balance_loss", "indexer_kl", "expert_counts"):
        _close(getattr(o_scan, f), getattr(o_flat, f))
    _close(o_scan.router, o_flat.router)
    # per-layer expert counts differ between layers, so a wrong layer order would show
    assert not np.array_equal(np.asarray(o_flat.expert_counts[0]),
                              np.asarray(o_flat.expert_counts[2]))

    def loss(model, variables, params):
        out = model.apply({**variables, "params": params}, tokens)
        return jnp.mean(out.logits ** 2) + jnp.mean(out.mtp_logits ** 2) + out.indexer_kl

    g_flat = jax.grad(lambda p: loss(flat_model, v_flat, p))(v_flat["params"])
    g_scan = jax.grad(lambda p: loss(scan_model, v_scan, p))(v_scan["params"])
    _close(unstack_layers(SCANNED, {"params": g_scan})["params"], g_flat, atol=1e-6, rtol=1e-4)


def test_rematerialised_scan_has_the_same_gradients(pair):
    """remat="full" inside the scanned body (nn.remat under nn.scan): the same gradients."""
    _, scan_model, _, v_scan, tokens = pair
    remat_model = Model(SCANNED.replace(remat="full"))

    def grads(model):
        return jax.grad(lambda p: jnp.mean(model.apply({**v_scan, "params": p}, tokens).logits
                                           ** 2))(v_scan["params"])

    _close(grads(remat_model), grads(scan_model), atol=1e-7, rtol=1e-5)


def test_prefill_decode_and_verify_match_per_layer_model(pair):
    flat_model, scan_model, v_flat, v_scan, tokens = pair
    lengths = jnp.array([24, 15])
    outs = []
    for model, v in ((flat_model, v_flat), (scan_model, v_scan)):
        cache = model.init_cache(2, 40)
        logits, cache, _ = model.prefill(v, tokens, lengths, cache)
        steps = [logits]
        nxt = tokens[:, 0]
        for _ in range(3):
            lg, cache, _ = model.decode_step(v, nxt, cache)
            nxt = jnp.argmax(lg, -1).astype(jnp.int32)
            steps.append(lg)
        vl, step_cache, _ = model.verify(v, tokens[:, :4], cache)
        cache = model.commit(step_cache, jnp.array([2, 4]))
        lg, cache, _ = model.decode_step(v, nxt, cache)
        outs.append((steps, vl, lg, cache))
    _close(outs[1], outs[0])
    _close(scan_model.indexer_recall(v_scan, tokens), flat_model.indexer_recall(v_flat, tokens))


def test_sampler_matches_per_layer_model(pair):
    """The sampler runs a scanned model through its per-layer twin (rl/sampler.py:_per_layer):
    the same tokens and log-probs, plain and with prefix sharing + row refill."""
    from rl.sampler import Sampler, SamplingConfig

    flat_model, scan_model, v_flat, v_scan, tokens = pair
    prompts, lengths = jnp.repeat(tokens[:, :8], 2, axis=0), jnp.array([8, 8, 5, 5])
    for cfg, kw in ((SamplingConfig(max_new_tokens=6, temperature=0.0, eos_id=-1), {}),
                    (SamplingConfig(max_new_tokens=6, temperature=1.0, eos_id=7),
                     {"group_size": 2, "slots": 2})):
        a = Sampler(flat_model, cfg).generate(v_flat, prompts, lengths, jax.random.key(4), **kw)
        b = Sampler(scan_model, cfg).generate(v_scan, prompts, lengths, jax.random.key(4), **kw)
        np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
        _close(b.logprobs, a.logprobs)


def test_sft_step_matches_per_layer_model(pair):
    from ml_collections import ConfigDict

    from rl.train_step import init_train_state, make_optimizer, make_sft_step

    flat_model, scan_model, v_flat, v_scan, tokens = pair
    ocfg = ConfigDict(dict(lr=1e-2, warmup_steps=1, total_steps=10, final_lr_frac=0.1,
                           weight_decay=0.1, b1=0.9, b2=0.99, eps=1e-8, clip_norm=1.0))
    batch = {"tokens": tokens, "loss_mask": jnp.ones(tokens.shape, bool)}
    new = []
    for model, v in ((flat_model, v_flat), (scan_model, v_scan)):
        opt = make_optimizer(ocfg)
        state, met = make_sft_step(model, opt, donate=False)(init_train_state(v, opt), batch)
        assert int(state.step) == 1
        new.append((float(met["ce"]), state.variables))
    np.testing.assert_allclose(new[1][0], new[0][0], rtol=1e-5)
    # Adam normalises each gradient, so an entry whose gradient is ~0 in both models moves by a
    # visible fraction of lr on float noise (seen: 7e-5 at lr 1e-2 on one of 2,048 entries); a
    # misplaced layer would move whole tensors by ~lr
    _close(unstack_layers(SCANNED, new[1][1]), new[0][1], atol=5e-4, rtol=1e-3)
    # the aux-free bias step moved every MoE layer's bias, each by its own counts
    old_rs, new_rs = v_flat["router_state"], unstack_layers(SCANNED, new[1][1])["router_state"]
    for span, _, _ in moe_layer_locations(CFG):
        assert not np.allclose(np.asarray(new_rs[span]["ffn"]["bias"]),
                               np.asarray(old_rs[span]["ffn"]["bias"]))
    assert [loc[2] for loc in moe_layer_locations(SCANNED)] == [0, 0, 1, 1, None]


def test_shardings_add_an_unsplit_layers_axis():
    mesh = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    flat = flatten_dict(shd.logical_specs(Model(CFG).abstract_init(), mesh))
    scan = flatten_dict(shd.logical_specs(Model(SCANNED).abstract_init(), mesh))
    checked = 0
    for path, spec in flat.items():  # every per-layer leaf has its stacked place
        if not path[1].startswith("layer_"):
            assert scan[path] == spec
            continue
        span, block, _ = layer_location(SCANNED, int(path[1][6:]))
        got = tuple(scan[(path[0], span, block, *path[2:])])
        assert got == ((None, *tuple(spec)) if tuple(spec) else ()), (path, got, spec)
        checked += 1
    assert len(scan) == len(flat) - checked // 2  # two copies per stacked leaf
    assert checked > 40
    w = scan[("params", "layers_0_3", "block_0", "ffn", "w_up")]
    assert w[0] is None and w[1] == "expert"  # experts stay split over the expert axis


def test_mxfp4_ptq_and_export_of_a_stacked_model(pair, tmp_path):
    _, _, v_flat, v_scan, tokens = pair
    q_scan = quant.ptq_variables(v_scan)
    q_flat = quant.ptq_variables(v_flat)
    _close(unstack_layers(SCANNED, q_scan), q_flat, atol=0, rtol=0)
    assert quant.expert_bytes(q_scan["params"]) == quant.expert_bytes(q_flat["params"])
    interchange.export_safetensors(v_scan, SCANNED, str(tmp_path / "out"), experts="mxfp4")
    interchange.export_safetensors(v_flat, CFG, str(tmp_path / "flat"), experts="mxfp4")
    files = {d: interchange.read_with_numpy(str(tmp_path / d)) for d in ("out", "flat")}
    assert sorted(files["out"]) == sorted(files["flat"])  # per-layer tensors in both layouts
    assert "params.layer_3.ffn.w_up_blocks" in files["out"]
    for name, arr in files["flat"].items():
        np.testing.assert_array_equal(files["out"][name], arr)
    cfg, back = interchange.import_safetensors(str(tmp_path / "out"))
    assert cfg.scan_layers and cfg.layer_groups() == SCANNED.layer_groups()
    _close(back, q_scan, atol=0, rtol=0)
    # into a mesh's shardings (one device here): the stacked leaves come back stacked
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = shd.model_shardings(Model(quant.mxfp4_config(SCANNED)), mesh)
    _, placed = interchange.import_safetensors(str(tmp_path / "out"), shardings=sh)
    _close(placed, q_scan, atol=0, rtol=0)
    cfg_q = quant.mxfp4_config(SCANNED)
    _close(Model(cfg_q).apply(back, tokens).logits,
           Model(quant.mxfp4_config(CFG)).apply(q_flat, tokens).logits)


def test_checkpoint_mismatch_names_scan_layers(pair):
    from rl import checkpoint as ckpt

    _, _, v_flat, v_scan, _ = pair
    described = ckpt._describe(v_flat, digests=False)
    with pytest.raises(ckpt.CheckpointMismatchError, match="scan_layers=False"):
        ckpt._check_target(v_scan, described, "the checkpoint")


def test_reference_preset_shapes_with_scanned_layers():
    from model.plan import count_params

    ref = ModelConfig.from_dict(presets.get_config("reference_2p8t"))
    scanned = ref.replace(scan_layers=True)
    assert count_params(scanned) == count_params(ref)
    tree = flatten_dict(jax.tree.map(lambda x: x, Model(scanned).abstract_init()["params"]))
    lead = {p[0]: x.value.shape[0] for p, x in tree.items() if p[0] == "layers_1_60"}
    assert lead == {"layers_1_60": 15}


def test_dense_and_moe_spans_match_per_layer_model():
    """Two spans, one of dense layers (no router state) and one of MoE layers: 8 "KD" layers,
    the first 4 dense -> spans (0, 2, 2) and (4, 2, 2). Training forward and a decode step."""
    cfg = CFG.replace(num_layers=8, moe=dataclasses.replace(CFG.moe, first_dense_layers=4,
                                                            dense_dim=64))
    scanned = cfg.replace(scan_layers=True)
    assert scanned.layer_groups() == ((0, 2, 2), (4, 2, 2))
    flat_model, scan_model = Model(cfg), Model(scanned)
    v_flat = flat_model.init(jax.random.key(2))
    v_scan = stack_layers(scanned, v_flat)
    assert "layers_0_3" not in v_scan["router_state"] and "layers_4_7" in v_scan["router_state"]
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 3, 250)
    o_flat, o_scan = flat_model.apply(v_flat, tokens), scan_model.apply(v_scan, tokens)
    _close((o_scan.logits, o_scan.expert_counts), (o_flat.logits, o_flat.expert_counts))
    outs = []
    for model, v in ((flat_model, v_flat), (scan_model, v_scan)):
        _, cache, _ = model.prefill(v, tokens, jnp.array([16, 9]), model.init_cache(2, 24))
        outs.append(model.decode_step(v, tokens[:, 1], cache)[0])
    _close(outs[1], outs[0])
