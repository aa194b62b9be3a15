"""benchmarks/kda.py's --prefill table (the numbers behind KDAConfig.recurrent_max_len): it times
both forms of a cached call and reports how far apart their results are. Covered: the table's
fields on one tiny shape (one round). Not covered: the timings themselves (benchmarks, not
tests)."""

from benchmarks import kda as kda_bench


def test_prefill_table_times_both_forms_and_they_agree():
    res = kda_bench.prefill(rounds=1, shapes=((2, 1, 8, 5),))
    row = res["2,1,8,5"]
    for name in ("chunked", "recurrent"):
        assert row[name]["first_s"] > 0 and row[name]["run_ms"] > 0
    # the outputs and final states differ only by f32 rounding; the random state and inputs
    # make them far from zero, so a wrong form (e.g. no initial state) would differ by O(1)
    assert row["max_abs_diff"] < 1e-4
