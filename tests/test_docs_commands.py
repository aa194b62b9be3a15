"""Every command shown in README.md, docs/results.md, docs/speed.md and in the docstrings of
configs/*.py and scripts/*.py runs as written: each is extracted (fenced shell blocks,
`\\`-continued lines, inline `--config.` override fragments) and run with `--dry_run` (sft,
train_rl, demo, evaluate: the config, its overrides, the algorithm, task domains and mesh are
validated without training; plan.py: the model config and mesh without planning), or as written
where it already only validates (--check_devices).
The commands run in forked children of one process that imported jax once (about 0.2 s each).

Not covered: docs/scaling.md's multi-host launch lines (they nest the command inside ssh/gcloud
quoting; scripts/multihost_check.py and tests/rl/test_multihost.py run the same path); commands
of scripts that take no --config (benchmarks, mutate.py), which their own tests run; plan.py's
planning itself (tests/model/test_sharding.py, test_remat.py and test_model.py run plan() and
per_device_plan on the same configs).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUN = {"scripts/sft.py", "scripts/train_rl.py", "scripts/demo.py", "scripts/evaluate.py",
           "scripts/plan.py", "scripts/export.py", "scripts/longctx.py"}
AS_WRITTEN: set[str] = set()
# where an override fragment ("--config.x=1 ..." or "... --config.x=1") is applied
# the markdown files whose commands run (docs/scaling.md: see "Not covered")
MARKDOWN = ("README.md", "docs/results.md", "docs/speed.md")
FRAGMENT_BASE = {"README.md": "python3 scripts/train_rl.py --config configs/rl.py:grpo_tiny",
                 "docs/results.md": "python3 scripts/train_rl.py --config configs/rl.py:grpo_tiny",
                 "docs/speed.md": "python3 scripts/train_rl.py --config configs/rl.py:grpo_tiny",
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
    for rel in MARKDOWN:
        with open(os.path.join(ROOT, rel)) as f:
            found += [(rel, c) for c in extract_commands(f.read(), rel)]
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


def _serve() -> None:
    """Runs the jobs given as JSON on stdin ([[env, argv], ...]) and prints their results as
    JSON ([[exit code, stderr tail], ...]). The heavy imports happen once here; each command
    runs in a forked child (runpy, as __main__, with its own argv, environment and absl flags),
    at most two at a time. No XLA backend exists before the fork, so a command's XLA_FLAGS
    (e.g. a fake device count) take effect in its child."""
    import json
    import runpy
    import tempfile

    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    os.chdir(ROOT)
    import _common  # noqa: F401  (XLA flags before jax)
    import jax  # noqa: F401
    from jax._src import xla_bridge

    import configs.models  # noqa: F401
    import configs.rl  # noqa: F401
    import train.launch  # noqa: F401
    assert not xla_bridge._backends, "a backend was initialised before forking"

    jobs = json.load(sys.stdin)
    results, running = [None] * len(jobs), {}

    def reap():
        pid, status = os.wait()
        i, err = running.pop(pid)
        err.seek(0)
        results[i] = [os.waitstatus_to_exitcode(status), err.read()[-2000:].decode(errors="replace")]
        err.close()

    for i, (env, argv) in enumerate(jobs):
        while len(running) >= 2:
            reap()
        err = tempfile.TemporaryFile()
        pid = os.fork()
        if pid == 0:  # the child: run the script as __main__, exit with its code
            code = 1
            try:
                os.environ.update(env)
                sys.argv = argv[1:]
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(err.fileno(), 2)
                runpy.run_path(argv[1], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        running[pid] = (i, err)
    while running:
        reap()
    print(json.dumps(results))


def test_every_documented_command_runs():
    import json

    jobs, seen = [], set()
    for source, cmd in all_commands():
        env, argv, script = _argv(cmd)
        if (key := (tuple(sorted(env.items())), tuple(argv[1:]))) in seen:
            continue  # the same command shown in several places
        seen.add(key)
        if script in DRY_RUN and not any(a.startswith("--check_devices") for a in argv):
            argv.append("--dry_run")
        elif script not in DRY_RUN | AS_WRITTEN:
            if any(a.startswith("--config") for a in argv):
                pytest.fail(f"{source}: `{cmd}` has a --config but {script} is neither "
                            "dry-runnable nor run as written here: add it to this test")
            continue
        if "XLA_FLAGS" in env:  # keep the suite's XLA flags too
            env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " " + env["XLA_FLAGS"]
        jobs.append((source, cmd, env, argv))
    assert len(jobs) >= 20
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, text=True,
                       input=json.dumps([[env, argv] for _, _, env, argv in jobs]),
                       capture_output=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    bad = [f"{s}: `{c}` exited {code}:\n{err}" for (s, c, _, _), (code, err) in zip(jobs, results)
           if code != 0]
    assert not bad, "\n\n".join(bad)


if __name__ == "__main__":
    _serve()
