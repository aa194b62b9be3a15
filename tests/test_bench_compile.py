"""benchmarks/train_step_compile.py: the train-step compile probe runs end to end on a shrunken
matched config (the step wired as grpo_matched wires it, traced, lowered, compiled, profiled and
run) and reports every stage; a bad override fails before jax starts.

Not covered: the matched model's own numbers (minutes on 2 cores; the benchmark is run by hand).
"""

import json

import pytest

from benchmarks import train_step_compile

TINY = ["model.layer_pattern=K", "model.num_layers=1", "model.d_model=32",
        "model.kda.num_heads=2", "model.kda.head_dim=16", "model.moe.num_experts=0", "model.moe.dense_dim=32", "model.mtp.depth=0",
        "rl.prompts_per_batch=2", "rl.group_size=2", "rl.max_prompt_len=8",
        "rl.max_new_tokens=8"]


def test_probe_reports_every_stage_and_compiles_cold_after_cached_compiles(tmp_path, capsys):
    """The probe's record has every stage. jax decides once per process whether compiles use
    the persistent cache, so the probe runs here after a compile that used it (as in a suite
    worker or a notebook): it must still compile cold, write nothing to the cache (a probe that
    wrote its step there would read it back the next time: backend_s 0), and leave the cache in
    use for what follows."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    cache = tmp_path / "cache"
    saved = {k: getattr(jax.config, k) for k in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    try:
        jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(5))  # this process now uses the cache
        entries = set(cache.iterdir())
        assert entries, "the warm-up compile wrote no cache entry"
        capsys.readouterr()
        out = tmp_path / "rec.json"
        assert train_step_compile.main(["--set", *TINY, "--profile", "--run", "2",
                                        "--out", str(out)]) == 0
        assert set(cache.iterdir()) == entries  # the probe neither read nor wrote the cache
        jax.jit(lambda x: x * 5.0 - 2.0)(jnp.ones(7))
        assert set(cache.iterdir()) > entries  # and later compiles use it again
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
    rec = json.loads(out.read_text())
    assert rec["batch"]["tokens"] == [4, 16] and rec["old_logp"] == "current"
    # the reference log-probs come from the reference variables inside the step (as run_rl)
    assert rec["ref_logp_in_step"] and "ref_logp" not in rec["batch"]
    for stage in ("trace", "lower", "compile"):
        assert rec[f"{stage}_cpu_s"] > 0 and rec[f"{stage}_wall_s"] > 0
    assert rec["jaxpr_eqns"] > 100 and rec["hlo_instructions"] > rec["hlo_fusions"] > 0
    xla = rec["xla"]
    # the suite compiles with the elemental emitter (tests/conftest.py): no fusion-emitter
    # kernels; backend_s > 0: XLA's backend ran (a step read from the cache reports 0)
    assert xla["backend_s"] > 0 and xla["llvm_functions"] > 0 and xla["fusion_kernels"] >= 0
    assert len(rec["run_wall_s"]) == 2 and len(rec["outputs_sha256"]) == 16
    assert rec["loss"] == rec["loss"]  # not NaN
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rec


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="no field"):
        train_step_compile.main(["--set", "rl.nope=1"])
    with pytest.raises(SystemExit):
        train_step_compile.main(["--run", "-1"])
