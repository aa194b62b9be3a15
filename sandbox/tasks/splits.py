"""The split rule shared by every generated domain: a task's split is a property of the task.

    split_of("arithmetic", key)  # "train" | "val" | "test"
    task_hash("code", key, uniq)  # 64 hex digits, the source of task ids

Every generated task has a canonical key made of everything that determines its prompt (the
domain file says what that is). bucket = int(sha256(json([domain, key]))[:8], 16) % 100;
train: bucket < 80, val: 80..89, test: 90..99. The split never depends on a seed, so no prompt
of any test split ever appears in any train split, whatever seeds are used; make_split
(sandbox/tasks/sampling.py) draws with a seeded random.Random and keeps the tasks whose bucket
matches. Not covered: keys must be JSON-serialisable (tuples hash like lists).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SPLITS = ("train", "val", "test")
DIFFICULTIES = (1, 2, 3)


def task_hash(*parts: Any) -> str:
    """sha256 hex digest of the compact, key-sorted JSON of `parts`."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def split_of(family: str, key: Any) -> str:
    """The split ("train" | "val" | "test") of a task of domain `family` with canonical key `key`."""
    b = int(task_hash(family, key)[:8], 16) % 100
    return "train" if b < 80 else ("val" if b < 90 else "test")
