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


def test_probe_reports_every_stage(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert train_step_compile.main(["--set", *TINY, "--profile", "--run", "2",
                                    "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["batch"]["tokens"] == [4, 16] and rec["old_logp"] == "current"
    for stage in ("trace", "lower", "compile"):
        assert rec[f"{stage}_cpu_s"] > 0 and rec[f"{stage}_wall_s"] > 0
    assert rec["jaxpr_eqns"] > 100 and rec["hlo_instructions"] > rec["hlo_fusions"] > 0
    xla = rec["xla"]
    # the suite compiles with the elemental emitter (tests/conftest.py): no fusion-emitter kernels
    assert xla["backend_s"] > 0 and xla["llvm_functions"] > 0 and xla["fusion_kernels"] >= 0
    assert len(rec["run_wall_s"]) == 2 and len(rec["outputs_sha256"]) == 16
    assert rec["loss"] == rec["loss"]  # not NaN
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rec


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="no field"):
        train_step_compile.main(["--set", "rl.nope=1"])
    with pytest.raises(SystemExit):
        train_step_compile.main(["--run", "-1"])
