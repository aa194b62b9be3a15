"""scripts/longctx.py's copy_task (the induction warm-up of the long-context benchmark), pure
numpy: every target is the token that followed its predecessor's earlier occurrence, no target
is reachable without looking back (the first token of the repeat is not a target), and the
train.copy_frac bound is enforced by --dry_run validation. Not covered: whether the curriculum
makes attention learn (measured in the benchmark, scripts/longctx.py docstring)."""

import numpy as np
import pytest


def _longctx():
    from scripts import longctx
    return longctx, longctx.Vocab(n_keys=16, n_values=16, size=64)


def test_copy_targets_follow_their_predecessor_earlier():
    L, voc = _longctx()
    for seed in range(30):
        ex = L.copy_task(np.random.default_rng(seed), voc, 32)
        t, g = ex.tokens, ex.targets
        assert t.shape == (32,) and t[0] == L.BOS and np.all(t[1:] >= voc.key0)
        assert np.all(t[1:] < voc.size)
        (first_rep,) = np.flatnonzero(t[2:] == t[1])[:1] + 2  # where the segment repeats
        n = first_rep - 1
        assert len(set(t[1:1 + n].tolist())) == n  # distinct: the look-up is unambiguous
        assert not g[:first_rep + 1].any() and g[first_rep + 1:].all()
        for pos in np.flatnonzero(g):
            (prev,) = np.flatnonzero(t[1:first_rep] == t[pos - 1]) + 1
            assert t[prev + 1] == t[pos]  # copy what followed the predecessor's occurrence


def test_copy_task_rejects_short_length_and_dry_run_checks_copy_frac():
    L, voc = _longctx()
    with pytest.raises(ValueError, match="too short"):
        L.copy_task(np.random.default_rng(0), voc, 8)
    from configs import longctx as cfg
    c = cfg.get_config("smoke")
    c.train.copy_frac = 1.0
    with pytest.raises(ValueError, match="copy_frac"):
        L.validate(c)
