"""Supervised fine-tuning of the model from scratch on generated demonstrations.

    python scripts/sft.py --config configs/rl.py:demo            # ~6 min on 2 CPU cores
    python scripts/sft.py --config configs/rl.py:smoke           # ~1 min

First the DSA indexer's dense warm-up (config.sft.indexer_warmup_steps: the indexer alone
learns the dense attention's distribution, everything else frozen; 0 skips it), then the SFT
objective (model/objectives.py: next-token + MTP + MoE balance + indexer KL, the same auxiliary
terms the RL step trains) on (prompt, completion) pairs from sandbox/tasks/generators with
config.sft.imperfect_frac well-formed but wrong demonstrations; grain input, orbax checkpoints in
<workdir>/sft/indexer_warmup/checkpoints and <workdir>/sft/checkpoints (resumed automatically;
--noresume starts over).
"""

import _common  # noqa: F401  (sys.path, cache)
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:demo", "RL/SFT config")
_RESUME = flags.DEFINE_bool("resume", True, "continue from the last good checkpoint")


def main(_):
    _common.setup_jax()
    from rl.loop import run_sft

    state = run_sft(_CONFIG.value, resume=_RESUME.value)
    print(f"SFT done: step {int(state.step)}, checkpoints in {_CONFIG.value.workdir}/sft")


if __name__ == "__main__":
    app.run(main)
