"""Terminal-Bench 2 task folders (the Harbor layout) played in sandbox sessions without Docker.

    from sandbox.tasks.terminal_bench import load_tb2_task, load_tb2_dir
    task = load_tb2_task("sandbox/tasks/data/terminal_bench2/count-errors")   # a Task
    found = load_tb2_dir("sandbox/tasks/data/terminal_bench2")     # every sub-folder
    found.tasks, found.skipped                                     # runnable Tasks, (path, reason)

    python -m sandbox.tasks.terminal_bench sandbox/tasks/data/terminal_bench2   # the summary

A folder:

    my-task/
      instruction.md            the agent's instruction (required)
      task.toml                 required: version; [metadata] (free-form: difficulty, category,
                                tags, ...); [agent] timeout_sec; [verifier] timeout_sec;
                                [environment] build_timeout_sec, docker_image, cpus, memory_mb,
                                storage_mb, memory / storage ("2G", "512M"), gpus, allow_internet
      environment/Dockerfile    how the container is built (the rest of environment/ is its
                                build context)
      tests/test.sh             the verifier, run as root in the final state with the other
                                files of tests/ at /tests; it writes /logs/verifier/reward.txt
                                (a number, 1 = solved) or, when it writes none, its exit code
                                decides (0 = solved)
      solution/solve.sh         the reference solution (optional)

Without Docker the Dockerfile is replayed, not built: FROM is recorded (the commands run on this
machine's Debian userland, not on the base image), WORKDIR becomes the working directory (and
`cd`s between RUN steps), COPY/ADD of build-context files write them at their destination, and
RUN steps run in order as the task's setup. The session is a sandbox.session.Workspace: the
working directory's top directory, every COPY destination's, /root, /tmp, /logs and /tests are
persistent for the episode, and commands run as root inside the user namespace.

Not runnable here (the reason is returned, never silently dropped): a Dockerfile step that
needs the network (apt-get/apt/pip/uv/npm/curl/wget/git clone/ADD of a URL), a task that only
names a prebuilt `docker_image`, `allow_internet = true`, a docker-compose.yaml (several
containers), ENV (other than a few locale/frontend variables), USER other than root,
CMD/ENTRYPOINT (a service started with the container), COPY into a system directory, a
tests/test.sh that fetches with the network (Terminal-Bench's own tests install uv and pytest
with curl), GPUs. Malformed folders raise TaskFormatError naming the file.

The check: /tests is emptied and refilled with the task's tests/ files, /logs/verifier is
recreated empty, then tests/test.sh runs isolated (bash --norc, fixed PATH; the rules of every
terminal check). So nothing the agent left in /tests or a reward.txt it wrote beforehand counts.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import os
import re
import shlex
import tomllib
from typing import Any

from ..verifiers import check_task
from .folders import read_file, read_instruction
from .schema import Task, TaskFormatError

SYSTEM = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc",
          "/dev", "/sys", "/run", "/sandbox", "/var", "/boot")
_ENV_OK = {"DEBIAN_FRONTEND", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "LANG", "LC_ALL",
           "TZ", "PIP_NO_CACHE_DIR"}
_NETWORK = re.compile(r"\b(apt-get|apt|apk|yum|dnf)\s+(-\S+\s+)*(update|install|upgrade)\b|"
                      r"\bpip3?\s+install\b|\buvx?\b|\bnpm\s+(install|ci|i)\b|\bcurl\b|\bwget\b|"
                      r"\bgit\s+clone\b|\bcargo\s+install\b|\bgo\s+install\b|\bconda\s+install\b")
_SECTIONS = {
    "metadata": None,  # free-form
    "agent": {"timeout_sec": (int, float)},
    "verifier": {"timeout_sec": (int, float)},
    "environment": {"build_timeout_sec": (int, float), "docker_image": str, "cpus": (int, float),
                    "memory_mb": int, "storage_mb": int, "memory": str, "storage": str,
                    "gpus": int, "allow_internet": bool},
}
MAX_CONTEXT_BYTES = 16 << 20  # COPY'd files are written by the setup script


class NotRunnable(Exception):
    """The folder is well-formed, but the task cannot run in this sandbox (the reason says why)."""


@dataclasses.dataclass
class Loaded:
    tasks: list[Task]
    skipped: list[tuple[str, str]]

    def summary(self) -> str:
        lines = [f"Terminal-Bench 2 folders: {len(self.tasks)} runnable, {len(self.skipped)} not "
                 "runnable here"]
        lines += [f"  {os.path.basename(p)}: {why}" for p, why in self.skipped]
        return "\n".join(lines)


def _config(path: str) -> dict:
    if not os.path.isfile(path):
        raise TaskFormatError(f"{path} is missing (every Terminal-Bench 2 task has a task.toml)")
    try:
        cfg = tomllib.loads(read_file(path, "task.toml"))
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{path}: not valid TOML: {e}") from e
    for section, value in cfg.items():
        if section in ("version", "schema_version"):
            continue
        if section not in _SECTIONS:
            raise TaskFormatError(f"{path}: unknown section [{section}] (known: {sorted(_SECTIONS)})")
        if not isinstance(value, dict):
            raise TaskFormatError(f"{path}: [{section}] must be a table")
        keys = _SECTIONS[section]
        for k, v in ({} if keys is None else value).items():
            if k not in keys:
                raise TaskFormatError(f"{path}: unknown key {k!r} in [{section}] (known: {sorted(keys)})")
            if (isinstance(v, bool) and keys[k] is not bool) or not isinstance(v, keys[k]):
                raise TaskFormatError(f"{path}: [{section}] {k} has the wrong type: {v!r}")
    return cfg


def _size_mb(path: str, key: str, text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, flags=re.I)
    if not m:
        raise TaskFormatError(f"{path}: [environment] {key} = {text!r} is not a size like \"2G\"")
    scale = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[m.group(2).upper()]
    return max(1, int(float(m.group(1)) * scale))


def _dockerfile_lines(text: str, path: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, cur, start = [], "", 0
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if not cur:
            start = n
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        parts = cur.split(None, 1)
        out.append((start, parts[0].upper(), parts[1] if len(parts) > 1 else ""))
        cur = ""
    if cur:
        raise TaskFormatError(f"{path}: line {start} ends with a continuation and no command")
    return out


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def _top(path: str) -> str:
    return "/" + path.strip("/").split("/")[0]


def _write_file(dst: str, data: bytes, mode: int) -> str:
    b64 = base64.b64encode(data).decode()
    q = shlex.quote(dst)
    return (f"mkdir -p {shlex.quote(os.path.dirname(dst) or '/')} && base64 -d > {q} <<'B64_END'\n"
            f"{b64}\nB64_END\nchmod {mode & 0o777:o} {q}")


def _replay(root: str) -> tuple[str, str, set[str], str]:
    """(setup script, working directory, persistent top directories, FROM) from the Dockerfile."""
    env_dir = os.path.join(root, "environment")
    path = os.path.join(env_dir, "Dockerfile")
    if not os.path.isfile(path):
        raise NotRunnable("no environment/Dockerfile: the environment is only a prebuilt image")
    if any(os.path.exists(os.path.join(env_dir, n)) for n in
           ("docker-compose.yaml", "docker-compose.yml", "compose.yaml")):
        raise NotRunnable("environment/docker-compose.yaml: several containers")
    steps, cwd, tops, base, total = [], "/", set(), "", 0
    for n, ins, args in _dockerfile_lines(read_file(path, "Dockerfile"), path):
        where = f"environment/Dockerfile line {n}"
        if ins == "FROM":
            base = args.split()[0] if args else ""
        elif ins == "WORKDIR":
            cwd = os.path.normpath(os.path.join(cwd, args.strip().strip('"')))
            if any(_under(cwd, s) for s in SYSTEM if s != "/") or cwd == "/":
                raise NotRunnable(f"{where}: WORKDIR {cwd} is a system directory")
            tops.add(_top(cwd))
            steps.append(f"mkdir -p {shlex.quote(cwd)} && cd {shlex.quote(cwd)}")
        elif ins in ("COPY", "ADD"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if args.lstrip().startswith("<<"):
                raise NotRunnable(f"{where}: {ins} from a heredoc is not replayed")
            if len(words) < 2:
                raise TaskFormatError(f"{path}: line {n}: {ins} needs a source and a destination")
            *srcs, dst = words
            if any(re.match(r"[a-z]+://", s) for s in srcs):
                raise NotRunnable(f"{where}: {ins} of a URL needs the network")
            dst_abs = os.path.normpath(os.path.join(cwd, dst))
            if any(_under(dst_abs, s) for s in SYSTEM if s != "/") or dst_abs == "/":
                raise NotRunnable(f"{where}: {ins} into the system directory {dst_abs}")
            tops.add(_top(dst_abs))
            for src in srcs:
                s_abs = os.path.normpath(os.path.join(env_dir, src))
                if not _under(s_abs, env_dir) or not os.path.exists(s_abs):
                    raise TaskFormatError(f"{path}: line {n}: {src} is not in environment/")
                if os.path.isdir(s_abs):  # its contents go into the destination
                    pairs = [(os.path.join(dp, f), os.path.join(dst_abs, os.path.relpath(
                        os.path.join(dp, f), s_abs))) for dp, _dn, fns in sorted(os.walk(s_abs))
                        for f in sorted(fns)]
                elif dst.endswith("/") or len(srcs) > 1:
                    pairs = [(s_abs, os.path.join(dst_abs, os.path.basename(s_abs)))]
                else:
                    pairs = [(s_abs, dst_abs)]
                for f, target in pairs:
                    data = read_file(f, "build-context file", binary=True)
                    total += len(data)
                    steps.append(_write_file(target, data, os.stat(f).st_mode))
            if total > MAX_CONTEXT_BYTES:
                raise NotRunnable(f"the copied files exceed {MAX_CONTEXT_BYTES >> 20} MiB")
        elif ins == "RUN":
            if _NETWORK.search(args):
                raise NotRunnable(f"{where}: RUN {args[:60]} needs the network")
            steps.append(args)
        elif ins == "ENV":
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or args.split()[:1]
            bad = [v for v in names if v not in _ENV_OK]
            if bad:
                raise NotRunnable(f"{where}: ENV {', '.join(bad)}: sessions do not carry "
                                  "environment variables into the agent's commands")
        elif ins == "USER":
            if args.strip() not in ("root", "0"):
                raise NotRunnable(f"{where}: USER {args.strip()}: a session maps a single uid")
        elif ins in ("CMD", "ENTRYPOINT"):
            raise NotRunnable(f"{where}: {ins} starts a service with the container")
        elif ins in ("LABEL", "EXPOSE", "SHELL", "ARG", "STOPSIGNAL", "HEALTHCHECK", "VOLUME",
                     "MAINTAINER", "ONBUILD"):
            continue
        else:
            raise TaskFormatError(f"{path}: line {n}: unknown instruction {ins}")
    if not base:
        raise TaskFormatError(f"{path}: no FROM line")
    if cwd == "/":
        cwd = "/app"
        tops.add("/app")
        steps.insert(0, "mkdir -p /app && cd /app")
    return "\n".join(["set -e"] + steps), cwd, tops, base


def _check(tests_dir: str) -> str:
    """The check script: /tests refilled with tests/, /logs/verifier empty, test.sh run, then
    reward.txt (if written) or its exit code decides."""
    lines = ["set -u", "rm -rf /tests/* /tests/.[!.]* /logs/verifier 2>/dev/null",
             "mkdir -p /tests /logs/verifier || exit 1"]
    for dp, _dn, fns in sorted(os.walk(tests_dir)):
        for fn in sorted(fns):
            f = os.path.join(dp, fn)
            rel = os.path.relpath(f, tests_dir)
            lines.append(_write_file("/tests/" + rel, read_file(f, "test file", binary=True),
                                     os.stat(f).st_mode) + " || exit 1")
    lines += ["bash /tests/test.sh", "rc=$?",
              "if [ -f /logs/verifier/reward.txt ] && [ ! -L /logs/verifier/reward.txt ]; then",
              "  r=$(head -c 64 /logs/verifier/reward.txt | tr -d '[:space:]')",
              "  awk -v r=\"$r\" 'BEGIN { exit !(r ~ /^[0-9.eE+-]+$/ && r + 0 >= 1) }'",
              "  exit $?", "fi", "exit $rc"]
    return "\n".join(lines) + "\n"


def load_tb2_task(path: str | os.PathLike) -> Task:
    """One Terminal-Bench 2 folder as a terminal-family Task; NotRunnable (with the reason) when
    this sandbox cannot run it, TaskFormatError (naming the file) when it is malformed."""
    root = os.path.abspath(os.fspath(path))
    prompt = read_instruction(root)
    toml_path = os.path.join(root, "task.toml")
    cfg = _config(toml_path)
    tests_dir = os.path.join(root, "tests")
    test_sh = os.path.join(tests_dir, "test.sh")
    if not os.path.isfile(test_sh):
        raise TaskFormatError(f"{root}: tests/test.sh is missing (the verifier)")
    test_text = read_file(test_sh, "tests/test.sh")
    for dp, dns, fns in os.walk(tests_dir):
        for n in dns + fns:
            if os.path.islink(os.path.join(dp, n)):
                raise TaskFormatError(f"{os.path.join(dp, n)} is a symbolic link")
    envc, agent, verifier = (cfg.get(k, {}) for k in ("environment", "agent", "verifier"))
    if envc.get("allow_internet"):
        raise NotRunnable(f"{toml_path}: allow_internet = true (the sandbox has no network)")
    if envc.get("gpus"):
        raise NotRunnable(f"{toml_path}: gpus = {envc['gpus']} (sandbox commands get no GPU)")
    m = _NETWORK.search(test_text)
    if m:
        raise NotRunnable(f"tests/test.sh fetches with the network ({m.group(0)}): "
                          "the sandbox has none")
    setup, cwd, tops, base = _replay(root)
    sol_path = os.path.join(root, "solution", "solve.sh")
    solution = [read_file(sol_path, "solution/solve.sh")] if os.path.isfile(sol_path) else []
    dirs = sorted(tops | {"/root", "/tmp", "/logs", "/tests"})
    meta: dict[str, Any] = {
        "source": "terminal-bench-2", "path": os.path.abspath(root), "agent": True,
        "domain": "terminal-bench-2", "template": os.path.basename(os.path.normpath(root)),
        "metadata": dict(cfg.get("metadata", {})), "base_image": base, "solution": solution,
        "workspace": {"cwd": cwd, "home": "/root", "dirs": dirs, "as_root": True},
        "max_task_runs": 3}
    if "difficulty" in meta["metadata"]:
        meta["difficulty"] = meta["metadata"]["difficulty"]
    if agent.get("timeout_sec") is not None:
        meta["agent_timeout_s"] = float(agent["timeout_sec"])
    storage = envc.get("storage_mb") or (_size_mb(toml_path, "storage", envc["storage"])
                                         if "storage" in envc else None)
    if storage:
        meta["disk_mb"] = int(min(storage, 1024))
        if storage > 1024:
            meta["disk_mb_requested"] = int(storage)
    if envc.get("cpus") is not None and envc["cpus"] != 1:
        meta["cpus_requested"] = envc["cpus"]  # commands get one CPU here
    fields: dict[str, Any] = {}
    if verifier.get("timeout_sec") is not None:
        fields["timeout_s"] = float(verifier["timeout_sec"])
    memory = envc.get("memory_mb") or (_size_mb(toml_path, "memory", envc["memory"])
                                       if "memory" in envc else None)
    if memory:
        fields["memory_mb"] = int(memory)
    name = os.path.basename(os.path.normpath(root))
    task = Task(id=f"terminal-bench-2/{name}", family="terminal", prompt=prompt, setup=setup,
                check=_check(tests_dir), check_language="bash", meta=meta, **fields)
    check_task(task)
    return task


def load_tb2_dir(root: str | os.PathLike) -> Loaded:
    """Every sub-folder of `root` holding an instruction.md: the runnable Tasks and, for the
    others, the reason (malformed folders raise TaskFormatError)."""
    base = os.fspath(root)
    if not os.path.isdir(base):
        raise TaskFormatError(f"{base} is not a directory")
    tasks, skipped = [], []
    for d in sorted(os.listdir(base)):
        p = os.path.join(base, d)
        if not os.path.isfile(os.path.join(p, "instruction.md")):
            continue
        try:
            tasks.append(load_tb2_task(p))
        except NotRunnable as e:
            skipped.append((p, str(e)))
    if not tasks and not skipped:
        raise TaskFormatError(f"{base}: no task folders (sub-folders with an instruction.md)")
    return Loaded(tasks, skipped)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Which Terminal-Bench 2 task folders run here.")
    p.add_argument("root", help="a folder of task folders")
    print(load_tb2_dir(p.parse_args(argv).root).summary())


if __name__ == "__main__":
    main()
