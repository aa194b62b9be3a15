"""Supervised fine-tuning of the model from scratch on generated demonstrations.

    python scripts/sft.py --config configs/rl.py:demo            # the demo's SFT (time: README)
    python scripts/sft.py --config configs/rl.py:smoke           # the same, smaller

First the DSA indexer's dense warm-up (config.sft.indexer_warmup_steps: the indexer alone
learns the dense attention's distribution, everything else frozen; 0 skips it), then the SFT
objective (model/objectives.py: next-token + MTP + MoE balance + indexer KL, the same auxiliary
terms the RL step trains; its first config.sft.dense_steps steps attend densely with the
indexer KL over every key, in the demo all of them: train/sft.py:sft_dense_steps says why)
on (prompt, completion) pairs drawn from the task domains
(sandbox/tasks/domains/, by sandbox/tasks/sampling.py and sandbox/tasks/sft.py) with
config.sft.imperfect_frac well-formed but wrong demonstrations; grain input, orbax checkpoints in
<workdir>/sft/indexer_warmup/checkpoints and <workdir>/sft/checkpoints (resumed automatically
when they came from the same config, else an error naming the differing fields: train/workdir.py;
--noresume starts over, moving the previous <workdir>/sft aside).

Scale-out: runs on the mesh of config.sharding, one process per host in a multi-process job
(docs/scaling.md), e.g. on 8 fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/sft.py \
        --config configs/rl.py:smoke_8dev

Before anything runs every process checks that all run the same config and the launch checks
pass (--dry_run prints them; --check_devices=N, --processes, --device: a job of another size and
its memory, no device touched; docs/scaling.md section 1.1).
"""

import _common  # noqa: F401  (XLA flags before jax)
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo", "RL/SFT config")
_DRY, _CHECK, _DEVICE, _PROCESSES = _common.define_launch_flags()
_RESUME = flags.DEFINE_bool("resume", True, "continue from the last good checkpoint")


def main(_):
    config = _common.load_run_config(_CONFIG.value)
    if _DRY.value or _CHECK.value:  # nothing runs: the checks of a start-up, then exit
        _common.dry_run(config, ('sft',), num_devices=_CHECK.value or None,
                        device=_DEVICE.value, processes=_PROCESSES.value)
        return
    _common.setup_jax()
    _common.stop_on_bad_config(config, ('sft',), device=_DEVICE.value)
    from train.sft import run_sft

    with _common.stop_on_workdir_mismatch():
        state = run_sft(config, resume=_RESUME.value)
    print(f"SFT done: step {int(state.step)}, checkpoints in {config.workdir}/sft")


if __name__ == "__main__":
    app.run(main, flags_parser=_common.parse_flags)
