"""Loaders: this project's JSONL task files, HumanEval-format files and MBPP-format files.

    tasks = load_tasks("tasks.jsonl")            # any family; fields in sandbox/tasks/schema.py
    tasks = load_humaneval("HumanEval.jsonl.gz")  # task_id, prompt, canonical_solution, test, entry_point
    tasks = load_mbpp("mbpp.jsonl")               # task_id, text, code, test_list, test_setup_code
    save_tasks(tasks, "out.jsonl")
    write_jsonl(pairs, "pairs.jsonl"); pairs = read_jsonl("pairs.jsonl")   # (task, demo) pairs

`.gz` files are read transparently. Blank lines are skipped; a malformed line, or a task whose
scoring method is unknown or lacks a field it needs (sandbox.verifiers.check_task), raises
TaskFormatError naming the file and line.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from ..verifiers import check_task
from .schema import Task, TaskFormatError


def _open_text(path: str | os.PathLike) -> io.TextIOBase:
    p = os.fspath(path)
    if p.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return open(p, encoding="utf-8")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"{path}:{lineno}: invalid JSON: {e}") from e
            if not isinstance(obj, dict):
                raise TaskFormatError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Reads a JSONL file of tasks in this project's format (any family)."""
    tasks, seen = [], set()
    for lineno, obj in iter_jsonl(path):
        try:
            t = Task.from_dict(obj)
            check_task(t)
        except TaskFormatError as e:
            raise TaskFormatError(f"{path}:{lineno}: {e}") from e
        if t.id in seen:
            raise TaskFormatError(f"{path}:{lineno}: duplicate task id {t.id!r}")
        seen.add(t.id)
        tasks.append(t)
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | os.PathLike) -> None:
    p = os.fspath(path)
    opener = (lambda: io.TextIOWrapper(gzip.open(p, "wb"), encoding="utf-8")) if p.endswith(".gz") \
        else (lambda: open(p, "w", encoding="utf-8"))
    with opener() as f:
        for t in tasks:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")


def humaneval_task(obj: dict[str, Any], *, timeout_s: float = 10.0) -> Task:
    """One HumanEval record (task_id, prompt, canonical_solution, test, entry_point) as a Task."""
    missing = [k for k in ("task_id", "prompt", "test", "entry_point") if k not in obj]
    if missing:
        raise TaskFormatError(f"HumanEval record misses {missing}")
    meta = {k: v for k, v in obj.items()
            if k not in ("task_id", "prompt", "canonical_solution", "test", "entry_point")}
    meta["source"] = "humaneval"
    task = Task(id=str(obj["task_id"]), family="python_tests", prompt=obj["prompt"],
                test=obj["test"], entry_point=obj["entry_point"],
                canonical_solution=obj.get("canonical_solution", ""), timeout_s=timeout_s, meta=meta)
    check_task(task)
    return task


def load_humaneval(path: str | os.PathLike, *, timeout_s: float = 10.0) -> list[Task]:
    """Reads a HumanEval-format JSONL (or .jsonl.gz) file, e.g. HumanEval.jsonl.gz or HumanEval+."""
    out = []
    for lineno, obj in iter_jsonl(path):
        try:
            out.append(humaneval_task(obj, timeout_s=timeout_s))
        except TaskFormatError as e:
            raise TaskFormatError(f"{path}:{lineno}: {e}") from e
    return out


_DEF_RE = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.M)


def mbpp_task(obj: dict[str, Any], *, timeout_s: float = 10.0) -> Task:
    """One MBPP record (task_id, text, code, test_list[, test_setup_code]) as a Task.

    The asserts call the function by name, so they stay top-level asserts (one case each); the
    entry point is the function the asserts call (first `def` of the reference code as fallback).
    """
    if "test_list" not in obj:
        raise TaskFormatError("MBPP record misses test_list")
    tests = list(obj["test_list"]) + list(obj.get("challenge_test_list") or [])
    setup = obj.get("test_setup_code", "") or ""
    code = obj.get("code", "") or ""
    names = _DEF_RE.findall(code)
    called = re.findall(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(", tests[0]) if tests else []
    entry = called[0] if called else (names[0] if names else "")
    test = (setup + "\n" if setup else "") + "\n".join(tests) + "\n"
    prompt = obj.get("text") or obj.get("prompt") or ""
    if tests:
        prompt = f"{prompt}\nYour code should pass these tests:\n" + "\n".join(obj["test_list"])
    task = Task(id=f"mbpp/{obj.get('task_id')}", family="python_tests", prompt=prompt, test=test,
                entry_point=entry, canonical_solution=code, timeout_s=timeout_s,
                meta={"source": "mbpp", "prompt_is_text": True})
    check_task(task)
    return task


def load_mbpp(path: str | os.PathLike, *, timeout_s: float = 10.0) -> list[Task]:
    out = []
    for lineno, obj in iter_jsonl(path):
        try:
            out.append(mbpp_task(obj, timeout_s=timeout_s))
        except TaskFormatError as e:
            raise TaskFormatError(f"{path}:{lineno}: {e}") from e
    return out


def write_jsonl(items: Iterable[Task | tuple[Task, Any]], path: str | os.PathLike) -> None:
    """Tasks, or (task, demo) pairs (the demo is stored in meta["demo"]), via save_tasks."""
    tasks = []
    for it in items:
        if isinstance(it, Task):
            tasks.append(it)
        else:
            t, demo = it
            tasks.append(dataclasses.replace(t, meta={**t.meta, "demo": demo}))
    save_tasks(tasks, path)


def read_jsonl(path: str | os.PathLike) -> list[tuple[Task, Any]]:
    """(task, meta["demo"]) pairs from a file written by write_jsonl."""
    return [(t, t.meta.get("demo", "")) for t in load_tasks(path)]
