"""Terminal (one shot): a shell command over files in the working directory whose result goes to
out.txt, e.g. "Write line 3 of log.txt to out.txt" -> "sed -n 3p log.txt > out.txt".

Scoring method `terminal` (sandbox/verifiers.py): the check, in a fresh sandbox, compares out.txt
with the expected lines after stripping trailing whitespace and trailing empty lines
(base.lines_check). Difficulty 1: wc -l, sed -n Np, head, tail; 2: sort (-n/-r), grep (-c),
cut; 3: pipelines (grep | cut, cut | sort -n, sort -u | wc -l, sort -n | head, awk sum).
Expected outputs are computed offline by a model of exactly these commands (_op_apply).

Canonical key (the split, sandbox/tasks/splits.py): the template, the file name and the visible
parameters, not the hidden file contents. Corruptions: the template's wrong pipelines (a wrong
flag, column or count), the first whose output differs on the task's file.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .base import MAX_COMPLETION_BYTES, WORDS, OneShotDomain, lines_check

_WORDS = WORDS
_TXT = ("a.txt", "b.txt", "c.txt", "x.txt", "y.txt", "in.txt", "log.txt", "data.txt", "list.txt",
        "notes.txt", "words.txt", "items.txt")
_CSV = ("a.csv", "b.csv", "f.csv", "t.csv", "data.csv", "pets.csv", "rows.csv", "zoo.csv")


def _op_render(op: tuple, first: bool, fname: str) -> str:
    name, *a = op
    cmd = {
        "wc-l": "wc -l", "wc-w": "wc -w", "wc-c": "wc -c", "sort": "sort", "sort-r": "sort -r",
        "sort-n": "sort -n", "sort-rn": "sort -rn", "sort-u": "sort -u",
    }.get(name)
    if cmd is None:
        cmd = {"wc-l-arg": lambda: "wc -l", "sed": lambda: f"sed -n {a[0]}p",
               "head": lambda: f"head -n {a[0]}", "tail": lambda: f"tail -n {a[0]}",
               "grep": lambda: f"grep {a[0]}", "grep-c": lambda: f"grep -c {a[0]}",
               "grep-v": lambda: f"grep -v {a[0]}", "cut": lambda: f"cut -d, -f{a[0]}",
               "sum": lambda: f"awk -F, '{{s+=${a[0]}}}END{{print s}}'"}[name]()
    if not first:
        return cmd
    return f"{cmd} < {fname}" if name in ("wc-l", "wc-w", "wc-c") else f"{cmd} {fname}"


def _op_apply(op: tuple, lines: list[str], fname: str) -> list[str]:
    name, *a = op
    if name == "wc-l":
        return [str(len(lines))]
    if name == "wc-l-arg":
        return [f"{len(lines)} {fname}"]
    if name == "wc-w":
        return [str(sum(len(ln.split()) for ln in lines))]
    if name == "wc-c":
        return [str(sum(len(ln.encode()) + 1 for ln in lines))]
    if name == "sed":
        return lines[a[0] - 1:a[0]]
    if name == "head":
        return lines[:a[0]]
    if name == "tail":
        return lines[-a[0]:]
    if name == "sort":
        return sorted(lines)
    if name == "sort-r":
        return sorted(lines, reverse=True)
    if name == "sort-n":
        return sorted(lines, key=lambda s: (int(s), s))
    if name == "sort-rn":
        return sorted(lines, key=lambda s: (int(s), s), reverse=True)
    if name == "sort-u":
        return sorted(set(lines))
    if name == "grep":
        return [ln for ln in lines if a[0] in ln]
    if name == "grep-v":
        return [ln for ln in lines if a[0] not in ln]
    if name == "grep-c":
        return [str(sum(a[0] in ln for ln in lines))]
    if name == "cut":
        return [ln.split(",")[a[0] - 1] if a[0] <= ln.count(",") + 1 else "" for ln in lines]
    if name == "sum":
        return [str(sum(int(ln.split(",")[a[0] - 1]) for ln in lines))] if lines else [""]
    raise ValueError(name)


def _pipeline(ops: list[tuple], fname: str) -> str:
    return " | ".join(_op_render(op, i == 0, fname) for i, op in enumerate(ops)) + " > out.txt"


def _run_pipeline(ops: list[tuple], content: str, fname: str) -> list[str]:
    lines = content.split("\n")[:-1]
    for op in ops:
        lines = _op_apply(op, lines, fname)
    lines = [ln.rstrip() for ln in lines]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


# Files whose answer is a count (wc -l, grep -c, sort -u | wc -l) have 4..40 lines, so that no
# constant answer is right on more than about a tenth of those tasks (4..9 lines, every other
# template's, let one constant pass a fifth of them; tests/sandbox/test_generators.py).
_COUNT_LINES = (4, 40)


def _words_file(rng: random.Random, must: str | None = None, dups: bool = False,
                n_lines: tuple[int, int] = (4, 9)) -> str:
    n = rng.randint(*n_lines)
    pool = [w for w in _WORDS if w != must]
    lines = [" ".join(rng.choice(pool) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    if must is not None:  # `must` appears in some but not all lines
        for i in rng.sample(range(n), rng.randint(1, n - 1)):
            ws = lines[i].split()
            ws[rng.randrange(len(ws))] = must
            lines[i] = " ".join(ws)
    if dups:
        lines[rng.randrange(n)] = lines[rng.randrange(n)]
    return "\n".join(lines) + "\n"


def _nums_file(rng: random.Random) -> str:
    vals = rng.sample(range(0, 150), rng.randint(4, 8))
    return "\n".join(map(str, vals)) + "\n"


def _csv_file(rng: random.Random, must: str | None = None) -> str:
    n = rng.randint(4, 7)
    pool = [w for w in _WORDS if w != must]
    names = [rng.choice(pool) for _ in range(n)]
    if must is not None:
        for i in rng.sample(range(n), rng.randint(1, n - 1)):
            names[i] = must
    rows = [f"{w},{rng.randint(0, 120)},{rng.randint(0, 120)}" for w in names]
    return "\n".join(rows) + "\n"


def _lines(k: int) -> str:
    return "line" if k == 1 else f"{k} lines"


# Each template draws (visible params, file name, content maker, prompt, ops, wrong op lists).
def _tt_count(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r, n_lines=_COUNT_LINES),
            f"Write the number of lines in {f} to out.txt",
            [("wc-l",)], [[("wc-w",)], [("wc-l-arg",)], [("wc-c",)]])


def _tt_line(rng):
    f, n = rng.choice(_TXT), rng.randint(1, 9)
    return ((n,), f, lambda r: _words_file(r), f"Write line {n} of {f} to out.txt",
            [("sed", n)], [[("sed", n + 1)], [("sed", n - 1)], [("head", n)]])


def _tt_head(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 4)
    return ((k,), f, lambda r: _words_file(r), f"Write the first {_lines(k)} of {f} to out.txt",
            [("head", k)], [[("head", k + 1)], [("tail", k)], [("head", k - 1)]])


def _tt_tail(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 4)
    return ((k,), f, lambda r: _words_file(r), f"Write the last {_lines(k)} of {f} to out.txt",
            [("tail", k)], [[("tail", k + 1)], [("head", k)], [("tail", k - 1)]])


def _tt_sort(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r), f"Write {f} sorted to out.txt",
            [("sort",)], [[("sort-r",)], [("sort-u",)], [("head", 8)]])


def _tt_sort_n(rng):
    f = rng.choice(_TXT)
    return ((), f, _nums_file, f"Write {f} sorted numerically to out.txt",
            [("sort-n",)], [[("sort",)], [("sort-rn",)]])


def _tt_sort_rn(rng):
    f = rng.choice(_TXT)
    return ((), f, _nums_file, f"Write {f} sorted numerically, largest first, to out.txt",
            [("sort-rn",)], [[("sort-n",)], [("sort-r",)]])


def _tt_grep_c(rng):
    f, w = rng.choice(_TXT), rng.choice(_WORDS)
    w2 = rng.choice([x for x in _WORDS if x != w])
    return ((w,), f, lambda r: _words_file(r, must=w, n_lines=_COUNT_LINES),
            f"Write how many lines of {f} contain {w} to out.txt",
            [("grep-c", w)], [[("grep-c", w2)], [("wc-l",)], [("grep", w)]])


def _tt_grep(rng):
    f, w = rng.choice(_TXT), rng.choice(_WORDS)
    w2 = rng.choice([x for x in _WORDS if x != w])
    return ((w,), f, lambda r: _words_file(r, must=w),
            f"Write the lines of {f} containing {w} to out.txt",
            [("grep", w)], [[("grep-v", w)], [("grep", w2)], [("grep-c", w)]])


def _tt_cut(rng):
    f, k = rng.choice(_CSV), rng.randint(1, 3)
    return ((k,), f, lambda r: _csv_file(r), f"Write column {k} of {f} to out.txt",
            [("cut", k)], [[("cut", k % 3 + 1)], [("cut", (k + 1) % 3 + 1)]])


def _tt_grep_cut(rng):
    f, k, w = rng.choice(_CSV), rng.randint(2, 3), rng.choice(_WORDS)
    return ((k, w), f, lambda r: _csv_file(r, must=w),
            f"Write column {k} of the {f} rows with {w} to out.txt",
            [("grep", w), ("cut", k)],
            [[("grep", w), ("cut", 5 - k)], [("cut", k)], [("grep-v", w), ("cut", k)]])


def _tt_cut_sort(rng):
    f, k = rng.choice(_CSV), rng.randint(2, 3)
    return ((k,), f, lambda r: _csv_file(r),
            f"Write column {k} of {f} sorted numerically to out.txt",
            [("cut", k), ("sort-n",)],
            [[("cut", k), ("sort",)], [("cut", 5 - k), ("sort-n",)], [("cut", k), ("sort-rn",)]])


def _tt_distinct(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r, dups=True, n_lines=_COUNT_LINES),
            f"Write the number of distinct lines in {f} to out.txt",
            [("sort-u",), ("wc-l",)], [[("wc-l",)], [("sort-u",), ("wc-w",)]])


def _tt_sum(rng):
    f, k = rng.choice(_CSV), rng.randint(2, 3)
    return ((k,), f, lambda r: _csv_file(r), f"Write the sum of column {k} of {f} to out.txt",
            [("sum", k)], [[("sum", 5 - k)], [("cut", k)]])


def _tt_smallest(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 3)
    return ((k,), f, _nums_file, f"Write the {k} smallest number{'s' if k > 1 else ''} of {f} to out.txt",
            [("sort-n",), ("head", k)],
            [[("sort",), ("head", k)], [("sort-n",), ("tail", k)], [("head", k)]])


_TERM_TEMPLATES: dict[int, list[Callable]] = {
    1: [_tt_count, _tt_line, _tt_head, _tt_tail],
    2: [_tt_sort, _tt_sort_n, _tt_sort_rn, _tt_grep_c, _tt_grep, _tt_cut],
    3: [_tt_grep_cut, _tt_cut_sort, _tt_distinct, _tt_sum, _tt_smallest],
}


class TerminalDomain(OneShotDomain):
    name = "terminal"

    def _draw(self, rng, difficulty):
        tt = rng.choice(_TERM_TEMPLATES[difficulty])
        visible, fname, make, prompt, ops, _wrong = tt(rng)
        content = make(rng)
        want = _run_pipeline(ops, content, fname)
        if not want or want == [""]:
            return None
        demo = _pipeline(ops, fname)
        name = tt.__name__[4:]
        key = (name, fname, list(visible))
        task = self._task(difficulty, name, key, content, prompt, demo,
                          {"ops": [list(o) for o in ops], "file": fname,
                           "wrong": [[list(o) for o in w] for w in _wrong]},
                          family="terminal", files={fname: content},
                          check=lines_check("out.txt", want), check_language="python")
        return task, demo

    def corrupt(self, rng, task, demo):
        p = task.meta["params"]
        fname = p["file"]
        content = task.files[fname]
        want = _run_pipeline([tuple(o) for o in p["ops"]], content, fname)
        wrong = [[tuple(o) for o in w] for w in p["wrong"]]
        rng.shuffle(wrong)
        for ops in wrong:
            if any(o[0] in ("sed", "head", "tail") and o[1] < 1 for o in ops):
                continue
            c = _pipeline(ops, fname)
            if _run_pipeline(ops, content, fname) != want and len(c.encode()) <= MAX_COMPLETION_BYTES:
                return c
        return f"wc -c < {fname} > out.txt" if want != _run_pipeline([("wc-c",)], content, fname) \
            else f"head -n 0 {fname} > out.txt"


DOMAIN = TerminalDomain()
