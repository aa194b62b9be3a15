"""A small version of the load test (benchmarks/sandbox_load.py; 3,000 runs in `python scripts/bench.py
sandbox`): 120 jobs through the session pool, 8% adversarial (every kind at least once) plus two
reward hacks, submitted at once; nothing lost or misattributed, every slot clean and up after."""

from benchmarks.sandbox_load import _ADVERSARIAL, run_load


def test_mixed_load_loses_and_misattributes_nothing(pool):
    out = run_load(pool, runs=120, adversarial=0.08, seed=1)
    assert out["adversarial"] >= len(_ADVERSARIAL)
    assert (out["lost"], out["misattributed"], out["wrong_status"], out["dirty_after"]) == (0, 0, 0, 0), out
    assert set(out["hack_scores"].values()) == {0.0}, out
    assert out["slots_up_after"] == f"{pool.n}/{pool.n}"
    assert out["runs"] >= 120 and out["by_status"]["ok"] >= 120 - out["adversarial"]
