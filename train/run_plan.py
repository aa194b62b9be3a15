"""What an RL run config (configs/rl.py) asks of the planner (model/plan.py): the run's
allocations besides the model (`run_plan_from_config` -> model.plan.RunPlan: optimizer numerics,
micro-batches, the reference policy, the rollout batch) and the rows and row width it trains on
(`run_batch_from_config`), and a phase's per-device memory by the planner (`planned_memory`).
Readers: scripts/plan.py, train/aot.py (the launch check's memory: compiled or planned).
"""

from __future__ import annotations

from model import plan
from model import sharding as shd
from model.plan import RunPlan
from rl.algorithms import algo_from_config


def run_plan_from_config(config) -> RunPlan:
    """RunPlan of an RL config (configs/rl.py): its optimizer numerics, micro-batches, whether
    the algorithm keeps a reference policy, and the rollout batch."""
    o, r = config.optim, config.rl
    algo = algo_from_config(r.algo)
    return RunPlan(master_dtype=o.master_dtype, mu_dtype=o.mu_dtype, micro_batches=int(r.micro_batches),
                   reference=bool(algo.needs_ref),
                   rollout_rows=int(r.prompts_per_batch * r.group_size),
                   rollout_len=int(r.max_prompt_len + r.max_new_tokens),
                   rollout_prompt_len=int(r.max_prompt_len),
                   rollout_experts=r.rollout_experts)


def run_batch_from_config(config) -> tuple[int, int]:
    """(rows, tokens per row) of an RL config's training batch: the rollout rows
    (rl.prompts_per_batch x rl.group_size) at the one-shot row width (rl.max_prompt_len +
    rl.max_new_tokens), what each RL update trains on."""
    r = config.rl
    return int(r.prompts_per_batch * r.group_size), int(r.max_prompt_len + r.max_new_tokens)


def planned_memory(config, phase: str, shape: dict, device: str) -> dict:
    """Per-device bytes a phase ("rl" or "sft") of a run config needs on a mesh of `shape` of
    `device`s, by the planner (model.plan.per_device_plan with the config's run, rows and row
    width) -> {"train", "rollout" (RL; None otherwise), "usable", "source": "planner", "plan"}."""
    rules = shd.rules_from_config(config)
    cfg = plan.model_cfg(config)
    if phase == "rl":
        rows, seq = run_batch_from_config(config)
        run = run_plan_from_config(config)
    else:
        rows, seq = int(config.sft.batch_size), int(config.sft.seq_len)
        run = RunPlan(master_dtype=config.optim.master_dtype, mu_dtype=config.optim.mu_dtype)
    pd = plan.per_device_plan(cfg, shape, device, rows, seq, rules=rules, run=run)
    return {"train": pd["train"]["total"],
            "rollout": pd["rollout"]["total"] if pd.get("rollout") else None,
            "usable": pd["usable_bytes"], "source": "planner", "plan": pd}
