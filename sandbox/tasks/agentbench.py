"""AgentBench's operating-system tasks, read from the installed `inspect-evals` package, as
multi-turn terminal tasks played in sandbox sessions without Docker.

    from sandbox.tasks.agentbench import load_agentbench_os
    found = load_agentbench_os("all")        # "dev" (26 tasks), "test" (119) or "all"
    found.tasks                              # [Task]: the runnable ones
    found.skipped                            # [(task id, reason)]: what cannot run here, and why
    print(found.summary())                   # counts, and the skip reasons grouped

    python -m sandbox.tasks.agentbench       # prints that summary (`--list` also every skip)

The package (`pip install --no-deps inspect-evals==0.28.0`; scripts/setup.sh does it) is only
read: its JSON task files and check scripts are located with importlib and never imported, so
inspect_ai and Docker are not needed. Its tasks use /home/agent as home and working directory
(it rewrites AgentBench's /root and /usr to it), and so does this loader.

What a record becomes (a terminal-family `Task`, played by rl.envs.SessionEnv):
  - the session's workspace (`meta["workspace"]`, sandbox.session.Workspace): working directory
    and HOME /home/agent, /home, /root, /tmp and /var (with a small /var/log) persistent for the
    episode, commands run as uid 0
    inside the user namespace (the container's root; the host sees the session's uid),
    /home/agent/local/bin and /home/agent/bin first on PATH (where the rewritten /usr paths
    point);
  - `setup`: the record's init (a command, a script, or the steps of a list), run before the
    first turn; `meta["start"]`: its start command (and an init marked init_at_start), run with
    `Session.start` so the processes it leaves in the background live for the whole episode;
  - answer tasks (an expected `match`, or a comparison script whose expected value an `example`
    command computes): the model's last turn (a turn without a tool call) is its answer
    (rl.envs.final_answer: `answer(...)` of AgentBench's protocol is unwrapped); `Task.answer` holds a match,
    `meta["reference"]` the example, run right after setup, before the model acts (so a policy
    cannot change the state the expected value is computed from: deleting every file and
    answering 0 scores 0); the check is the package's comparison script (integer-match,
    size-match, string-match), or an exact match after stripping whitespace, run isolated with
    [answer, expected] on stdin. Where a record has both a match and an example, the example's
    value in this sandbox wins (the dev set's matches were measured in the package's Docker
    image: CPU count, users, sizes differ here);
  - state tasks (a check command or check script): the check runs isolated over the final state
    (exit 0 = solved), as the other terminal checks do. The package's check scripts run with
    the system's directories first on PATH and python3 pinned to /usr/bin/python3 (a python3
    or wc the model leaves in its home cannot answer for the check), and the calc checks, which
    paste calc's output into a python expression, accept only a number from it (a "calc" that
    prints `0)or(True` computes nothing and would otherwise pass);
  - paths: the package rewrites /root and /usr to /home/agent in its records; the same rewrite
    is applied to its scripts here (an example installs `calc` into /home/agent/local/bin,
    which exists in every task, the image's /usr/local/bin);
  - `meta["solution"]`: the record's example as commands (a check script's example file, or the
    example command; for answer tasks the answer is its output), used by the tests;
    `meta["labels"]` the record's labels, `meta["template"]` them joined by "/" (the breakdown
    of evaluations: scripts/evaluate.py --by_template); meta["agent"] marks an episode task.

Skipped, each with its reason (`skipped`): init scripts kept in AgentBench's own repository
(`init/*.sh`; the package does not ship them), tasks that need other Linux users or groups
(useradd, runuser, chown/chgrp to them: a session maps a single uid), packages installed with
apt (no network), questions about processes the task starts in the background (each command
runs in its own pid namespace, so `ps` cannot show them), and two records whose verdict here
would not be about the model's work (`UNSTABLE`: a check that never finishes on this machine's
/lib, an answer that varies from run to run).
Not covered: AgentBench's multi-container and network tasks (not in the package).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import uuid
from typing import Any

from ..verifiers import check_task
from .schema import Task, TaskFormatError

PACKAGE = "inspect_evals"
DOMAIN = "agentbench-os"  # meta["domain"]: the domain evaluations report
SPLITS = {"dev": "agent_bench_os.json", "test": "agent_bench_os_test.json"}
HOME = "/home/agent"
WORKSPACE = {"cwd": HOME, "dirs": ["/home", "/root", "/tmp", "/var"], "as_root": True,
             "path": [f"{HOME}/local/bin", f"{HOME}/bin"]}
INSTRUCTIONS = ("\n\nUse the bash tool to act on this machine. When you are done, reply without a "
                "tool call; if the task asks a question, that reply is the answer alone.")
# a Debian image's /var/log in small (tasks list and measure it)
VAR_LOG = ("mkdir -p /var/log/apt && printf 'Start-Date: 2026-01-05  10:00:00\\nInstall: jq\\n' "
           "> /var/log/apt/history.log && printf 'status installed jq\\n' > /var/log/dpkg.log "
           "&& : > /var/log/lastlog")
# an exact answer after stripping whitespace (records with a match and no comparison script)
EXACT = "import sys\nsys.exit(0 if sys.argv[1].strip() == sys.argv[2].strip() else 1)\n"
# the check of answer tasks: [answer, expected] arrive on stdin as JSON and become the argv the
# package's comparison scripts read
ARGV_FROM_STDIN = "import json, sys\nsys.argv = ['compare'] + json.loads(sys.stdin.read())\n"

# Prepended to the package's check scripts: the commands a task asks for are found after the
# system's (a python3 or wc the model leaves in its home never shadows the check's), and the
# calc checks (check/0.sh, checking/0.sh), which paste calc's output into a python expression
# (`0)or(True` from a "calc" that computes nothing would read as True), get only a plain number.
CHECK_PRELUDE = f"""export PATH="/usr/bin:/bin:{HOME}/local/bin:{HOME}/bin"
python3() {{ /usr/bin/python3 "$@"; }}
"""
CALC_GUARD = r"""calc() {
    local out
    out=$(command calc "$@") || return 1
    [[ $out =~ ^[[:space:]]*[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?[[:space:]]*$ ]] \
        || { echo "calc printed a non-number" >&2; return 1; }
    echo "$out"
}
"""

_OTHER_USERS = re.compile(r"\b(useradd|adduser|groupadd|usermod|runuser|su\s+-|sudo)\b")
_APT = re.compile(r"\bapt(-get)?\s+(update|install)\b")


class PackageMissing(RuntimeError):
    """inspect-evals is not installed."""


@dataclasses.dataclass
class Loaded:
    tasks: list[Task]
    skipped: list[tuple[str, str]]

    def summary(self) -> str:
        n = len(self.tasks) + len(self.skipped)
        lines = [f"AgentBench OS: {len(self.tasks)} of {n} tasks runnable, {len(self.skipped)} "
                 "skipped"]
        by_reason = collections.Counter(reason for _, reason in self.skipped)
        for reason, count in by_reason.most_common():
            lines.append(f"  {count:>3} skipped: {reason}")
        return "\n".join(lines)


def package_dir() -> str:
    """The installed inspect_evals/agent_bench directory (located, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing("the inspect-evals package is not installed: pip install --no-deps "
                             "inspect-evals==0.28.0 (scripts/setup.sh installs it)")
    d = os.path.join(list(spec.submodule_search_locations)[0], "agent_bench")
    if not os.path.isdir(os.path.join(d, "data")):
        raise PackageMissing(f"{d}/data is missing: this inspect-evals version does not ship "
                             "AgentBench's OS tasks (0.28.0 does)")
    return d


def to_home(text: str) -> str:
    """The package's path convention for its records, applied to its scripts too: /root and
    /usr become the agent's home (/usr/local/bin -> /home/agent/local/bin)."""
    return text.replace("/root", HOME).replace("/usr", HOME)


def _script(rel: str) -> str:
    path = os.path.join(package_dir(), "data", "scripts", rel)
    if not os.path.isfile(path):
        raise TaskFormatError(f"check or example script {rel} is not in the package ({path})")
    with open(path, encoding="utf-8") as f:
        return to_home(f.read())


def _code(step: Any) -> str | None:
    """A command or script from an init / example / check entry, or None for a file reference."""
    if isinstance(step, str):
        return step
    if isinstance(step, dict) and "code" in step:
        return step["code"]
    return None


def _init(record: dict, tid: str) -> tuple[str, str, str | None]:
    """(setup, start, skip reason) from the record's create/start fields."""
    create = record.get("create") if isinstance(record.get("create"), dict) else {}
    init = create.get("init")
    steps = init if isinstance(init, list) else ([init] if init is not None else [])
    setup: list[str] = []
    if "bin/find" in json.dumps(record):  # the SUID task: the image copies find into ~/bin
        setup.append(f"mkdir -p {HOME}/bin && cp /usr/bin/find {HOME}/bin/find")
    setup.append(f"mkdir -p {HOME}/local/bin")  # the image's /usr/local/bin, moved home
    setup.append(VAR_LOG)
    for step in steps:
        if isinstance(step, dict) and "file" in step:
            return "", "", (f"its init script {step['file']} is in AgentBench's repository, which "
                            "the package does not ship")
        if isinstance(step, dict) and "user" in step:
            return "", "", "runs as another Linux user (a session maps a single uid)"
        code = _code(step)
        if code is None:
            raise TaskFormatError(f"{tid}: unknown init step {step!r:.80}")
        # a different random string per task, fixed across loads (the image draws one per build)
        rnd = str(uuid.UUID(hashlib.sha256(tid.encode()).hexdigest()[:32]))
        setup.append(code.replace("<random-string>", rnd))
    start = record.get("start") or ""
    if create.get("init_at_start"):  # runs when the container starts: its processes live on
        start, setup = "\n".join(setup) + ("\n" + start if start else ""), []
    return "\n".join(setup), start, None


# records that load but whose verdict would not be about the model's work here (measured)
UNSTABLE = {
    ("test", 19): ("its check counts every file under /lib with a recursive bash function; here "
                   "/lib is the host's /usr/lib, whose links to directories make the recursion "
                   "run out of processes (never a verdict)"),
    ("test", 38): ("its answer counts processes named bash, the pipeline's own forks included: "
                   "2 or 3 from one run to the next"),
}


def _skip_reason(record: dict, split: str) -> str | None:
    if (split, record.get("id")) in UNSTABLE:
        return UNSTABLE[(split, record.get("id"))]
    text = json.dumps(record)
    if _APT.search(text):
        return "installs packages with apt (the sandbox has no network)"
    if _OTHER_USERS.search(text):
        return ("needs other Linux users or groups (useradd, runuser, su, sudo): a session maps "
                "a single uid")
    create = record.get("create") if isinstance(record.get("create"), dict) else {}
    background = "&" in json.dumps(create.get("init", "")) or "&" in record.get("start", "")
    if background and "process" in record.get("description", "").lower():
        return ("asks about processes the task starts in the background: each command runs in "
                "its own pid namespace, so they are not visible to it")
    return None


def record_to_task(record: dict, split: str) -> Task | str:
    """One package record as a Task, or the reason it cannot run here."""
    tid = f"agentbench-os/{split}/{record['id']}"
    record = json.loads(to_home(json.dumps(record)))
    ev = record.get("evaluation")
    if not isinstance(ev, dict):
        raise TaskFormatError(f"{tid}: no evaluation")
    reason = _skip_reason(record, split)
    setup, start, init_reason = _init(record, tid)
    reason = reason or init_reason
    if reason:
        return reason
    check = ev.get("check")
    example = ev.get("example")
    example_code = _code(example)
    if isinstance(example, dict) and "file" in example:
        example_code = _script(example["file"])
    labels = [str(x) for x in record.get("labels") or []]
    meta: dict[str, Any] = {"source": "agentbench-os", "split": split, "record_id": record["id"],
                            "agent": True, "domain": DOMAIN, "labels": labels,
                            "template": "/".join(labels) or "unlabelled",
                            "workspace": dict(WORKSPACE), "max_task_runs": 5}
    if start:
        meta["start"] = start
    answer = ""
    if check is None or (isinstance(check, list) and check and check[0] is None):
        # an answer task: compared with a match or with the example's output
        compare = EXACT
        if isinstance(check, list):
            item = check[1] if len(check) > 1 else None
            if not (isinstance(item, dict) and item.get("language") == "python" and "file" in item):
                raise TaskFormatError(f"{tid}: unknown comparison {check!r:.80}")
            compare = _script(item["file"])
        if example_code:
            meta["reference"] = example_code
        elif "match" in ev:
            answer = str(ev["match"])
        else:
            raise TaskFormatError(f"{tid}: an answer task with neither a match nor an example")
        code, language = ARGV_FROM_STDIN + compare, "python"
        meta["answer_task"] = True
        if example_code:
            meta["solution"] = [example_code]
        elif answer:
            meta["solution_answer"] = answer
    else:
        if isinstance(check, dict) and "file" in check:
            code = CHECK_PRELUDE + _script(check["file"])
            if re.search(r"\$\(calc ", code):
                code = CALC_GUARD + code
        elif isinstance(check, dict) and "code" in check:
            code = check["code"]
        elif isinstance(check, list) and len(check) == 1 and isinstance(check[0], str):
            code = check[0]
        else:
            raise TaskFormatError(f"{tid}: unknown check {check!r:.80}")
        language = "bash"
        if example_code:
            meta["solution"] = [example_code]
    task = Task(id=tid, family="terminal", prompt=record["description"].strip() + INSTRUCTIONS,
                setup=setup, check=code, check_language=language, answer=answer, timeout_s=30.0,
                memory_mb=512, meta=meta)
    check_task(task)
    return task


def load_agentbench_os(split: str = "all") -> Loaded:
    """The package's tasks of `split` ("dev", "test" or "all"): runnable Tasks and skip reasons."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be one of {[*SPLITS, 'all']}, got {split!r}")
    tasks, skipped = [], []
    for name in (SPLITS if split == "all" else [split]):
        path = os.path.join(package_dir(), "data", SPLITS[name])
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
        if not isinstance(records, list):
            raise TaskFormatError(f"{path}: expected a JSON list of task records")
        for rec in records:
            out = record_to_task(rec, name)
            if isinstance(out, str):
                skipped.append((f"agentbench-os/{name}/{rec.get('id')}", out))
            else:
                tasks.append(out)
    return Loaded(tasks, skipped)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Counts AgentBench OS tasks runnable here, with the "
                                "reasons for the rest.")
    p.add_argument("--split", default="all", choices=[*SPLITS, "all"])
    p.add_argument("--list", action="store_true", help="also list every skipped task")
    a = p.parse_args(argv)
    found = load_agentbench_os(a.split)
    print(found.summary())
    if a.list:
        for tid, reason in found.skipped:
            print(f"{tid}: {reason}")


if __name__ == "__main__":
    main()
