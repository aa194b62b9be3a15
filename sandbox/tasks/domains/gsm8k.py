"""GSM8K: grade-school word problems loaded from GSM8K-format JSONL (`question`, `answer` =
reasoning + "#### 42"), scored by the `math` method (math-verify on the final answer).

    tasks = load_gsm8k("gsm8k_test.jsonl", split="test", limit=100)   # [Task]

A loaded domain: it draws no tasks (DOMAIN.generated is False), so it cannot be named in
config.tasks.domains; it gives the demonstration (meta["demo"]) and, for SFT, a corruption: the
last \\boxed{} answer changed by +-1, 2 or 10 (or "1" appended when the answer is not an
integer; a boxed answer appended when the demo has none).
"""

from __future__ import annotations

import os
import random
import re

from ..loaders import iter_jsonl
from ..schema import Task, TaskFormatError
from .base import Domain

_CALC_RE = re.compile(r"<<[^<>]*>>")


def load_gsm8k(path: str | os.PathLike, *, split: str | None = None,
               limit: int | None = None) -> list[Task]:
    """GSM8K-format JSONL (`question`, `answer` = reasoning + "#### 42") as math-scored tasks.

    answer: the text after the last "####", thousands separators removed. meta: source "gsm8k",
    domain "gsm8k", split (if given), solution (the original reasoning), demo (the reasoning
    without <<...>> calculator notes, then "The answer is \\boxed{42}.")."""
    out = []
    for lineno, obj in iter_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        q, a = obj.get("question"), obj.get("answer")
        if not isinstance(q, str) or not isinstance(a, str) or "####" not in a:
            raise TaskFormatError(f"{path}:{lineno}: GSM8K record needs question and answer "
                                  "with '#### <final answer>'")
        reasoning, final = a.rsplit("####", 1)
        final = final.strip().replace(",", "")
        if not final:
            raise TaskFormatError(f"{path}:{lineno}: empty final answer")
        demo = _CALC_RE.sub("", reasoning).strip() + f"\nThe answer is \\boxed{{{final}}}."
        meta = {"source": "gsm8k", "domain": "gsm8k", "solution": reasoning.strip(),
                "demo": demo, "line": lineno}
        if split is not None:
            meta["split"] = split
        tid = f"gsm8k/{split + '/' if split else ''}{len(out)}"
        out.append(Task(id=tid, family="math", prompt=q, answer=final, meta=meta))
    return out


class Gsm8kDomain(Domain):
    name = "gsm8k"

    def corrupt(self, rng: random.Random, task: Task, demo: str) -> str:
        try:
            v = int(task.answer)
            wrong = str(v + rng.choice([-1, 1]) * rng.choice([1, 1, 2, 10]))
        except ValueError:
            wrong = task.answer + "1"
        return re.sub(r"\\boxed\{[^{}]*\}(?!.*\\boxed)", lambda m: "\\boxed{" + wrong + "}", demo,
                      flags=re.S) if "\\boxed{" in demo else demo + f"\nThe answer is \\boxed{{{wrong}}}."


DOMAIN = Gsm8kDomain()
