"""The older module name of the multi-step terminal domain: re-exports only.

The domain lives in sandbox/tasks/domains/multistep.py (read its docstring); sft_episodes in
sandbox/tasks/sft.py.

    from sandbox.tasks import multistep
    tasks = multistep.make_split("train", 10, seed=0)    # [Task]
"""

from .domains.multistep import (
    FAMILY,
    MAX_COMMAND_BYTES,
    MAX_OBSERVATION_BYTES,
    MAX_PROMPT_BYTES,
    TEMPLATES,
    corrupt,
    describe,
    make_split,
    passes,
    sample,
    simulate,
)
from .sft import sft_episodes

__all__ = ["FAMILY", "MAX_COMMAND_BYTES", "MAX_OBSERVATION_BYTES", "MAX_PROMPT_BYTES", "TEMPLATES",
           "corrupt", "describe", "make_split", "passes", "sample", "simulate", "sft_episodes"]
