"""Every compiled Pallas kernel path lowers for the real backends, from this (CPU) host.

`jax.export` with platforms=["cuda"] / ["tpu"] runs the Pallas -> Triton and Pallas -> Mosaic TPU
lowerings in Python without the hardware (nothing is compiled or run; see
`pallas_kernels/lowering.py` for what this does and does not catch). Parametrised over kernel x
shape (one irregular arg-spec shape and one benchmark-sized shape per kernel) x platform x
forward/backward; each module must hold exactly the expected number of kernel custom calls, so a
path that silently fell back to XLA (or went through Mosaic GPU instead of Triton) fails. The
full sweep over every arg-spec shape: `python -m pallas_kernels.lowering`.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend, lowering
from pallas_kernels.dsa import ops as dsa_ops
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import pallas_kda
from pallas_kernels.mxfp4 import ops as mx_ops

CASES = lowering.representative_cases()


@pytest.mark.parametrize("mode", lowering.MODES)
@pytest.mark.parametrize("platform", lowering.PLATFORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.kernel}-{c.size}-{c.name}")
def test_kernel_lowers(case, platform, mode):
    text = lowering.export_text(case, platform, mode)
    counts = lowering.kernel_calls(text, platform)
    expected = case.n_fwd if mode == "fwd" else case.n_bwd
    err = lowering.check_calls(counts, platform, expected)
    assert err is None, f"{case.id} {platform} {mode}: {err}"
    if platform == "cuda" and "__gpu$xla.gpu.triton" in counts:
        assert lowering.verify_triton_modules(text) == expected


def test_xla_path_is_not_mistaken_for_a_kernel():
    """The check itself: an XLA-only module (impl="xla") fails it on both platforms."""
    case = next(c for c in CASES if c.kernel == "mxfp4_matmul")
    xla = lowering.Case(case.kernel, case.size, "xla", lambda fam: (
        lambda x, w: mx_ops.mxfp4_matmul(x, w, impl="xla")), case.args, case.argnums, 1, 1)
    for platform in lowering.PLATFORMS:
        counts = lowering.kernel_calls(lowering.export_text(xla, platform, "fwd"), platform)
        assert lowering.check_calls(counts, platform, 1) is not None
    assert "Mosaic GPU" in lowering.check_calls({"mosaic_gpu_v2": 1}, "cuda", 1)


def test_backend_resolution_rule():
    """kernel=None -> the platform's family (the cpu_default when interpreting on CPU);
    interpret=None -> interpret unless the platform compiles the family; explicit wins."""
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:
        assert backend.resolve(None, None, cpu_default="tpu") == ("tpu", True)
        assert backend.resolve(None, None, cpu_default="gpu") == ("gpu", True)
    assert backend.resolve("cuda", False) == ("gpu", False)
    assert backend.resolve("tpu", None)[1] == (jax.default_backend() != "tpu")
    with pytest.raises(ValueError):
        backend.resolve("triton", None)
    # a foreign compiled family is accepted (lowering only), not rejected up front
    assert mx_ops._resolve("pallas", False, "tpu") == ("pallas", False, "tpu")
    if on_cpu:  # impl="auto" is unchanged: the XLA paths on CPU
        assert mx_ops._resolve("auto", None, None)[0] == "xla"
        assert dsa_ops.resolve_impl("auto") == "xla"
        assert kda_ops._resolve_impl("auto", 128, 128) == "chunked_vjp"


def test_kernel_choice_reaches_the_configs():
    """kernel= picks the family's config: KDA's sequential form and compiler params, DSA's
    flavour and compiled tiles (the Mosaic block rules), and contradictions are errors."""
    gpu = pallas_kda.get_config(T=2048, K=128, V=128, backend="gpu")
    tpu = pallas_kda.get_config(T=2048, K=128, V=128, backend="tpu")
    assert (gpu.backend, gpu.seq_mode, tpu.backend, tpu.seq_mode) == ("gpu", "loop", "tpu", "grid")
    x = jnp.zeros((1, 16, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="seq_mode"):  # grid form + Triton params cannot lower
        pallas_kda.kda_pallas(x, x, x, x, x[..., 0], interpret=False,
                              config=pallas_kda.KDAConfig(seq_mode="grid", backend="gpu"))
    from pallas_kernels.dsa.config import DSABlockConfig, get_config

    cfg = get_config(t=13, s=29, topk=10, dim=40, backend="tpu", interpret=False)
    assert cfg.backend == "tpu" and cfg.idx_block_s % 128 == 0 and cfg.idx_block_t % 8 == 0
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="contradicts"):
        dsa_ops.indexer_scores(q, q[:, :, 0], q[..., 0], impl="pallas", kernel="tpu",
                               config=DSABlockConfig(backend="gpu"))
