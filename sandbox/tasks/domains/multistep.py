"""A multi-step terminal family: tasks no single guessed command can solve, because the file to
act on or the value to use is named only inside another file or in a command's output, under a
name drawn at random per task (4 characters of 31: about 920,000 names).

    tasks = make_split("train", 1000, seed=0)            # [Task], levels cycle 1, 2, 3
    task.meta["demo_turns"]    # [{"command", "exit_code", "stdout", "stderr"}, ...] (2-4 turns)
    episodes = sandbox.tasks.sft.sft_episodes(tasks, imperfect_frac=0.4, seed=0)
                               # [(task, turns, is_correct)]

Scoring method `terminal` (sandbox/verifiers.py); played as an episode (DOMAIN.multi_turn) by
rl.agent / rl.envs.SessionEnv. Through the registry, sandbox.tasks.sampling.make_split("multistep",
...) gives (task, demo turns) pairs like every other domain.

Templates (`{ptr}`, `{out}`, `{d}`, `{w}`, `{key}`, `{cfg}` are visible in the prompt; X, Y, ...
are the random names, visible only in files):

  level 1 (2 commands)
    copy_named   "{ptr} names a file. Copy that file to {out}."        cat {ptr}; cp X {out}
    count_named  "{ptr} names a file. Write its line count to {out}."  cat {ptr}; wc -l < X > {out}
    find_word    "One file in {d}/ contains {w}. Copy that file to {out}."
                                                       grep -l {w} {d}/*; cp {d}/X {out}
  level 2 (3 commands)
    two_hops     "{ptr} names a file that names another file. Copy the last one to {out}."
                                                       cat {ptr}; cat X; cp Y {out}
    set_key      "{ptr} names a file with a number. Set {key}= in {cfg} to that number."
                                                       cat {ptr}; cat X; sed -i 's/^{key}=.*/{key}=N/' {cfg}
    find_named   "One file in {d}/ contains {w} and a file name. Copy the named file to {out}."
                                                       grep -l {w} {d}/*; cat {d}/X; cp Y {out}
  level 3 (4 commands)
    three_hops   "{ptr} names a file, which names a file, which names a file. Copy the last one
                 to {out}."                            cat {ptr}; cat X; cat Y; cp Z {out}
    find_set     "One file in {d}/ contains {w} and a file name; that file has a number. Set
                 {key}= in {cfg} to it."               grep -l ...; cat {d}/X; cat Y; sed -i ...

Every task has decoy files with random names (and numbers): DECOYS more of each kind beside the
template's own, so a rule that never reads the pointer (copy the first file, the only file of
words, write a constant count) passes at most 15% of any template's tasks (it passed 30-60%
with the template's two or three files alone; see DECOYS), and copying the pointer fails.
Sizes fit a byte-level model of about 1M parameters: prompts under 110 bytes (MAX_PROMPT_BYTES
= 200 is the bound tested), commands under 48 bytes, each observation's stdout under 40 bytes
(MAX_OBSERVATION_BYTES = 100).

The check (python, run isolated on the session's final state, sandbox/session.py) compares the
target file's lines (trailing whitespace and trailing empty lines ignored) with the expected
ones: the copied file's content, the line count, or the whole config file with only {key}
changed. Expected values live only in the check, never in the files.

Demonstrations: `meta["demo_turns"]` are computed offline by `simulate` (a model of exactly the
command forms above: cat, grep -l over one directory, cp, wc -l < f > g, sed -i 's/^k=.*/k=v/');
tests/sandbox/test_multistep_tasks.py runs them in real sessions and compares observations and
verdicts. `corrupt(rng, task)` gives well-formed wrong turns (a decoy copied, a step skipped,
the pointer copied, a wrong number or key), checked offline to fail; sandbox.tasks.sft.sft_episodes
corrupts exactly round(imperfect_frac * n) of them, like sft_examples does for one-shot domains.

Splits: as in every domain (sandbox/tasks/splits.py), a task's split is a hash of its canonical key (the
template and the visible parameters: everything its prompt says), so no prompt of a test split is
ever in a train split, whatever the seeds; tasks sharing a prompt differ in their hidden files.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..schema import Task
from ..splits import DIFFICULTIES, split_of, task_hash
from .base import WORDS as _WORDS
from .base import Domain, draw_split, lines_check

FAMILY = "multistep"
MAX_PROMPT_BYTES = 200
MAX_COMMAND_BYTES = 48
MAX_OBSERVATION_BYTES = 100
_TIMEOUT_S = 5.0
_MEMORY_MB = 256
_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"
_PTRS = ("note.txt", "hint.txt", "todo.txt", "memo.txt", "next.txt", "info.txt", "ptr.txt",
         "where.txt", "see.txt", "lead.txt", "clue.txt", "map.txt")
_OUTS = ("out.txt", "ans.txt", "res.txt", "got.txt", "final.txt", "o.txt")
_DIRS = ("box", "data", "dir", "docs", "files", "logs", "inbox", "stash")
_KEYS = ("size", "port", "mode", "level", "count", "limit", "depth", "rate")
_CFGS = ("app.cfg", "conf.ini", "set.cfg", "run.conf")

# ---- the command model (demonstrations and corruptions are computed with it) -------------------

_CMD = [
    (re.compile(r"^cat (\S+)$"), "cat"),
    (re.compile(r"^grep -l (\S+) (\S+)/\*$"), "grep"),
    (re.compile(r"^cp (\S+) (\S+)$"), "cp"),
    (re.compile(r"^wc -l < (\S+) > (\S+)$"), "wc"),
    (re.compile(r"^sed -i 's/\^(\w+)=\.\*/(\w+)=(\d+)/' (\S+)$"), "sed"),
]


def simulate(files: dict[str, str], commands: Sequence[str]) -> tuple[list[dict], dict[str, str]]:
    """Runs `commands` on a copy of `files` with the model above; returns the structured turns
    ({"command", "exit_code", "stdout", "stderr"}) and the final files. Raises ValueError for a
    command outside the model or one that would fail (a missing file): demonstrations never do."""
    fs = dict(files)
    turns = []
    for c in commands:
        m, kind = next(((rx.match(c), k) for rx, k in _CMD if rx.match(c)), (None, None))
        if m is None:
            raise ValueError(f"command outside the model: {c!r}")
        out = ""
        if kind == "cat":
            out = fs[m[1]]
        elif kind == "grep":
            d = m[2] + "/"
            out = "".join(p + "\n" for p in sorted(fs) if p.startswith(d) and "/" not in p[len(d):]
                          and m[1] in fs[p])
        elif kind == "cp":
            fs[m[2]] = fs[m[1]]
        elif kind == "wc":
            fs[m[2]] = f"{fs[m[1]].count(chr(10))}\n"
        elif kind == "sed":
            k, k2, v, f = m[1], m[2], m[3], m[4]
            lines = fs[f].split("\n")
            fs[f] = "\n".join(f"{k2}={v}" if ln.startswith(k + "=") else ln for ln in lines)
        turns.append({"command": c, "exit_code": 0, "stdout": out, "stderr": ""})
    return turns, fs


def _norm_lines(text: str | None) -> list[str] | None:
    if text is None:
        return None
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def passes(task: Task, files: dict[str, str]) -> bool:
    """The check's verdict on final `files`, computed offline (the same rule as the script)."""
    p = task.meta["params"]
    return _norm_lines(files.get(p["target"])) == p["want"]


# ---- drawing tasks ------------------------------------------------------------------------------


def _names(rng: random.Random, k: int, suffix: str = ".txt") -> list[str]:
    """k distinct random names in draw order (a list, never a set: a set's order depends on
    PYTHONHASHSEED, which made the tasks differ from one process to the next)."""
    out: list[str] = []
    while len(out) < k:
        name = "".join(rng.choice(_ALPHABET) for _ in range(4)) + suffix
        if name not in _PTRS and name not in _OUTS and name not in out:  # ("next.txt" ...)
            out.append(name)
    return out


def _words(rng: random.Random, avoid: str | None = None) -> str:
    pool = [w for w in _WORDS if w != avoid]
    return "".join(" ".join(rng.choice(pool) for _ in range(rng.randint(1, 3))) + "\n"
                   for _ in range(rng.randint(1, 3)))


def _distinct_words(rng: random.Random, k: int, avoid: str | None = None) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        c = _words(rng, avoid)
        if c not in out:
            out.append(c)
    return out


def _cfg(rng: random.Random, key: str) -> tuple[str, int]:
    keys = [key] + rng.sample([k for k in _KEYS if k != key], rng.randint(1, 3))
    rng.shuffle(keys)
    vals = {k: rng.randint(1, 99) for k in keys}
    return "".join(f"{k}={vals[k]}\n" for k in keys), vals[key]


def _numbers(rng: random.Random, k: int, avoid: int) -> list[int]:
    return rng.sample([n for n in range(10, 100) if n != avoid], k)


# Each template: rng -> (visible params, prompt, files, demo commands, params for the check and
# corruptions, wrong command lists)
def _t_copy_named(rng):
    ptr, out = rng.choice(_PTRS), rng.choice(_OUTS)
    x, d1, d2 = _names(rng, 3)
    cx, c1, c2 = _distinct_words(rng, 3)
    files = {ptr: x + "\n", x: cx, d1: c1, d2: c2}
    return ((ptr, out), f"{ptr} names a file. Copy that file to {out}.", files,
            [f"cat {ptr}", f"cp {x} {out}"], {"target": out, "want": _norm_lines(cx)},
            [[f"cat {ptr}", f"cp {d1} {out}"], [f"cp {ptr} {out}"], [f"cp {d2} {out}"]])


def _t_count_named(rng):
    ptr, out = rng.choice(_PTRS), rng.choice(_OUTS)
    x, d1 = _names(rng, 2)
    n, m = rng.sample(range(2, 7), 2)
    pool = [w for w in _WORDS]
    files = {ptr: x + "\n", x: "".join(rng.choice(pool) + "\n" for _ in range(n)),
             d1: "".join(rng.choice(pool) + "\n" for _ in range(m))}
    # The counted file's length: one of COUNT_LINES, drawn from a second rng seeded by the
    # names (the draws above stay, so every later task's draw is what it was). Drawn from 2..6,
    # as first written, the constant answer 4 passed a fifth of these tasks without reading.
    side = random.Random(task_hash(FAMILY, "count", x, d1))
    n = side.choice(COUNT_LINES)
    files[x] = "".join(side.choice(pool) + "\n" for _ in range(n))
    return ((ptr, out), f"{ptr} names a file. Write its line count to {out}.", files,
            [f"cat {ptr}", f"wc -l < {x} > {out}"], {"target": out, "want": [str(n)]},
            [[f"cat {ptr}", f"wc -l < {d1} > {out}"], [f"wc -l < {ptr} > {out}"]])


def _t_find_word(rng):
    d, w, out = rng.choice(_DIRS), rng.choice(_WORDS), rng.choice(_OUTS)
    names = _names(rng, rng.randint(3, 4))
    x = names[0]
    contents = _distinct_words(rng, len(names), avoid=w)
    contents[0] = contents[0].rstrip("\n") + f" {w}\n"
    files = {f"{d}/{n}": c for n, c in zip(names, contents)}
    first = min(files)
    wrong = [[f"grep -l {w} {d}/*", f"cp {d}/{names[1]} {out}"], [f"cp {d}/{names[2]} {out}"]]
    if first != f"{d}/{x}":
        wrong.append([f"cp {first} {out}"])
    return ((d, w, out), f"One file in {d}/ contains {w}. Copy that file to {out}.", files,
            [f"grep -l {w} {d}/*", f"cp {d}/{x} {out}"],
            {"target": out, "want": _norm_lines(contents[0])}, wrong)


def _t_two_hops(rng):
    ptr, out = rng.choice(_PTRS), rng.choice(_OUTS)
    x, y, d1 = _names(rng, 3)
    cy, c1 = _distinct_words(rng, 2)
    files = {ptr: x + "\n", x: y + "\n", y: cy, d1: c1}
    return ((ptr, out), f"{ptr} names a file that names another file. Copy the last one to {out}.",
            files, [f"cat {ptr}", f"cat {x}", f"cp {y} {out}"],
            {"target": out, "want": _norm_lines(cy)},
            [[f"cat {ptr}", f"cp {x} {out}"], [f"cat {ptr}", f"cat {x}", f"cp {d1} {out}"]])


def _set_key_tail(rng, key, cfg, n):
    """The config file, and wrong sed commands (another number, another key)."""
    text, old = _cfg(rng, key)
    while old == n:
        text, old = _cfg(rng, key)
    other = next(k for k in (ln.split("=")[0] for ln in text.splitlines()) if k != key)
    m = _numbers(rng, 1, n)[0]
    return text, [f"sed -i 's/^{key}=.*/{key}={m}/' {cfg}",
                  f"sed -i 's/^{other}=.*/{other}={n}/' {cfg}"]


def _t_set_key(rng):
    ptr, key, cfg = rng.choice(_PTRS), rng.choice(_KEYS), rng.choice(_CFGS)
    x, d1 = _names(rng, 2)
    n, m = _numbers(rng, 2, -1)
    text, wrong_sed = _set_key_tail(rng, key, cfg, n)
    files = {ptr: x + "\n", x: f"{n}\n", d1: f"{m}\n", cfg: text}
    sed = f"sed -i 's/^{key}=.*/{key}={n}/' {cfg}"
    want = _norm_lines("".join(f"{key}={n}\n" if ln.startswith(key + "=") else ln + "\n"
                               for ln in text.splitlines()))
    return ((ptr, key, cfg), f"{ptr} names a file with a number. Set {key}= in {cfg} to that number.",
            files, [f"cat {ptr}", f"cat {x}", sed], {"target": cfg, "want": want},
            [[f"cat {ptr}", f"cat {d1}", f"sed -i 's/^{key}=.*/{key}={m}/' {cfg}"],
             [f"cat {ptr}", f"cat {x}", wrong_sed[1]], [f"cat {ptr}", f"cat {x}", wrong_sed[0]]])


def _t_find_named(rng):
    d, w, out = rng.choice(_DIRS), rng.choice(_WORDS), rng.choice(_OUTS)
    names = _names(rng, 3)
    y, d1 = _names(rng, 2)
    while y in names or d1 in names:
        y, d1 = _names(rng, 2)
    contents = _distinct_words(rng, 3, avoid=w)
    contents[0] = f"{w} {y}\n"
    cy, c1 = _distinct_words(rng, 2)
    files = {**{f"{d}/{n}": c for n, c in zip(names, contents)}, y: cy, d1: c1}
    return ((d, w, out),
            f"One file in {d}/ contains {w} and a file name. Copy the named file to {out}.", files,
            [f"grep -l {w} {d}/*", f"cat {d}/{names[0]}", f"cp {y} {out}"],
            {"target": out, "want": _norm_lines(cy)},
            [[f"grep -l {w} {d}/*", f"cp {d}/{names[0]} {out}"],
             [f"grep -l {w} {d}/*", f"cat {d}/{names[0]}", f"cp {d1} {out}"]])


def _t_three_hops(rng):
    ptr, out = rng.choice(_PTRS), rng.choice(_OUTS)
    x, y, z, d1 = _names(rng, 4)
    cz, c1 = _distinct_words(rng, 2)
    files = {ptr: x + "\n", x: y + "\n", y: z + "\n", z: cz, d1: c1}
    return ((ptr, out),
            f"{ptr} names a file, which names a file, which names a file. Copy the last one to {out}.",
            files, [f"cat {ptr}", f"cat {x}", f"cat {y}", f"cp {z} {out}"],
            {"target": out, "want": _norm_lines(cz)},
            [[f"cat {ptr}", f"cat {x}", f"cp {y} {out}"],
             [f"cat {ptr}", f"cat {x}", f"cat {y}", f"cp {d1} {out}"]])


def _t_find_set(rng):
    d, w, key, cfg = rng.choice(_DIRS), rng.choice(_WORDS), rng.choice(_KEYS), rng.choice(_CFGS)
    names = _names(rng, 3)
    y, d1 = _names(rng, 2)
    while y in names or d1 in names:
        y, d1 = _names(rng, 2)
    n, m = _numbers(rng, 2, -1)
    contents = _distinct_words(rng, 3, avoid=w)
    contents[0] = f"{w} {y}\n"
    text, wrong_sed = _set_key_tail(rng, key, cfg, n)
    files = {**{f"{d}/{nm}": c for nm, c in zip(names, contents)}, y: f"{n}\n", d1: f"{m}\n",
             cfg: text}
    sed = f"sed -i 's/^{key}=.*/{key}={n}/' {cfg}"
    want = _norm_lines("".join(f"{key}={n}\n" if ln.startswith(key + "=") else ln + "\n"
                               for ln in text.splitlines()))
    head = [f"grep -l {w} {d}/*", f"cat {d}/{names[0]}"]
    return ((d, w, key, cfg),
            f"One file in {d}/ contains {w} and a file name; that file has a number. "
            f"Set {key}= in {cfg} to it.", files, head + [f"cat {y}", sed],
            {"target": cfg, "want": want},
            [head + [f"cat {d1}", f"sed -i 's/^{key}=.*/{key}={m}/' {cfg}"],
             head + [f"cat {y}", wrong_sed[1]], head + [f"cat {y}", wrong_sed[0]]])


# Blind guessing. A task's answer is one of its files (its content, its line count, its number),
# so a rule that never reads the pointer still passes when it happens to pick that file: as first
# written (two or three random-named files per task), "copy the first random-named file" passed a
# third of copy_named, "copy the one file of words" half of two_hops, "set the number of the first
# number file" half of set_key. Each task therefore gets DECOYS more files of every kind it has
# (files of words; files holding one number) beside its random-named files and in its directory,
# none equal to the answer, none holding a find template's word or a file name, drawn from a
# second rng seeded by the task's own draw (so prompts, demonstrations and splits are unchanged:
# no demonstrated command lists a directory). tests/sandbox/test_multistep_tasks.py plays such
# rules: none passes more than 15% of any template's tasks.
DECOYS = 12
COUNT_LINES = range(7, 50)  # count_named: every decoy and the other file have 1-6 lines


def _with_decoys(files: dict[str, str], visible, name: str) -> dict[str, str]:
    """`files` plus DECOYS files of words beside the random-named files (top level) and in each
    directory, and DECOYS one-number files at the top level when the task has number files."""
    side = random.Random(task_hash(FAMILY, "decoys", name, files))
    word = next((v for v in visible if v in _WORDS), None)  # a find template's grep word
    taken, contents = set(files), set(files.values())
    number_files = [c for c in files.values() if re.fullmatch(r"\d+\n", c)]
    out = dict(files)

    def fresh_names(k, prefix=""):
        names = []
        while len(names) < k:
            n = prefix + _names(side, 1)[0]
            if n not in taken:
                taken.add(n)
                names.append(n)
        return names

    def add(paths, make):
        for p in paths:
            c = make()
            while c in contents:
                c = make()
            contents.add(c)
            out[p] = c

    dirs = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
    add(fresh_names(DECOYS), lambda: _words(side, word))
    for d in dirs:
        add(fresh_names(DECOYS, d + "/"), lambda: _words(side, word))
    if number_files:
        add(fresh_names(DECOYS), lambda: f"{side.randint(10, 99)}\n")
    return out


TEMPLATES: dict[int, list[Callable]] = {
    1: [_t_copy_named, _t_count_named, _t_find_word],
    2: [_t_two_hops, _t_set_key, _t_find_named],
    3: [_t_three_hops, _t_find_set],
}


def sample(rng: random.Random, difficulty: int) -> Task:
    """One task of `difficulty` (1: 2 commands, 2: 3, 3: 4) drawn with `rng`."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    tt = rng.choice(TEMPLATES[difficulty])
    visible, prompt, files, demo, params, wrong = tt(rng)
    name = tt.__name__[3:]
    files = _with_decoys(files, visible, name)
    turns, final = simulate(files, demo)
    key = (name, list(visible))
    split = split_of(FAMILY, key)
    task = Task(
        id=f"{FAMILY}/{split}/d{difficulty}/{task_hash(FAMILY, key, files)[:12]}", family="terminal",
        prompt=prompt, files=files, check=lines_check(params["target"], params["want"]),
        check_language="python", timeout_s=_TIMEOUT_S, memory_mb=_MEMORY_MB,
        meta={"split": split, "difficulty": difficulty, "domain": FAMILY, "template": name,
              "params": {**params, "wrong": wrong}, "demo_turns": turns,
              "max_turns": len(demo) + 2})
    if not passes(task, final):
        raise AssertionError(f"{name}: the demonstration does not solve its own task")
    return task


def make_split(split: str, n: int, seed: int, difficulty: int | None = None) -> list[Task]:
    """n distinct tasks of `split` (deterministic in its arguments); difficulty None cycles
    1, 2, 3 so the levels are balanced. The demonstration turns are in meta["demo_turns"]."""
    return [t for t, _ in draw_split(DOMAIN, split, n, seed, difficulty)]


def corrupt(rng: random.Random, task: Task) -> list[dict]:
    """Well-formed wrong demonstration turns for `task` (they fail its check, checked offline)."""
    options = list(task.meta["params"]["wrong"])
    rng.shuffle(options)
    for cmds in options:
        turns, final = simulate(task.files, cmds)
        if not passes(task, final):
            return turns
    raise AssertionError(f"task {task.id}: every corruption passes the check")


def describe(task: Task) -> dict[str, Any]:
    """Sizes of a task as the tiny model sees them (prompt, commands, observations; bytes)."""
    turns = task.meta["demo_turns"]
    return {"prompt_bytes": len(task.prompt.encode()), "commands": len(turns),
            "max_command_bytes": max(len(t["command"].encode()) for t in turns),
            "max_stdout_bytes": max(len(t["stdout"].encode()) for t in turns)}


class MultistepDomain(Domain):
    name = FAMILY
    multi_turn = True

    def sample(self, rng: random.Random, difficulty: int) -> tuple[Task, list[dict]]:
        task = sample(rng, difficulty)
        return task, task.meta["demo_turns"]

    def corrupt(self, rng: random.Random, task: Task, demo: list[dict]) -> list[dict]:
        return corrupt(rng, task)


DOMAIN = MultistepDomain()
