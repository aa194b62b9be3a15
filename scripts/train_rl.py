"""RL post-training (GRPO / DAPO / GSPO / Dr.GRPO / RLOO / PPO presets) with sandbox rewards.

    python scripts/train_rl.py --config configs/rl.py:grpo_tiny               # needs SFT first
    python scripts/train_rl.py --config configs/rl.py:dapo_tiny --config.rl.steps=50
    python scripts/train_rl.py --config configs/rl.py:smoke --config.rl.init_from=scratch

Progress bar, TensorBoard events + metrics.jsonl in <workdir>/rl, periodic held-out eval,
orbax checkpoints (params, optimizer, rng, data position) resumed automatically.
"""

import _common  # noqa: F401
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:grpo_tiny", "RL config")
_RESUME = flags.DEFINE_bool("resume", True, "continue from the last good checkpoint")


def main(_):
    _common.setup_jax()
    from rl.loop import run_rl

    state = run_rl(_CONFIG.value, resume=_RESUME.value)
    print(f"RL done: step {int(state.step)} (skipped {int(state.skipped)} non-finite updates), "
          f"checkpoints in {_CONFIG.value.workdir}/rl")


if __name__ == "__main__":
    app.run(main)
