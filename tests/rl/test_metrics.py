"""Evaluation statistics: unbiased pass@k, Wilson and task-clustered intervals (hand values)."""

import math

import pytest

from rl.metrics import clustered_interval, mean_interval, pass_at_k, wilson_interval


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k: every 2-subset holds a correct sample
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(4, 5, 1)


def test_wilson_hand_value():
    # p = 0.5, n = 100, z = 1.96: centre 0.5, half = 1.96*sqrt(0.0025 + 0.00009604)/1.038416
    lo, hi = wilson_interval(0.5, 100)
    half = 1.96 * math.sqrt(0.25 / 100 + 1.96 ** 2 / 40000) / (1 + 1.96 ** 2 / 100)
    assert (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))


def test_clustered_interval_one_sample_per_task_is_wilson():
    per_task = [(1, 1)] * 30 + [(1, 0)] * 70
    assert clustered_interval(per_task) == pytest.approx(wilson_interval(0.3, 100))


def test_clustered_interval_widens_for_all_or_nothing_tasks():
    # 4 samples per task, every task either always passes or always fails: the 400 samples
    # carry the information of only 100 tasks, so the interval is Wilson over 100, not 400.
    per_task = [(4, 4)] * 30 + [(4, 0)] * 70
    assert clustered_interval(per_task) == pytest.approx(wilson_interval(0.3, 100))
    naive = wilson_interval(0.3, 400)
    assert naive[1] - naive[0] < clustered_interval(per_task)[1] - clustered_interval(per_task)[0]


def test_clustered_interval_never_narrower_than_all_trials_independent():
    # per-task rates spread less than binomial: capped at the plain trial count
    per_task = [(4, 2)] * 100
    assert clustered_interval(per_task) == pytest.approx(wilson_interval(0.5, 400))


def test_mean_interval_over_tasks():
    m, lo, hi = mean_interval([1.0, 0.5, 0.0, 1.0])
    assert m == 0.625 and (lo, hi) == wilson_interval(0.625, 4)
    # every task the same: an interval of the task count's width, never a point
    m, lo, hi = mean_interval([0.0] * 200)
    assert m == 0.0 and lo == 0.0 and 0.015 < hi < 0.025
