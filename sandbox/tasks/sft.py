"""SFT mixing: demonstrations with a share of well-formed wrong ones (DESIGN section 7: about 40%
imperfect leaves room for RL).

    rows = sft_examples(pairs, imperfect_frac=0.4, seed=0)       # [(prompt, completion, ok)]
    eps = sft_episodes(tasks, imperfect_frac=0.4, seed=0)        # [(task, turns, ok)]
    wrong = corrupt(rng, task, demo)                             # one wrong demonstration

sft_examples: one-shot (task, demo) pairs, in order; within each domain exactly
round(imperfect_frac * count) completions are corrupted (chosen with `seed`).
sft_episodes: multi-turn tasks, in order; exactly round(imperfect_frac * n) get corrupted turns
(render them with rl.envs.demo_turns). corrupt dispatches on meta["domain"] through the
domain registry (sandbox/tasks/domains), so every domain, generated or loaded (gsm8k), has one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .domains import DOMAINS
from .domains.base import Demo
from .schema import Task


def corrupt(rng: random.Random, task: Task, demo: Demo) -> Demo:
    """A well-formed wrong demonstration for a task made (or loaded) by a registered domain."""
    dom = task.meta.get("domain")
    domain = DOMAINS.get(dom)
    if domain is None:
        raise ValueError(f"task {task.id}: no domain {dom!r} "
                         f"(known: {sorted(DOMAINS)})")
    return domain.corrupt(rng, task, demo)


def sft_examples(pairs: Sequence[tuple[Task, str]], imperfect_frac: float,
                 seed: int) -> list[tuple[str, str, bool]]:
    """(prompt, completion, is_correct) in the order of `pairs`; within each domain exactly
    round(imperfect_frac * count) completions are corrupted (chosen with `seed`)."""
    if not 0.0 <= imperfect_frac <= 1.0:
        raise ValueError("imperfect_frac must be in [0, 1]")
    rng = random.Random(f"sft|{seed}")
    by_domain: dict[str, list[int]] = {}
    for i, (t, _) in enumerate(pairs):
        by_domain.setdefault(t.meta.get("domain", t.family), []).append(i)
    bad: set[int] = set()
    for dom in sorted(by_domain):
        idx = by_domain[dom]
        bad.update(rng.sample(idx, round(imperfect_frac * len(idx))))
    out = []
    for i, (t, demo) in enumerate(pairs):
        if i in bad:
            out.append((t.prompt, corrupt(rng, t, demo), False))
        else:
            out.append((t.prompt, demo, True))
    return out


def sft_episodes(tasks: Sequence[Task], imperfect_frac: float,
                 seed: int) -> list[tuple[Task, list[dict], bool]]:
    """(task, demo turns, is_correct) in task order; exactly round(imperfect_frac * n) get
    corrupted turns (chosen with `seed`). Render them with rl.envs.demo_turns."""
    if not 0.0 <= imperfect_frac <= 1.0:
        raise ValueError("imperfect_frac must be in [0, 1]")
    rng = random.Random(f"multistep-sft|{seed}")
    bad = set(rng.sample(range(len(tasks)), round(imperfect_frac * len(tasks))))
    return [(t, corrupt(rng, t, t.meta["demo_turns"]), False) if i in bad
            else (t, t.meta["demo_turns"], True) for i, t in enumerate(tasks)]
