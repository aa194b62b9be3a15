"""pallas_kernels/check.py (the numerics + speed table of notebooks/kernels.ipynb and
scripts/gpu_check.sh): its error measure, that a wrong kernel fails its case, and the case table.

The full small-shape run of every kernel happens in tests/test_notebooks.py (the kernels
notebook); here only the cheap DSA indexer case runs, numerics only.
"""

import dataclasses

import jax
import numpy as np
import pytest

from pallas_kernels import check, lowering


def test_rel_rms_and_non_finite_patterns():
    ref = np.array([1.0, -2.0, np.inf, np.nan])
    assert check.rel_rms(ref, ref) == 0.0
    off = ref * np.array([1.01, 1.01, 1.0, 1.0])
    assert check.rel_rms(off, ref) == pytest.approx(0.01)
    assert check.rel_rms(np.array([1.0, -2.0, 5.0, np.nan]), ref) == float("inf")  # inf lost
    assert check.rel_rms(np.array([np.nan, -2.0, np.inf, np.nan]), ref) == float("inf")  # NaN
    assert check.rel_rms(np.array([1.0, -2.0, -np.inf, np.nan]), ref) == float("inf")  # sign
    with pytest.raises(ValueError, match="shape"):
        check.rel_rms(np.zeros(3), np.zeros(4))


def test_a_wrong_kernel_fails_its_case(interpret):
    """The DSA indexer case as is passes; with its Pallas output scaled by 1.01, or only its
    gradients, it fails, with the errors named where they are."""
    case, = check.cases("small", ["dsa_indexer"])
    good = check.check_case(case, interpret=interpret, timing=False)
    assert good["ok"] and good["max_fwd_err"] < 1e-5, good
    assert set(good["errors"]) == {"scores", "dq_idx", "dk_idx", "dw"}

    def broken(impl, interp):
        f = case.fn(impl, interp)
        if impl != "pallas":
            return f
        return lambda qi, ki, w: 1.01 * f(qi, ki, w)

    bad = check.check_case(dataclasses.replace(case, fn=broken), interpret=interpret,
                           timing=False)
    assert not bad["ok"]
    assert bad["errors"]["scores"] == pytest.approx(0.01, rel=1e-3)
    assert bad["errors"]["dw"] == pytest.approx(0.01, rel=1e-3)  # d(1.01 s)/dw = 1.01 ds/dw
    assert "NO" in check.format_table([good, bad]).splitlines()[3]

    def wrong_gradient(impl, interp):  # same forward values, gradients scaled by 1.01
        f = case.fn(impl, interp)
        if impl != "pallas":
            return f
        return lambda qi, ki, w: (lambda s: s + 0.01 * (s - jax.lax.stop_gradient(s)))(
            f(qi, ki, w))

    bad = check.check_case(dataclasses.replace(case, fn=wrong_gradient), interpret=interpret,
                           timing=False)
    assert bad["max_fwd_err"] < 1e-5 and not bad["ok"]
    assert bad["errors"]["dq_idx"] == pytest.approx(0.01, rel=1e-3)


def test_case_table():
    """One small case per kernel (the lowering sweep's representative shapes) and the benchmark
    cases, built without allocating any input; unknown names are refused."""
    small = check.cases("small")
    assert [c.kernel for c in small] == list(lowering.KERNEL_NAMES)
    assert [c.name for c in small] == [lowering.REPRESENTATIVE[k] for k in lowering.KERNEL_NAMES]
    bench = check.cases("bench")
    assert {c.kernel for c in bench} == set(lowering.KERNEL_NAMES)
    assert {c.name for c in bench if c.kernel == "mxfp4_matmul"} == {"decode", "prefill"}
    for c in small + bench:
        assert c.dtype in check.TOLERANCE and len(c.arg_names) > max(c.argnums)
    with pytest.raises(ValueError, match="unknown kernels"):
        check.cases("small", ["kda", "flash"])
    with pytest.raises(ValueError, match="size"):
        check.cases("huge")
