"""Opt-in: the TPU ahead-of-time compiles themselves, on a CPU host with libtpu installed.

Not part of the CI suite (pytest collects test_*.py only; CI installs no libtpu, see
docs/tpu_compile.md for why). Run it in an environment with the [tpu] extra:

    JAX_PLATFORMS=cpu python -m pytest -q -n 0 tests/pallas_kernels/tpu_compile_check.py

Without libtpu every test fails with the message saying how to install it. Checks:
  * every Pallas TPU kernel at the tiny preset's per-device shapes compiles for v5p (forward and
    backward, under shard_map over 4 chips), each program holding Mosaic kernels that use VMEM;
  * the bf16 sparse attention at the small preset's D=288 compiles (the TPU compiler rejected
    it before the kernel gathered from an f32 kv);
  * the RL pod programs (train step, rollout, reference forward) of the smoke_8dev config on
    the test model compile for v5p:2x2x2 with their Pallas kernels (each under shard_map:
    XLA cannot partition a Mosaic call) and report per-device memory.
"""

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_kernels import tpu_compile


@pytest.fixture(scope="module")
def mesh():
    tpu_compile.require_libtpu()
    return tpu_compile.tpu_mesh("tpu:v5p")


def test_tiny_preset_kernels_compile_for_v5p(mesh):
    rows = [tpu_compile.compile_case(c, mesh, mode) for c in tpu_compile.cases("tiny")
            for mode in tpu_compile.MODES]
    bad = [(r["kernel"], r["name"], r["mode"], r["error"]) for r in rows if not r["ok"]]
    assert not bad, bad
    assert {r["kernel"] for r in rows} == set(tpu_compile.KERNEL_NAMES)
    for r in rows:
        assert r["mosaic_calls"] >= 1 and r["vmem_used_bytes"] > 0, r
        assert r["device_kind"].startswith("TPU v5") and r["devices"] == 4


def test_bf16_sparse_attention_compiles(mesh):
    case = next(c for c in tpu_compile.cases("small", ["dsa_attention"]))
    q, kv, idx = case.args
    assert q.dtype == jnp.bfloat16 and q.shape[-1] == 288
    short = dataclasses.replace(case, args=(q.update(shape=(1, 256, *q.shape[2:])),
                                            kv.update(shape=(1, 256, kv.shape[2])),
                                            idx.update(shape=(1, 256, 64))))
    for mode in tpu_compile.MODES:
        r = tpu_compile.compile_case(short, mesh, mode)
        assert r["ok"], r["error"]


def test_pod_programs_compile_for_v5p():
    from configs import models
    from configs import rl as rl_configs
    from model import aot
    from train import aot as train_aot

    tpu_compile.require_libtpu()
    c = rl_configs.get_config("smoke_8dev")
    c.model = models.get_config("test")
    c.model.moe.expert_parallel = "all_to_all"
    c.rl.update(dict(prompts_per_batch=4, group_size=2, max_prompt_len=16, max_new_tokens=8))
    res = train_aot.compiled_memory(c, "v5p:2x2x2")
    assert res["devices"] == 8 and res["mesh"] == {"data": 2, "fsdp": 2, "expert": 2,
                                                   "tensor": 1}
    for p in train_aot.PROGRAMS:
        row = res[p]
        assert row["ok"], (p, row["error"])
        assert row["mosaic_calls"] >= 1 and row["total_bytes"] > 0, (p, row)
        assert aot.fits(row["total_bytes"], res["hbm_bytes"])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_mxfp4_dequantize_temporaries_stay_near_the_output(dtype):
    # 16 experts x 512 x 7168 on one v5p chip: the lane-dense decode measured 4x the bf16
    # output's bytes of temporaries (0.47 GB, either dtype), the pair form's [..., 16, 2] lookup
    # padded to 128 lanes 64x (7.5 GB); the bound sits between, at 8x
    import jax
    from jax.sharding import SingleDeviceSharding

    from pallas_kernels import backend
    from pallas_kernels.mxfp4 import MXFP4, dequantize

    tpu_compile.require_libtpu()
    sh = SingleDeviceSharding(tpu_compile.topology_devices("v5p:2x2x1")[0])
    e, n, k = 16, 512, 7168
    blocks = jax.ShapeDtypeStruct((e, n, k // 32, 16), jnp.uint8, sharding=sh)
    scales = jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8, sharding=sh)
    with backend.target_platform("tpu"):
        c = jax.jit(lambda b, s: dequantize(MXFP4(b, s), dtype)).lower(blocks, scales).compile()
    ma = c.memory_analysis()
    out = e * n * k * jnp.dtype(dtype).itemsize
    assert ma.output_size_in_bytes == out
    assert ma.temp_size_in_bytes <= 8 * e * n * k * 2, (ma.temp_size_in_bytes, out)
