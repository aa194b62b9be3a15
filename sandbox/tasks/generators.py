"""The older module name of the generated one-shot domains: re-exports only, nothing defined here.

    from sandbox.tasks.generators import FAMILIES, make_split    # still works

Where things live now: the domains in sandbox/tasks/domains/ (arithmetic.py, code.py,
terminal.py, multistep.py, gsm8k.py; registry in domains/__init__.py), the split rule in
splits.py, make_split/make_mixture in sampling.py, SFT mixing (corrupt, sft_examples) in sft.py,
write_jsonl/read_jsonl in loaders.py, load_gsm8k in domains/gsm8k.py. FAMILIES is a view of the
registry: the generated one-shot domains by name (multistep is multi-turn; gsm8k is loaded).
"""

from .domains import DOMAINS
from .domains.arithmetic import countdown_ok
from .domains.base import MAX_COMPLETION_BYTES, MAX_PROMPT_BYTES, lines_check
from .domains.base import OneShotDomain as Generator
from .domains.gsm8k import load_gsm8k
from .loaders import read_jsonl, write_jsonl
from .sampling import make_mixture, make_split
from .sft import corrupt, sft_examples
from .splits import DIFFICULTIES, SPLITS, split_of

FAMILIES: dict[str, Generator] = {n: d for n, d in DOMAINS.items()
                                  if d.generated and not d.multi_turn}

__all__ = ["DIFFICULTIES", "FAMILIES", "MAX_COMPLETION_BYTES", "MAX_PROMPT_BYTES", "SPLITS",
           "Generator", "corrupt", "countdown_ok", "lines_check", "load_gsm8k", "make_mixture",
           "make_split", "read_jsonl", "sft_examples", "split_of", "write_jsonl"]
