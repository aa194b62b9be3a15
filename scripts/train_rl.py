"""RL post-training (GRPO / DAPO / GSPO / Dr.GRPO / RLOO / PPO presets) with sandbox rewards.

    python scripts/train_rl.py --config configs/rl.py:grpo_tiny               # needs SFT first
    python scripts/train_rl.py --config configs/rl.py:dapo_tiny --config.rl.steps=50
    python scripts/train_rl.py --config configs/rl.py:smoke --config.rl.init_from=scratch
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/train_rl.py \
        --config configs/rl.py:smoke_8dev --config.rl.init_from=scratch       # 8 fake devices

Progress bar, TensorBoard events + metrics.jsonl in <workdir>/rl, periodic held-out eval,
orbax checkpoints (params, optimizer, rng, data position) resumed automatically when they came
from the same config (else an error naming the differing fields: train/workdir.py; --noresume
starts over, moving the previous <workdir>/rl aside).

Scale-out: the run uses the mesh of config.sharding (docs/scaling.md); in a multi-process job
(JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, or JAX_DISTRIBUTED_AUTO=1) every
process runs this same command. At the end every process prints a digest of the final
parameters (equal bits give equal digests, whatever the mesh or process count) and checks that
all replicas of every parameter agree. Before anything runs, every process checks that all
run the same config and the launch checks pass (scripts/_common.py:stop_on_bad_config), else
all stop with the reason, exit code 2. --dry_run runs those checks for the job at hand and
exits; --check_devices=N for a job of N devices (no device is touched: a pod slice's launch
line checked on a laptop), --processes its process count, --device the accelerator whose
memory the planner checks (scripts/plan.py; docs/scaling.md section 1.1).
"""

import _common  # noqa: F401
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:grpo_tiny", "RL config")
_DRY, _CHECK, _DEVICE, _PROCESSES = _common.define_launch_flags()
_RESUME = flags.DEFINE_bool("resume", True, "continue from the last good checkpoint")


def main(_):
    config = _common.load_run_config(_CONFIG.value)
    if _DRY.value or _CHECK.value:  # nothing runs: the checks of a start-up, then exit
        _common.dry_run(config, ('rl',), num_devices=_CHECK.value or None,
                        device=_DEVICE.value, processes=_PROCESSES.value)
        return
    _common.setup_jax()
    _common.stop_on_bad_config(config, ('rl',), device=_DEVICE.value)
    import jax

    from model import sharding as shd
    from rl.checkpoint import tree_digest
    from train.rl import run_rl

    with _common.stop_on_workdir_mismatch():
        state = run_rl(config, resume=_RESUME.value)
    digest = tree_digest(state.params)
    bad = shd.replica_mismatches(state.params)
    print(f"process {jax.process_index()}/{jax.process_count()}: params digest {digest}; "
          + (f"REPLICAS DISAGREE in {len(bad)} slices: {bad[:5]}" if bad else
             "all replicas agree"))
    print(f"RL done: step {int(state.step)} (skipped {int(state.skipped)} non-finite updates), "
          f"checkpoints in {config.workdir}/rl")
    if bad:
        raise SystemExit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=_common.parse_flags)
