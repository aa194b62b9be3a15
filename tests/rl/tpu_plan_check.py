"""Opt-in: the planner's per-device program totals against the TPU compiler's, on a CPU host with
libtpu installed (the convention of tests/pallas_kernels/tpu_compile_check.py: pytest collects
test_*.py only, so the CI suite never runs this file; name it to run it):

    JAX_PLATFORMS=cpu python -m pytest -q -n 0 tests/rl/tpu_plan_check.py

Without libtpu the test fails with the message saying how to install it. It compiles
configs/rl.py:small_8dev (the small model, f32 parameters with bf16 compute, EP all_to_all,
data 2 x fsdp 2 x expert 2) for v5p:2x2x2 with train.aot.compiled_memory (train step, rollout,
reference forward; about 25 minutes on a 2-core host) and holds model.plan.per_device_plan's
"programs" (with the run's RunPlan, rows and row width) within 10% of each compiled total
(arguments + outputs + temporaries - aliased). docs/scaling.md section 4.2 has the table.
"""

from configs import rl as rl_configs
from model import plan
from model import sharding as shd
from pallas_kernels import tpu_compile
from train import aot, run_plan


def test_planner_programs_within_10_percent_of_compiled_small_8dev():
    tpu_compile.require_libtpu()
    c = rl_configs.get_config("small_8dev")
    res = aot.compiled_memory(c, "v5p:2x2x2")
    rows, seq = run_plan.run_batch_from_config(c)
    pd = plan.per_device_plan(plan.model_cfg(c), c.sharding.mesh, "tpu-v5p", rows, seq,
                              rules=shd.rules_from_config(c), run=run_plan.run_plan_from_config(c))
    for p in aot.PROGRAMS:
        assert res[p]["ok"], (p, res[p]["error"])
        ratio = pd["programs"][p] / res[p]["total_bytes"]
        assert abs(ratio - 1) <= 0.10, (p, pd["programs"][p], res[p]["total_bytes"], ratio)
