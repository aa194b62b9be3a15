"""The data of a run: the task splits of its domains and SFT's demonstrations, and the digest of
what a phase trains on (what a resumed phase must see again: train/workdir.py).

    splits = load_task_splits(config)          # {"train"|"val"|"test": [(Task, demo)]}
    examples = sft_train_examples(config)      # [(prompt, completion or turns, ok)]
    record = phase_data(config, "rl")          # {"data", "count", "sha256"}

Tasks come from the generated domains (config.tasks.domains, sandbox/tasks/domains) or, for
RL's prompts, a task file (config.tasks.task_file); SFT reads its own domains (sft.domains).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from rl.envs import EnvConfig, demo_turns
from rl.pipeline import task_domain
from sandbox.tasks import load_tasks, sft
from sandbox.tasks.domains import generated_domains, is_multi_turn_task
from sandbox.tasks.sampling import make_split


def _domains(spec: str, field: str) -> list[str]:
    doms = [f.strip() for f in spec.split(",") if f.strip()]
    valid = generated_domains()
    unknown = [f for f in doms if f not in valid]
    if unknown or not doms:
        raise ValueError(f"{field}: unknown task domain {(unknown or [''])[0]!r}; give a "
                         f"comma-separated list of {valid}")
    return doms


def task_domains(config) -> list[str]:
    """config.tasks.domains (RL's and evaluation's) as a list, each checked against the task
    domain registry."""
    return _domains(config.tasks.domains, "tasks.domains")


def sft_domains(config) -> list[str]:
    """The domains SFT's demonstrations come from: config.sft.domains, or tasks.domains when
    it is empty."""
    spec = config.sft.domains
    return _domains(spec, "sft.domains") if spec else task_domains(config)


def load_task_splits(config, domains: list[str] | None = None) -> dict:
    """{"train": [(Task, demo)], "val": [...], "test": [...]} from the generated domains
    `domains` (default: task_domains) (or tasks.task_file for RL prompts, without
    demonstrations)."""
    t = config.tasks
    doms = task_domains(config) if domains is None else domains
    diff = {f: (t.difficulty.get(f, 0) or None) for f in doms}
    n = {"train": t.train_per_domain, "val": t.val_per_domain, "test": t.test_per_domain}

    def split(f, s):  # a multi-turn domain's demo is its list of turns (meta["demo_turns"])
        return make_split(f, s, n[s], t.seed, difficulty=diff[f])

    out = {s: [p for f in doms for p in split(f, s)] for s in n}
    if t.task_file:
        out["train"] = [(task, None) for task in load_tasks(t.task_file)]
    return out


def balanced(tasks: list, n: int) -> list:
    """The first n tasks taken round-robin over domains (so every domain is represented)."""
    by = {}
    for t in tasks:
        by.setdefault(task_domain(t), []).append(t)
    out, queues = [], list(by.values())
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def is_episode(ex) -> bool:
    """Whether an SFT example (prompt, completion, ok) is an episode (a demonstrated multi-turn
    task): its completion is a list of (assistant text, observation) turns."""
    return isinstance(ex[1], (list, tuple))


def sft_examples(config, pairs) -> list:
    """(prompt, completion, ok) for SFT from (task, demo) pairs, sft.imperfect_frac of each
    domain well-formed but wrong: one-shot domains through sandbox.tasks.sft.sft_examples,
    multi-turn tasks' episodes through sandbox.tasks.sft.sft_episodes rendered exactly as the rollouts'
    environment renders turns (rl.envs.demo_turns with agent_env_config)."""
    s = config.sft
    one = [p for p in pairs if not is_multi_turn_task(p[0])]
    multi_turn = [p[0] for p in pairs if is_multi_turn_task(p[0])]
    out = sft.sft_examples(one, s.imperfect_frac, config.seed) if one else []
    if multi_turn:
        env = agent_env_config(config.rl.agent)
        out += [(t.prompt, demo_turns(t, env, turns), ok)
                for t, turns, ok in sft.sft_episodes(multi_turn, s.imperfect_frac, config.seed)]
    return out


def sft_train_examples(config) -> list:
    """SFT's examples (sft_examples) from the train split of its own domains (sft_domains)."""
    return sft_examples(config, load_task_splits(config, sft_domains(config))["train"])


def agent_env_config(a):
    """rl.envs.EnvConfig of multi-turn episodes from the agent section (config.rl.agent)."""
    return EnvConfig(max_turns=int(a.max_turns), observation_tokens=int(a.observation_tokens),
                     command_timeout_s=float(a.command_timeout_s),
                     format_penalty=float(a.format_penalty))


def phase_data(config, phase: str, items=None) -> dict:
    """The data record of `phase`: "sft" -> SFT's demonstrations (sft_train_examples), "rl" ->
    RL's train tasks (the train split of load_task_splits); `items`: those, when the caller has
    them already. {"data", "count", "sha256"}."""
    if phase == "sft":
        items = sft_train_examples(config) if items is None else items
    elif phase == "rl":
        items = ([t for t, _ in load_task_splits(config)["train"]] if items is None
                 else items)
    else:
        raise ValueError(f"phase must be 'sft' or 'rl', got {phase!r}")
    what = "SFT demonstrations" if phase == "sft" else "RL train tasks"
    return {"data": what, "count": len(items), "sha256": data_digest(items)}


def data_digest(items) -> str:
    """sha256 of a list of training items (tuples, dicts, dataclasses such as Task) as
    canonical JSON."""
    def plain(x):
        if dataclasses.is_dataclass(x):
            d = dataclasses.asdict(x)
            meta = d.get("meta")
            if isinstance(meta, dict) and "domain" in meta:
                # hashed under the key the recorded digests were written with (the task domain's
                # meta key was "family_name"), so run directories recorded before still resume
                d["meta"] = {("family_name" if k == "domain" else k): v for k, v in meta.items()}
            return d
        if isinstance(x, (set, frozenset)):  # in an order that does not depend on hashing
            return sorted(x, key=repr)
        return repr(x)
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=plain).encode()).hexdigest()
