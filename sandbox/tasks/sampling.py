"""Drawing tasks of the generated domains by name: splits and mixtures.

    pairs = make_split("arithmetic", "train", 3000, seed=0)        # [(Task, demo)]
    pairs = make_mixture(["arithmetic", "code"], "val", 50, seed=0)  # round-robin interleaved

make_split(family, split, n, seed, difficulty=None): n distinct tasks (by id) of the registered
domain `family` (sandbox/tasks/domains) in `split`, deterministic in the arguments; difficulty
None cycles 1, 2, 3 so the levels are balanced. The demo is a completion string for one-shot
domains and the list of demonstration turns (meta["demo_turns"]) for multi-turn ones. Splits are
disjoint whatever the seeds (sandbox/tasks/splits.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from .domains import get_domain
from .domains.base import Demo, draw_split
from .schema import Task


def make_split(family: str, split: str, n: int, seed: int,
               difficulty: int | None = None) -> list[tuple[Task, Demo]]:
    """n distinct tasks of domain `family` in `split` (see the module docstring)."""
    domain = get_domain(family)
    if not domain.generated:
        raise ValueError(f"domain {family!r} loads its tasks from files; make_split draws only "
                         "generated domains")
    return draw_split(domain, split, n, seed, difficulty)


def make_mixture(domains: Iterable[str], split: str, n_per_domain: int,
                 seed: int) -> list[tuple[Task, Demo]]:
    """n_per_domain tasks of each domain, interleaved round-robin (every prefix is balanced)."""
    per = [make_split(f, split, n_per_domain, seed) for f in domains]
    return [p[i] for i in range(n_per_domain) for p in per]
