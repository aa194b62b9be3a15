"""What every task domain is, and what the generated domains share.

A domain (one file in this folder, one line in the registry, sandbox/tasks/domains/__init__.py)
makes tasks and their demonstrations: data generation, the prompt, the check spec (which scoring
method of sandbox/verifiers.py judges the task, with the fields it needs) and, for SFT, well-formed
wrong demonstrations. How a task is scored is not a domain's business: `Task.family` names a
scoring method, `meta["domain"]` names the domain that made the task.

    class Domain:
        name          the domain's name (meta["domain"] of its tasks; config.tasks.domains)
        multi_turn    demos are lists of turns ({"command", "exit_code", "stdout", "stderr"})
                      played as episodes (rl.agent), not one completion string
        split_label   prefix of draw_split's random seed string (kept per domain so the tasks of
                      a seed never change)
        sample(rng, difficulty) -> (Task, demo)     generated domains only
        corrupt(rng, task, demo) -> wrong demo      well-formed, scores 0 (checked offline)

`OneShotDomain` adds the byte limits of the one-shot domains (prompt <= MAX_PROMPT_BYTES,
demonstration <= MAX_COMPLETION_BYTES) and builds their task ids and meta.
`draw_split(domain, split, n, seed, difficulty)` is the one split loop of every generated domain.
Also here, because two domains use them: `lines_check` (a check script comparing a file's lines)
and `WORDS` (the word list of the terminal domains).
"""

from __future__ import annotations

import random
from typing import Any

from ..schema import Task
from ..splits import DIFFICULTIES, SPLITS, split_of, task_hash

MAX_PROMPT_BYTES = 64
MAX_COMPLETION_BYTES = 48
TIMEOUT_S = 5.0
MEMORY_MB = 256

Demo = Any  # str (one completion) | list[dict] (turns of a multi-turn episode)


class Domain:
    name = ""
    multi_turn = False

    @property
    def split_label(self) -> str:
        return self.name

    @property
    def generated(self) -> bool:
        """Whether the domain draws tasks (False: its tasks are loaded from files)."""
        return type(self).sample is not Domain.sample

    def sample(self, rng: random.Random, difficulty: int) -> tuple[Task, Demo]:
        raise NotImplementedError(f"domain {self.name!r} loads its tasks from files; it does not "
                                  "generate them")

    def corrupt(self, rng: random.Random, task: Task, demo: Demo) -> Demo:
        raise NotImplementedError


def fits(prompt: str, completion: str) -> bool:
    return (len(prompt.encode()) <= MAX_PROMPT_BYTES
            and len(completion.encode()) <= MAX_COMPLETION_BYTES)


class OneShotDomain(Domain):
    """A one-shot generated domain: subclasses implement `_draw(rng, difficulty) -> (Task, demo)
    | None` (None when a draw exceeds the byte limits or is degenerate) and `corrupt`. Task ids:
    "<name>/<split>/d<difficulty>/<12 hex digits of a hash of the full task>"; meta: split,
    difficulty, domain, template, params (what corrupt() needs), demo."""

    @property
    def split_label(self) -> str:
        return f"generators|{self.name}"

    def sample(self, rng: random.Random, difficulty: int) -> tuple[Task, str]:
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        for _ in range(1000):
            out = self._draw(rng, difficulty)
            if out is not None and fits(out[0].prompt, out[1]):
                return out
        raise RuntimeError(f"{self.name}: could not draw a task within the byte limits")

    def _draw(self, rng: random.Random, difficulty: int) -> tuple[Task, str] | None:
        raise NotImplementedError

    def _task(self, difficulty: int, template: str, key: Any, uniq: Any, prompt: str, demo: str,
              params: dict, **fields: Any) -> Task:
        split = split_of(self.name, key)
        tid = f"{self.name}/{split}/d{difficulty}/{task_hash(self.name, key, uniq)[:12]}"
        meta = {"split": split, "difficulty": difficulty, "domain": self.name,
                "template": template, "params": params, "demo": demo}
        return Task(id=tid, prompt=prompt, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB, meta=meta,
                    **fields)


def draw_split(domain: Domain, split: str, n: int, seed: int,
               difficulty: int | None = None) -> list[tuple[Task, Demo]]:
    """n distinct tasks (by id) of `domain` in `split`, deterministic in the arguments;
    difficulty None cycles 1, 2, 3 so the levels are balanced."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None")
    rng = random.Random(f"{domain.split_label}|{split}|{seed}|{difficulty}")
    out: list[tuple[Task, Demo]] = []
    seen: set[str] = set()
    budget = 500 * n + 5000
    while len(out) < n:
        d = difficulty if difficulty is not None else DIFFICULTIES[len(out) % len(DIFFICULTIES)]
        for _ in range(budget):
            task, demo = domain.sample(rng, d)
            if task.meta["split"] == split and task.id not in seen:
                break
        else:
            raise ValueError(f"{domain.name}/{split}/difficulty {d}: fewer than {n} distinct "
                             "tasks found")
        seen.add(task.id)
        out.append((task, demo))
    return out


def lines_check(path: str, want: list[str]) -> str:
    """A python check: exit 0 iff the file at `path` holds the lines `want`, compared after the
    stdio rule (CRLF -> LF, trailing whitespace and trailing empty lines dropped)."""
    return _LINES_CHECK.format(path=path, want=want)


_LINES_CHECK = '''import sys
WANT = {want!r}
try:
    with open({path!r}, encoding="utf-8", errors="replace") as f:
        got = f.read()
except OSError:
    sys.exit(1)
lines = [ln.rstrip() for ln in got.replace("\\r\\n", "\\n").split("\\n")]
while lines and lines[-1] == "":
    lines.pop()
sys.exit(0 if lines == WANT else 1)
'''

WORDS = ("cat", "dog", "owl", "fox", "bee", "ant", "elk", "yak", "emu", "ape", "bat", "cow",
         "pig", "ram", "hen", "eel")
