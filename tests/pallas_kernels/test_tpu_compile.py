"""The pieces of the TPU ahead-of-time compile that run without libtpu (about 10 s in all).

The compiles themselves need libtpu (the [tpu] extra), which the CI suite does not install:
they are tests/pallas_kernels/tpu_compile_check.py, run by hand in an environment with it
(docs/tpu_compile.md). Here, on the CPU:
  * the bf16 fix of the TPU sparse-attention kernel: its pallas_call gathers from an f32 kv
    (the TPU compiler rejects one-row DMAs into a bf16 VMEM tile) and returns q's dtype, with
    the reference's numbers;
  * `pallas_kernels.partition.per_device` on a 4-device CPU mesh (a child process): the call
    sits under shard_map, split by the model's rules, and equals the unsplit call; no mesh or a
    manual region: the call as is;
  * `backend.target_platform`: impl="auto" dispatch follows the target, and only inside;
  * `tpu_compile.mosaic_vmem` reading compiled HLO, the topology names, the missing-libtpu
    message.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend, tpu_compile
from pallas_kernels.dsa import arg_specs, ops, reference
from pallas_kernels.kda import ops as kda_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pallas_input_dtypes(fn, *args) -> list[list[str]]:
    """The input dtypes of every pallas_call in fn's jaxpr (nested jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append([str(v.aval.dtype) for v in eqn.invars])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_tpu_sparse_attention_gathers_bf16_kv_as_f32():
    spec = arg_specs.TEST_SPECS[0].with_dtype("bfloat16")
    a = arg_specs.make_args(spec)
    scores = reference.indexer_scores(a["q_idx"], a["k_idx"], a["w"])
    idx = ops.select_topk(scores, spec.topk)

    def run(q, kv):
        return ops.sparse_attention_with_lse(q, kv, idx, scale=spec.scale, v_dim=spec.v_dim,
                                             impl="pallas", kernel="tpu", interpret=True)

    calls = _pallas_input_dtypes(run, a["q"], a["kv"])
    assert calls and all("bfloat16" not in c for c in calls), calls
    o, lse = run(a["q"], a["kv"])
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    want, want_lse = reference.sparse_attention_fwd_with_lse(
        a["q"].astype(jnp.float32), a["kv"].astype(jnp.float32), idx, scale=spec.scale,
        v_dim=spec.v_dim)
    err = np.linalg.norm(np.float32(o) - want) / np.linalg.norm(want)
    assert err < 1e-2, err
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
    # the gradient comes back in the inputs' dtype
    dq, dkv = jax.grad(lambda q, kv: run(q, kv)[0].astype(jnp.float32).sum(), (0, 1))(
        a["q"], a["kv"])
    assert dq.dtype == dkv.dtype == jnp.bfloat16
    # the GPU flavour keeps bf16 (Triton gathers rows with vector loads)
    gpu = _pallas_input_dtypes(lambda q, kv: ops.sparse_attention_with_lse(
        q, kv, idx, scale=spec.scale, v_dim=spec.v_dim, impl="pallas", kernel="gpu",
        interpret=True), a["q"], a["kv"])
    assert any("bfloat16" in c for c in gpu), gpu


_CHILD = r"""
import jax, jax.numpy as jnp, numpy as np
from model import sharding as shd
from pallas_kernels import partition

mesh = shd.make_mesh({"data": 2, "tensor": 2})
x = jnp.arange(4 * 3 * 2 * 5, dtype=jnp.float32).reshape(4, 3, 2, 5)  # [B,T,H,K]
h = jnp.ones((4, 2, 5, 5), jnp.float32)  # [B,H,K,V]

def fn(x, h0, y):
    assert y is None
    assert x.shape[0] * 2 == 4 or x.shape[0] == 4
    return x * 2 + x.sum(-1, keepdims=True), h0 * x[:, 0, :, :, None].sum()

names = (("batch", "length", "act_heads", None), ("batch", "act_heads", None, None), None)
outs = (("batch", "length", "act_heads", None), ("batch", "act_heads", None, None))
want = fn(x, h, None)
assert partition.active_mesh() is None
with shd.use_mesh(mesh):
    assert partition.active_mesh() is not None
    got = jax.jit(lambda x, h: partition.per_device(fn, (x, h, None), names, outs))(x, h)
    text = jax.jit(lambda x, h: partition.per_device(fn, (x, h, None), names, outs)).lower(
        x, h).as_text()
np.testing.assert_allclose(got[0], want[0])
# the second output sums over one device's share (2 rows over "data", 1 head over "tensor"):
# different from the unsplit sum, as a per-device call must be
per_dev = np.zeros(want[1].shape, np.float32)
for i in (0, 2):
    for j in (0, 1):
        per_dev[i:i + 2, j:j + 1] = fn(x[i:i + 2, :, j:j + 1], h[i:i + 2, j:j + 1], None)[1]
np.testing.assert_allclose(got[1], per_dev)
assert not np.allclose(got[1], want[1])
assert "shard_map" in text or "manual" in text, text[:2000]
print("OK per_device")
"""


def test_per_device_runs_under_shard_map_on_a_mesh():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "OK per_device" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_target_platform_steers_auto_dispatch_only_inside():
    facts = dict(K=64, V=64, dtype="float32")
    assert kda_ops.DISPATCH.choose("auto", **facts)[0] == "chunked_vjp"  # this CPU host
    with backend.target_platform("tpu"):
        assert backend.platform() == "tpu"
        assert kda_ops.DISPATCH.choose("auto", **facts)[0] == "pallas"
        assert backend.resolve(None, None) == ("tpu", False)  # compiled, not interpreted
        # what the kernels cannot take still falls back on the target
        assert kda_ops.DISPATCH.choose("auto", K=48, V=48, dtype="float32")[0] == "chunked_vjp"
    assert backend.platform() == jax.default_backend()
    with pytest.raises(ValueError, match="target platform must be one of"):
        with backend.target_platform("tpu7"):
            pass


_HLO = (
    '  %a = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_config='
    '{"flag_configs":[],"scoped_memory_configs":[],"custom_call_config":{"body":"AAA"},'
    '"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"1216512"}]}\n'
    '  %b = f32[8] custom-call(%a), custom_call_target="tpu_custom_call", backend_config='
    '{"flag_configs":[],"scoped_memory_configs":[{"memory_space":"1","offset":"0",'
    '"size":"50331648"}],"used_scoped_memory_configs":[{"memory_space":"1","offset":"0",'
    '"size":"4194304"},{"memory_space":"0","offset":"0","size":"999999999"}]}\n'
    '  %c = f32[8] custom-call(%b), custom_call_target="Sharding", backend_config='
    '{"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"888888888"}]}\n'
)


def test_mosaic_vmem_reads_the_kernels_scoped_memory():
    got = tpu_compile.mosaic_vmem(_HLO)
    # two Mosaic calls; the largest VMEM use and grant among them; memory space 0 and the
    # non-Mosaic custom call ignored
    assert got == {"mosaic_calls": 2, "vmem_used_bytes": 4194304, "vmem_limit_bytes": 50331648}
    assert tpu_compile.mosaic_vmem("no kernels here") == {
        "mosaic_calls": 0, "vmem_used_bytes": 0, "vmem_limit_bytes": 0}


def test_topology_names_and_the_missing_libtpu_message(monkeypatch):
    assert tpu_compile.topology_name("tpu:v5p") == "v5p:2x2x1"
    assert tpu_compile.topology_name("tpu:v5e") == "v5e:2x2"
    assert tpu_compile.topology_name("v5p-512") == "v5p:4x8x8"  # 512 cores = 256 chips
    assert tpu_compile.topology_name("v5p:8x8x8") == "v5p:8x8x8"
    with pytest.raises(ValueError, match="unknown TPU target 'tpu:v9'"):
        tpu_compile.topology_name("tpu:v9")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match=r"libtpu is not installed.*\[tpu\] extra"):
        tpu_compile.require_libtpu()


def test_preset_slices_follow_the_model_presets():
    """The per-device shapes come from the presets' configs: heads and expert widths over the
    tensor axis, experts over the expert axis (no libtpu needed to build the cases)."""
    ref = {c.kernel: c for c in tpu_compile.cases("reference_2p8t")}
    q = ref["kda"].args[0]
    assert q.shape == (1, 4096, 16, 128) and q.dtype == jnp.bfloat16  # 64 heads / tensor 4
    q, kv, idx = ref["dsa_attention"].args
    assert q.shape == (1, 4096, 16, 576) and kv.shape == (1, 4096, 576)  # kv_lora 512 + rope 64
    assert idx.shape == (1, 4096, 2048)
    grouped = [c for c in tpu_compile.cases("reference_2p8t", ["mxfp4_grouped"])]
    x, w, gs = grouped[0].args
    assert w.blocks.shape == (125, 512, 7168 // 32, 16) and gs.shape == (125,)  # 1000 / 8
    assert x.shape == (4096 * 8, 7168)
    with pytest.raises(ValueError, match="preset must be one of"):
        tpu_compile.cases("huge")


def test_preset_shapes_are_the_model_presets():
    """tpu_compile's literal shape table (it imports nothing from model/ or configs/) is what
    model.aot.kernel_shapes reads from each preset's ModelConfig; passed-in shapes replace it."""
    import dataclasses

    from configs import models
    from model import aot
    from model.config import ModelConfig

    for preset, shapes in tpu_compile.PRESET_SHAPES.items():
        assert aot.kernel_shapes(ModelConfig.from_dict(models.get_config(preset))) == shapes, \
            preset
    wide = dataclasses.replace(tpu_compile.PRESET_SHAPES["tiny"], kda_heads=4)
    (kda,) = tpu_compile.cases("tiny", ["kda"], shapes=wide)
    assert kda.args[0].shape[2] == 4


def test_pod_compile_overrides_fit_and_report():
    """The AOT pieces that need no compile: overrides copy the config (an unknown path raises),
    the HBM fit, the report of a failed program (its compiler message), slice topologies."""
    from configs import rl as rl_configs
    from model import aot
    from train import aot as train_aot

    c = rl_configs.get_config("smoke_8dev")
    c2 = train_aot.apply_overrides(c, {"model.moe.qat": True, "optim.master_dtype": ""})
    assert c2.model.moe.qat is True and c2.optim.master_dtype == ""
    assert c.model.moe.qat is False and c.optim.master_dtype == "float32"  # original untouched
    with pytest.raises(KeyError, match="model.moe.qatt"):
        train_aot.apply_overrides(c, {"model.moe.qatt": True})
    gib = 2**30
    assert aot.fits(80 * gib, 95 * gib) is True and aot.fits(90 * gib, 95 * gib) is False
    assert aot.fits(1, None) is None
    text = train_aot.format_memory({
        "topology": "v5p:2x2x2", "devices": 8, "device_kind": "TPU v5", "mesh": {"data": 8},
        "hbm_bytes": 95 * gib,
        "train_step": {"ok": False, "error": "NotImplementedError: Mosaic kernels cannot be "
                       "automatically partitioned", "seconds": 1.0},
        "rollout": {"ok": True, "argument_bytes": gib, "temp_bytes": 2 * gib,
                    "total_bytes": 3 * gib, "seconds": 2.0, "mosaic_calls": 6}})
    assert "train_step   FAILED" in text and "automatically partitioned" in text
    assert "total     3.00 GiB  fits: True" in text and "ref_forward" not in text
    assert [aot.slice_topology("tpu-v5p", n) for n in (4, 8, 32, 512, 2048)] == [
        "v5p:2x2x1", "v5p:2x2x2", "v5p:2x4x4", "v5p:8x8x8", "v5p:8x16x16"]
    assert aot.slice_topology("tpu-v6e", 256) == "v6e:16x16"
    assert aot.slice_topology("h200", 8) is None and aot.slice_topology("tpu-v5p", 6) is None
