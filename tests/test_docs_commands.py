"""Every command shown in README.md and in the docstrings of configs/*.py and scripts/*.py runs as
written: each is extracted (fenced shell blocks, `\\`-continued lines, inline `--config.` override
fragments) and run with `--dry_run` for the run scripts (sft, train_rl, demo, evaluate: the config,
its overrides, the algorithm, task families and mesh are validated without training), as written
for scripts that only read and plan (plan.py) or already validate (--check_devices).

Not covered: docs/scaling.md's multi-host launch lines (they nest the command inside ssh/gcloud
quoting; scripts/multihost_check.py and tests/rl/test_multihost.py run the same path), and
commands of scripts that take no --config (benchmarks, mutate.py), which their own tests run, and
plan.py's --compiled_memory line (minutes of compiles; tests/model/test_remat.py covers it).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUN = {"scripts/sft.py", "scripts/train_rl.py", "scripts/demo.py", "scripts/evaluate.py"}
AS_WRITTEN = {"scripts/plan.py"}
TODO_SKIP = {"scripts/longctx.py", "scripts/export.py"}
# where an override fragment ("--config.x=1 ..." or "... --config.x=1") is applied
FRAGMENT_BASE = {"README.md": "python3 scripts/train_rl.py --config configs/rl.py:grpo_tiny",
                 "configs/rl.py": "python3 scripts/train_rl.py --config configs/rl.py:grpo_tiny",
                 "configs/models.py": "python3 scripts/plan.py --config configs/models.py:tiny"}
_START = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?|\.venv/bin/python)\s+scripts/\S+\.py")


def _logical_lines(text: str) -> list[str]:
    """Lines with `\\` continuations joined and trailing `# comments` removed."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if cur:
            line = cur + " " + line
        if line.endswith("\\"):
            cur = line[:-1].rstrip()
            continue
        cur = ""
        out.append(re.sub(r"\s+#.*$", "", line).strip())
    return out


def extract_commands(text: str, source: str) -> list[str]:
    """Commands (as shell strings) in `text`: lines that start a `python scripts/X.py` call
    (after optional ENV=value prefixes, `bash scripts/setup.sh && ` or `...`), and override
    fragments made of `--config.` flags, completed with FRAGMENT_BASE[source]."""
    cmds = []
    spans = re.findall(r"`([^`\n]+)`", text)
    for line in _logical_lines(text) + [s.strip() for s in spans]:
        line = re.sub(r"^bash scripts/setup\.sh\s*&&\s*", "", line)
        if _START.match(line):
            cmds.append(line)
        elif re.match(r"^(\.\.\.\s+)?--config\.", line) and source in FRAGMENT_BASE:
            if all(t.startswith("--config.") for t in line.lstrip(". ").split()):
                cmds.append(FRAGMENT_BASE[source] + " " + line.lstrip(". "))
    return list(dict.fromkeys(cmds))


def _docstring(path: str) -> str:
    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def all_commands() -> list[tuple[str, str]]:
    found = []
    with open(os.path.join(ROOT, "README.md")) as f:
        found += [("README.md", c) for c in extract_commands(f.read(), "README.md")]
    for folder in ("configs", "scripts"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                rel = f"{folder}/{name}"
                doc = _docstring(os.path.join(ROOT, rel))
                found += [(rel, c) for c in extract_commands(doc, rel)]
    return found


def _argv(cmd: str) -> tuple[dict, list[str], str]:
    """(environment additions, argv, script) for a shell command string."""
    tokens = shlex.split(cmd)
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    script = tokens[1]
    return env, [sys.executable, *tokens[1:]], script


def test_extraction_finds_the_documented_commands():
    cmds = [c for _, c in all_commands()]
    # the README's main job and an inline override fragment, a docstring's continued line
    assert "python scripts/demo.py --config configs/rl.py:smoke" in cmds
    assert any("--config.rl.algo.clip_high=0.28" in c and "train_rl.py" in c for c in cmds)
    assert any(c.startswith("XLA_FLAGS=--xla_force_host_platform_device_count=8 python")
               and "smoke_8dev" in c for c in cmds)
    assert len(cmds) >= 20
    text = "a\n    python scripts/x.py --a \\\n        --b  # note\n`--config.y=2`\n"
    assert extract_commands(text, "README.md") == [
        "python scripts/x.py --a --b", FRAGMENT_BASE["README.md"] + " --config.y=2"]


def test_every_documented_command_runs():
    jobs, seen = [], set()
    for source, cmd in all_commands():
        env, argv, script = _argv(cmd)
        if "--compiled_memory" in argv:  # compiles the gradient per remat policy (minutes);
            continue                     # tests/model/test_remat.py runs compiled_train_memory
        if (key := (tuple(sorted(env.items())), tuple(argv[1:]))) in seen:
            continue  # the same command shown in several places
        seen.add(key)
        if script in DRY_RUN and not any(a.startswith("--check_devices") for a in argv):
            argv.append("--dry_run")
        elif script in TODO_SKIP:
            continue
        elif script not in DRY_RUN | AS_WRITTEN:
            if any(a.startswith("--config") for a in argv):
                pytest.fail(f"{source}: `{cmd}` has a --config but {script} is neither "
                            "dry-runnable nor run as written here: add it to this test")
            continue
        jobs.append((source, cmd, env, argv))
    assert len(jobs) >= 20

    def run(job):
        source, cmd, env, argv = job
        p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=300)
        return source, cmd, p

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(run, jobs))
    bad = [f"{s}: `{c}` exited {p.returncode}:\n{p.stderr[-1500:]}" for s, c, p in results
           if p.returncode != 0]
    assert not bad, "\n\n".join(bad)
