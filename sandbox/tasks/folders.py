"""Folder-per-task loader for tasks written for this sandbox (working directory /work, no Docker;
for Terminal-Bench 2 folders with their Dockerfile and tests/test.sh see terminal_bench.py):

    my-task/
      instruction.md          required: what the agent is told (the prompt; outer whitespace cut)
      task.toml               optional, sections (every key optional; any other key is an error):
                                [task]        name (the task id; default "folder/<dir name>")
                                [metadata]    anything (difficulty, category, tags, ...) -> meta
                                [agent]       max_turns, timeout_sec (total command time of the
                                              episode: the session's wall-time budget)
                                [verifier]    timeout_sec (the test script's limit; also setup's)
                                [environment] memory_mb (per command and the test), storage_mb
                                              (the session's disk), cpus (must be 1: the sandbox
                                              gives each command one CPU)
      environment/files/...   optional: UTF-8 text files placed in the working directory (/work)
      environment/setup.sh    optional: bash run in the session before the agent starts
      tests/test.sh | tests/test.py   exactly one: the check, run isolated on the final state of
                              the working directory; exit 0 = solved
      solution/solve.sh       optional: a reference solution, one command per line (blank lines
                              and comment lines skipped; a line ending in a backslash goes on)

    task = load_task_dir("sandbox/tasks/data/folder_tasks/sum-column")   # a terminal-family Task
    tasks = load_task_dirs("sandbox/tasks/data/folder_tasks")            # every sub-folder, sorted

The result is a terminal-family `Task` (sandbox/tasks/schema.py) that rl.envs.SessionEnv runs as
an episode and the terminal verifier can score one-shot; meta holds source "folder", path,
max_turns, agent_timeout_s, disk_mb, solution (list of commands) and the [metadata] table.

Refused with TaskFormatError saying what to change: a missing instruction.md or test script,
two test scripts, other files in tests/ (the check is one script: it runs where nothing the agent
wrote can reach it), an environment/Dockerfile (no Docker here: put files under
environment/files, commands in environment/setup.sh), files that are not UTF-8 text, links,
unknown task.toml sections or keys, values of the wrong type.
Not covered: Harbor's reward files (/logs/verifier/reward.txt: the exit code decides here),
per-task environment variables, multi-container tasks.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any

from ..verifiers import check_task
from .schema import Task, TaskFormatError

_SECTIONS = {
    "task": {"name": str},
    "metadata": None,  # free-form
    "agent": {"max_turns": int, "timeout_sec": (int, float)},
    "verifier": {"timeout_sec": (int, float)},
    "environment": {"memory_mb": int, "storage_mb": int, "cpus": (int, float)},
}
_TOP_KEYS = {"version", "schema_version"}


def read_file(path: str, what: str, binary: bool = False) -> str | bytes:
    """A task folder's file: refused (TaskFormatError naming it) when it is a symbolic link,
    unreadable or, unless binary, not UTF-8 text."""
    if os.path.islink(path):
        raise TaskFormatError(f"{what} {path} is a symbolic link: copy the file instead")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TaskFormatError(f"cannot read {what} {path}: {e.strerror}") from e
    if binary:
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskFormatError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from e


def read_instruction(root: str) -> str:
    """A task folder's instruction.md (required, not empty), outer whitespace cut."""
    if not os.path.isdir(root):
        raise TaskFormatError(f"{root} is not a directory")
    inst = os.path.join(root, "instruction.md")
    if not os.path.isfile(inst):
        raise TaskFormatError(f"{root}: no instruction.md (the agent's instruction is required)")
    prompt = read_file(inst, "instruction.md").strip()
    if not prompt:
        raise TaskFormatError(f"{inst} is empty")
    return prompt


def _config(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        cfg = tomllib.loads(read_file(path, "task.toml"))
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{path}: not valid TOML: {e}") from e
    for section, value in cfg.items():
        if section in _TOP_KEYS:
            continue
        if section not in _SECTIONS:
            raise TaskFormatError(f"{path}: unknown section [{section}] (known: {sorted(_SECTIONS)})")
        if not isinstance(value, dict):
            raise TaskFormatError(f"{path}: [{section}] must be a table")
        keys = _SECTIONS[section]
        if keys is None:
            continue
        for k, v in value.items():
            if k not in keys:
                raise TaskFormatError(f"{path}: unknown key {k!r} in [{section}] (known: {sorted(keys)})")
            if isinstance(v, bool) or not isinstance(v, keys[k]):
                raise TaskFormatError(f"{path}: [{section}] {k} has the wrong type: {v!r}")
    return cfg


def _files(root: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise TaskFormatError(f"{os.path.join(dirpath, d)} is a symbolic link")
        for name in filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = read_file(p, "environment file")
    return dict(sorted(out.items()))


def _solution(text: str) -> list[str]:
    cmds, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + "\n"
            continue
        cmds.append((cur + line).strip())
        cur = ""
    if cur.strip():
        cmds.append(cur.strip())
    return cmds


def _positive(path: str, what: str, v, integer: bool = False):
    if v is None:
        return None
    if not v > 0:
        raise TaskFormatError(f"{path}: {what} must be positive, got {v!r}")
    return int(v) if integer else float(v)


def load_task_dir(path: str | os.PathLike) -> Task:
    """One task folder (layout in the module docstring) as a terminal-family Task."""
    root = os.fspath(path)
    prompt = read_instruction(root)
    name = os.path.basename(os.path.normpath(root))
    toml_path = os.path.join(root, "task.toml")
    cfg = _config(toml_path)
    env_dir = os.path.join(root, "environment")
    if os.path.exists(os.path.join(env_dir, "Dockerfile")):
        raise TaskFormatError(f"{root}: environment/Dockerfile is not supported (no Docker in this "
                              "sandbox): put the files under environment/files/ and the commands "
                              "that prepare them in environment/setup.sh")
    if os.path.isdir(env_dir):
        extra = sorted(set(os.listdir(env_dir)) - {"files", "setup.sh"})
        if extra:
            raise TaskFormatError(f"{root}: environment/ may hold only files/ and setup.sh, found {extra}")
    files_dir = os.path.join(env_dir, "files")
    files = _files(files_dir) if os.path.isdir(files_dir) else {}
    setup_path = os.path.join(env_dir, "setup.sh")
    setup = read_file(setup_path, "setup.sh") if os.path.exists(setup_path) else ""
    tests_dir = os.path.join(root, "tests")
    present = sorted(os.listdir(tests_dir)) if os.path.isdir(tests_dir) else []
    scripts = [n for n in present if n in ("test.sh", "test.py")]
    if len(scripts) != 1:
        raise TaskFormatError(f"{root}: tests/ must hold exactly one test script, test.sh or "
                              f"test.py (found {scripts or 'none'})")
    others = [n for n in present if n not in scripts]
    if others:
        raise TaskFormatError(f"{root}: tests/ holds {others} besides {scripts[0]}: the check is one "
                              "script (it runs isolated; put what it needs inside it)")
    check = read_file(os.path.join(tests_dir, scripts[0]), "test script")
    sol_path = os.path.join(root, "solution", "solve.sh")
    solution = _solution(read_file(sol_path, "solve.sh")) if os.path.exists(sol_path) else []

    agent, verifier, envc = cfg.get("agent", {}), cfg.get("verifier", {}), cfg.get("environment", {})
    cpus = envc.get("cpus")
    if cpus is not None and cpus != 1:
        raise TaskFormatError(f"{toml_path}: [environment] cpus = {cpus!r}: this sandbox gives each "
                              "command one CPU (set cpus = 1 or leave it out)")
    meta: dict[str, Any] = {"source": "folder", "path": os.path.abspath(root),
                            "metadata": dict(cfg.get("metadata", {})), "solution": solution}
    for key, value in (("max_turns", _positive(toml_path, "[agent] max_turns", agent.get("max_turns"), True)),
                       ("agent_timeout_s", _positive(toml_path, "[agent] timeout_sec", agent.get("timeout_sec"))),
                       ("disk_mb", _positive(toml_path, "[environment] storage_mb", envc.get("storage_mb"), True))):
        if value is not None:
            meta[key] = value
    if "difficulty" in meta["metadata"]:
        meta["difficulty"] = meta["metadata"]["difficulty"]
    fields: dict[str, Any] = {}
    if verifier.get("timeout_sec") is not None:
        fields["timeout_s"] = _positive(toml_path, "[verifier] timeout_sec", verifier["timeout_sec"])
    if envc.get("memory_mb") is not None:
        fields["memory_mb"] = _positive(toml_path, "[environment] memory_mb", envc["memory_mb"], True)
    tid = cfg.get("task", {}).get("name") or f"folder/{name}"
    task = Task(id=tid, family="terminal", prompt=prompt, files=files, setup=setup, check=check,
                check_language="python" if scripts[0] == "test.py" else "bash", meta=meta, **fields)
    check_task(task)
    return task


def load_task_dirs(root: str | os.PathLike) -> list[Task]:
    """Every sub-folder of `root` holding an instruction.md, sorted by name (ids must differ)."""
    base = os.fspath(root)
    if not os.path.isdir(base):
        raise TaskFormatError(f"{base} is not a directory")
    tasks = [load_task_dir(os.path.join(base, d)) for d in sorted(os.listdir(base))
             if os.path.isfile(os.path.join(base, d, "instruction.md"))]
    if not tasks:
        raise TaskFormatError(f"{base}: no task folders (sub-folders with an instruction.md)")
    ids = [t.id for t in tasks]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise TaskFormatError(f"{base}: duplicate task ids {dup}")
    return tasks
