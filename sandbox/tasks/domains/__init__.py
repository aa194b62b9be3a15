"""The task domains: one file each, registered below (its module on the import line, its DOMAIN
in the DOMAINS tuple).

    from sandbox.tasks.domains import DOMAINS, get_domain
    get_domain("arithmetic").sample(random.Random(0), 1)   # (Task, demo)

A domain makes tasks (data, prompt, check spec, demonstrations, corruptions; see base.py for the
interface); a scoring method judges them (sandbox/verifiers.py, the one list of those). Adding a
domain: a new file here defining `DOMAIN` (a base.Domain) and its entry below; sampling
(sandbox/tasks/sampling.py), SFT mixing (sandbox/tasks/sft.py), config.tasks.domains
(train.data.task_domains) and multi-turn routing (`is_multi_turn_task`) read this registry.
"""

from __future__ import annotations

from . import arithmetic, code, gsm8k, multistep, terminal
from .base import Domain

DOMAINS: dict[str, Domain] = {d.name: d for d in (
    arithmetic.DOMAIN,
    code.DOMAIN,
    terminal.DOMAIN,
    multistep.DOMAIN,
    gsm8k.DOMAIN,
)}


def get_domain(name: str) -> Domain:
    """The registered domain `name`; ValueError naming the known ones otherwise."""
    d = DOMAINS.get(name)
    if d is None:
        raise ValueError(f"unknown task domain {name!r} (known: {sorted(DOMAINS)})")
    return d


def generated_domains() -> list[str]:
    """Names of the domains that draw tasks (what config.tasks.domains may list), sorted."""
    return sorted(n for n, d in DOMAINS.items() if d.generated)


def is_multi_turn(name: str | None) -> bool:
    """Whether tasks of domain `name` are played as multi-turn episodes (False for None or a name
    no domain has, e.g. tasks loaded from a file)."""
    d = DOMAINS.get(name) if name is not None else None
    return d is not None and d.multi_turn


def is_multi_turn_task(task) -> bool:
    """Whether a task is a multi-turn task, played as an episode over a sandbox session (rl.agent):
    a task of a multi-turn domain (multistep), or a terminal task that asks for it with
    meta["agent"] = True (e.g. a folder task). Every other task is one-shot: one completion."""
    meta = getattr(task, "meta", {}) or {}
    return is_multi_turn(meta.get("domain")) or bool(meta.get("agent"))
