"""Kernel dispatch tables (pallas_kernels/dispatch.py and each op's table in kda/dsa/mxfp4 ops.py).

Covered: what impl="auto" picks per platform and shape (the platform given as a fact, so the GPU
choice is checked on a CPU host) and that it logs the choice and the reason once per (op, reason),
at WARNING when a kernel the platform would run is skipped for the call's shape or dtype; an
explicit impl that cannot take a call raises UnsupportedImpl (a ValueError) saying why, from the
public ops before any kernel is traced; ModelConfig rejects an impossible explicit choice up
front (the demo's head_dim 48 with kda.impl="pallas") naming the field and the fix; capability
checks read only the facts they are given. Not covered: running the chosen kernels (the op test
files do that).
"""

import logging

import jax.numpy as jnp
import pytest

from configs import models
from model.config import ConfigError
from pallas_kernels import dispatch
from pallas_kernels.dsa import ops as dsa_ops
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.mxfp4 import ops as mx_ops

KDA = kda_ops.DISPATCH


@pytest.fixture
def records(caplog):
    dispatch.reset_log()
    caplog.set_level(logging.DEBUG, logger="pallas_kernels.dispatch")
    yield caplog
    dispatch.reset_log()


def _dispatch_records(caplog):
    return [r for r in caplog.records if r.name == "pallas_kernels.dispatch"]


def test_auto_picks_in_order_and_logs_once(records):
    assert KDA.resolve("auto", platform="gpu", K=64, V=128, dtype="bfloat16") == "pallas"
    assert KDA.resolve("auto", platform="tpu", K=64, V=64, dtype=jnp.float32) == "pallas"
    # the demo's head_dim 48 on a GPU: the kernels cannot tile it, auto falls back and says so
    assert KDA.resolve("auto", platform="gpu", K=48, V=48, dtype="float32") == "chunked_vjp"
    warned = [r for r in _dispatch_records(records) if r.levelno == logging.WARNING]
    assert len(warned) == 1
    msg = warned[0].getMessage()
    assert "kda" in msg and "'chunked_vjp'" in msg and "K=48, V=48" in msg and "power of two" in msg
    n = len(_dispatch_records(records))
    for _ in range(3):  # once per (op, choice, reasons)
        KDA.resolve("auto", platform="gpu", K=48, V=48, dtype="float32")
    assert len(_dispatch_records(records)) == n
    # a different reason is a new line
    assert KDA.resolve("auto", platform="gpu", K=64, V=64, dtype="float16") == "chunked_vjp"
    assert "float16" in _dispatch_records(records)[-1].getMessage()
    # CPU: the kernels could run (interpreted) but auto does not pick them: DEBUG, not WARNING
    assert KDA.resolve("auto", platform="cpu", K=64, V=64, dtype="float32") == "chunked_vjp"
    last = _dispatch_records(records)[-1]
    assert last.levelno == logging.DEBUG and "compiles no Pallas" in last.getMessage()
    # CPU with an untileable head dim: still only DEBUG (the platform would not run it anyway)
    KDA.resolve("auto", platform="cpu", K=48, V=48)
    assert _dispatch_records(records)[-1].levelno == logging.DEBUG


def test_auto_never_picks_explicit_only_and_names_are_kept():
    assert kda_ops.IMPLS == ("auto", "xla", "chunked", "chunked_vjp", "recurrent", "pallas")
    assert set(KDA.names()) == set(kda_ops.IMPLS)
    # the recurrent oracle and the autodiff chunked form only on request
    assert KDA.auto_order() == ["pallas", "chunked_vjp"]
    assert KDA.resolve("chunked", K=48, V=48) == "chunked"
    assert KDA.canonical("xla") == "chunked_vjp" and KDA.resolve("recurrent", K=48, V=48) == \
        "recurrent"
    for table in (dsa_ops.INDEXER_DISPATCH, dsa_ops.SPARSE_DISPATCH, mx_ops.MATMUL_DISPATCH,
                  mx_ops.GROUPED_DISPATCH):
        assert set(table.names()) == {"auto", "xla", "pallas"}
        assert table.resolve("auto", platform="gpu", dtype="bfloat16", K=64) == "pallas"
        assert table.resolve("auto", platform="cpu", dtype="bfloat16", K=64) == "xla"
        assert table.resolve("auto", platform="gpu", dtype="float16", K=64) == "xla"


def test_explicit_impossible_choice_raises_from_the_ops():
    x = jnp.zeros((1, 4, 1, 48), jnp.float32)  # [B,T,H,K], K = 48
    with pytest.raises(dispatch.UnsupportedImpl, match=r"kda: impl='pallas' cannot.*K=48.*"
                                                       r"power of two.*impl='auto'"):
        kda_ops.kda(x, x, x, x, x[..., 0], impl="pallas")
    assert kda_ops._resolve_impl("pallas", 64, 64) == "pallas"  # CPU: interpret mode, allowed
    with pytest.raises(ValueError, match="impl must be one of"):
        kda_ops.kda(x, x, x, x, x[..., 0], impl="triton")
    q = jnp.zeros((1, 2, 2, 8), jnp.float16)
    kv = jnp.zeros((1, 3, 8), jnp.float16)
    idx = jnp.zeros((1, 2, 2), jnp.int32)
    with pytest.raises(dispatch.UnsupportedImpl, match="dtype float16"):
        dsa_ops.sparse_attention(q, kv, idx, scale=1.0, v_dim=4, impl="pallas")
    with pytest.raises(dispatch.UnsupportedImpl, match=r"v_dim=9 is not in \(0, D=8\]"):
        dsa_ops.sparse_attention(q.astype(jnp.float32), kv.astype(jnp.float32), idx,
                                 scale=1.0, v_dim=9, impl="pallas")
    with pytest.raises(dispatch.UnsupportedImpl, match="dtype float16"):
        dsa_ops.indexer_scores(q, kv, q[..., 0], impl="pallas")
    w = mx_ops.quantize(jnp.ones((8, 32), jnp.float32))
    with pytest.raises(dispatch.UnsupportedImpl, match="mxfp4_matmul.*dtype float16"):
        mx_ops.mxfp4_matmul(jnp.ones((2, 32), jnp.float16), w, impl="pallas")
    # the same calls under "auto" run (XLA here), unchanged
    assert kda_ops.kda(x, x, x, x, x[..., 0])[0].shape == (1, 4, 1, 48)
    assert mx_ops.mxfp4_matmul(jnp.ones((2, 32), jnp.float16), w).shape == (2, 8)


def test_config_rejects_impossible_explicit_choice():
    with pytest.raises(ConfigError, match=r"^kda\.impl: impl='pallas' cannot take this call: "
                                          r"K=48, V=48 are not a power of two.*kda\.head_dim = "
                                          r"48.*set kda\.impl='auto'"):
        models.build("demo", **{"kda.impl": "pallas"})
    with pytest.raises(ConfigError, match=r"kda\.impl: .*V=24 is not a power of two"):
        models.build("test", **{"kda.impl": "pallas", "kda.v_head_dim": 24})
    with pytest.raises(ConfigError, match=r"kda\.impl: must be one of"):
        models.build("test", **{"kda.impl": "chunked"})  # a kernel name, not a config choice
    with pytest.raises(ConfigError, match=r"moe\.mxfp4_impl: must be one of"):
        models.build("test", **{"moe.mxfp4_impl": "triton"})
    # possible choices pass: auto / xla anywhere, pallas where the kernels tile the heads
    assert models.build("demo").kda.impl == "auto"
    assert models.build("demo", **{"kda.impl": "xla", "dsa.impl": "pallas"}).dsa.impl == "pallas"
    assert models.build("test", **{"kda.impl": "pallas"}).kda.impl == "pallas"
    # a KDA section the layout does not use is not checked (as every section field)
    assert models.build("demo", **{"kda.impl": "pallas", "layer_pattern": "D"})


def test_capability_checks_read_only_given_facts():
    assert KDA.reasons("pallas") == []  # nothing known: nothing against it
    assert KDA.reasons("pallas", K=48, V=64) == [
        "K=48 is not a power of two: the Pallas KDA kernels tile K and V in powers of two; use "
        "power-of-two head dims"]
    assert KDA.reasons("chunked", K=48, V=48, dtype="float16") == []
    assert KDA.problem("auto", K=48, V=48) is None
    assert KDA.problem("pallas", K=64, V=64, dtype=jnp.bfloat16) is None
    assert "dtype float16" in KDA.problem("pallas", K=64, V=64, dtype="float16")
    mx = mx_ops.MATMUL_DISPATCH
    assert mx.reasons("pallas", K=48) == ["K=48 is not a multiple of 32 (one MX block)"]
    assert dsa_ops.SPARSE_DISPATCH.reasons("pallas", v_dim=8, D=8) == []


def test_tables_are_checked_when_built():
    ok = dispatch.Impl("xla")
    with pytest.raises(ValueError, match="unique"):
        dispatch.OpTable("op", (ok, dispatch.Impl("xla")))
    with pytest.raises(ValueError, match="alias"):
        dispatch.OpTable("op", (ok,), aliases={"fast": "pallas"})
    with pytest.raises(ValueError, match="at least one"):
        dispatch.OpTable("op", (ok,), explicit_only=("xla",))
    never = dispatch.OpTable("op", (dispatch.Impl("pallas", cannot=(lambda **f: "never",)),))
    with pytest.raises(dispatch.UnsupportedImpl, match="no implementation can take"):
        never.resolve("auto")
