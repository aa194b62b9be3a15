"""Sessions: one episode's private working directory kept across many sandboxed commands.

    with SandboxPool(workers=2) as pool:
        with pool.session(files={"note.txt": "a1b2.txt\\n"}) as s:      # or Session(pool, ...)
            r = s.run("cat note.txt")                 # ExecutionResult, like sandbox.run (bash)
            s.run("cp a1b2.txt out.txt")              # the files of earlier commands are there
            verdict = s.check("test -s out.txt")      # isolated check over the final state
            s.read_files(["out.txt"])                 # {"out.txt": b"..."}
    # the same over HTTP: SandboxClient(url).session(...) returns a Session with this interface

Design: a session owns a uid, a tmpfs and a cgroup of its own; any pool worker runs its commands
with them. The alternative, leasing a worker slot for the episode, would hold one of the pool's
few workers through every generation step of the episode: an RL batch of 32 episodes on 2
workers could not even be open at once. Here an open session costs no process, only:
  - a uid from the slots' range, taken by `flock` like a slot's (so no other slot, session or
    pool on the machine uses it while the session lives); every command runs as that uid, so the
    files one command leaves are the next command's own files, with any mode it chose;
  - a host tmpfs of `disk_mb` / `disk_inodes` (mode 0700, owned by the uid) at
    `<state_dir>/slots/<uid>/work`, bound at /work by the command's sandbox; it is never
    mounted anywhere else, so two sessions (or a session and a slot) never see each other's
    files, and their processes live in separate pid namespaces, uids and cgroups;
  - a cgroup (memory, pids, cpu) `kimi-sandbox/u<uid>`, the command's limits plus `disk_mb` for
    the tmpfs pages it holds (tmpfs pages are charged to the cgroup that wrote them, and the
    session's files must not count against another program's memory limit);
  - its own synthetic /etc (the uid's name) and program directory (bound read-only at /sandbox).
The layout is a slot's, so the start-up sweep of any later pool removes what a crashed owner
left; a reaper process (sandbox/reaper.py) does it at once when the owning process dies.

Each command is one isolated sandbox exactly like `sandbox.run` (namespaces, seccomp, setpriv,
rlimits, wall-clock kill of the whole tree, capped output): no process survives a command, /work
itself is given back its mode and owner before each command (a `chmod 000 /work` cannot make the
next command or the check fail to start), and a command whose `files` cannot be written over what
earlier commands left comes back as "error". `check(code)` runs `isolated=True` (python -I / bash
--norc, fixed PATH and HOME, program text on no path: the rules of the terminal verifier's
check), so nothing a command wrote can reach the checker's interpreter or environment.

Limits (`SessionLimits`): commands, total sandbox wall time of commands (a command's timeout is
cut to what is left), disk and inodes, an idle timeout, a lifetime, and task runs (setup and
checks, `budget=False`, counted apart so a policy that spends its budget cannot stop its own
check). The owner has a hard cap on open sessions (`SandboxPool(max_sessions=...)`). Closing (or
an idle timeout, the lifetime, a broken session, the pool's close) kills the session's processes,
detaches and removes its tmpfs, and leaves no directory; its uid and empty cgroup may be kept
warm for the next session (a fresh cgroup v1 costs 6-16 ms on its first attach).

Errors: `SessionClosed`, `SessionLimitExceeded`, `SessionBusy` (one command at a time per
session), `SessionCapReached`, all `SessionError`, delivered through the Future of `submit`
(`run` raises them). Caller mistakes in a command's arguments raise `InvalidRequest` at submit.

Workspaces (`Workspace`, `pool.session(workspace=...)`): shell tasks written for Docker
containers. The cwd, HOME, PATH entries, uid 0 inside the user namespace (`as_root`) and
directories that persist across commands (/home, /root, /tmp, /app, ...), each a directory of
the session's one tmpfs bound at its path; `files` and `read_files` are relative to the cwd.

    with SandboxPool(workers=2) as pool:
        ws = Workspace(cwd="/home/agent", home="/root", dirs=("/tmp", "/root"), as_root=True)
        with pool.session(workspace=ws) as s:
            s.run("whoami; echo x > /root/x")         # 'root\n'; /root/x is there next time
            s.start("(while :; do date >> /tmp/log; sleep 1; done) & echo up")

Start commands (`Session.start`): a task's start command whose background processes keep
running until the session closes, in a cgroup `b<uid>` of their own next to the session's (the
kill of leftovers before each command spares it; close, the reaper and the start-up sweep do
not), launched without a parent-death signal; their output after the foreground exits goes to a
drain (sandbox/README.md has the details).

Not covered: sessions over unisolated (`isolation="none"`) or non-root pools (no uid, tmpfs or
cgroup to give a session: IsolationUnavailable says so); processes that outlive a command other
than a start command's (a server started by a plain command is gone by the next: each command is
its own sandbox); later commands seeing or signalling the background processes (their own pid
namespace) or reaching a port they listen on (their own network namespace).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import math
import os
import posixpath
import secrets
import select
import shutil
import stat
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import cgroups
from .config import IsolationUnavailable, SlotBroken
from .executor import Slot
from .host import (
    MNT_DETACH,
    _ensure_state_dir,
    _libc,
    _mount_tmpfs,
    _mountpoints,
    _slot_dir,
    _sweep_uid,
    _try_lock,
    kill_uid,
)
from .launch import bwrap_args, env_args, shell_launcher, write_etc
from .monitor import supervise
from .result import ExecutionResult, InvalidRequest, check_rel_path, normalize_request
from .workfiles import place_files, read_back

# --------------------------------------------------------------------------------------------
# limits and errors


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """Limits of one session (validated on construction; a bad value raises ValueError)."""

    max_commands: int = 64  # commands run with budget=True (the policy's)
    max_wall_s: float = 300.0  # their total sandbox wall time; a timeout is cut to what is left
    disk_mb: int = 64  # the session's /work tmpfs
    disk_inodes: int = 4096
    idle_timeout_s: float = 300.0  # closed when no command ran or was asked for this long
    max_lifetime_s: float = 3600.0  # closed this long after it was opened
    max_task_runs: int = 16  # runs with budget=False (setup, checks)
    max_starts: int = 4  # start commands (Session.start: processes kept in the background)

    def __post_init__(self) -> None:
        ints = {"max_commands": (1, 100_000), "disk_mb": (1, 16384), "disk_inodes": (16, 1 << 24),
                "max_task_runs": (0, 100_000), "max_starts": (0, 16)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"SessionLimits.{name} must be an int in [{lo}, {hi}], got {v!r}")
        for name in ("max_wall_s", "idle_timeout_s", "max_lifetime_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SessionLimits.{name} must be a positive number of seconds, got {v!r}")

    @classmethod
    def coerce(cls, limits: SessionLimits | dict | None) -> SessionLimits:
        """None -> defaults; a dict -> SessionLimits(**dict) (unknown keys raise ValueError)."""
        if limits is None:
            return cls()
        if isinstance(limits, cls):
            return limits
        if isinstance(limits, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(limits) - known)
            if unknown:
                raise ValueError(f"unknown SessionLimits field(s) {unknown}; known: {sorted(known)}")
            return cls(**limits)
        raise ValueError(f"limits must be a SessionLimits, a dict or None, got {type(limits).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Where a workspace directory may not go: the sandbox's read-only system view, its own
# directories and the kernel's (a directory under one of these is refused too).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
               "/run", "/sandbox", "/sbin", "/sys", "/usr")
MAX_WORKSPACE_DIRS = 16


def _check_abs_path(field: str, p: Any, *, system_ok: bool = False) -> str:
    if not isinstance(p, str):
        raise ValueError(f"Workspace.{field} must be an absolute path (a str), got {p!r}")
    if not p.startswith("/"):
        raise ValueError(f"Workspace.{field} {p!r} is not absolute: write it from /, e.g. "
                         f"{'/' + p.lstrip('./')!r}")
    if "\0" in p or ":" in p:
        raise ValueError(f"Workspace.{field} {p!r} contains a NUL or ':' (not allowed in a "
                         "workspace path)")
    norm = posixpath.normpath(p)
    if norm.startswith("//"):
        norm = norm[1:]
    if norm != p:
        raise ValueError(f"Workspace.{field} {p!r} is not a normal path (no '.', '..', '//' or "
                         f"trailing '/'): write {norm!r}")
    if p == "/":
        raise ValueError(f"Workspace.{field} cannot be '/': name a directory such as /app")
    parts = p.split("/")[1:]
    if len(parts) > 8 or any(len(c.encode("utf-8", "surrogateescape")) > 255 for c in parts):
        raise ValueError(f"Workspace.{field} {p!r}: at most 8 components of at most 255 bytes")
    if not system_ok:
        for d in SYSTEM_DIRS:
            if p == d or p.startswith(d + "/"):
                raise ValueError(
                    f"Workspace.{field} {p!r} is under {d}, a system directory of the sandbox "
                    "(read-only or its own); use a directory such as /app, /home/<user>, /root, "
                    "/tmp, /srv or /opt/<name>")
    return p


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Where a session's commands run and which directories persist across them (validated on
    construction: a bad value raises ValueError naming the field; a dict of these fields works
    too, see `coerce`). The default, Workspace(), is the plain session: /work only.

    cwd: absolute directory the commands start in (created at open; `files` and `read_files`
    are relative to it). home: HOME of the commands (None: the cwd). dirs: absolute directories
    that persist across the session's commands, each a directory of the session's disk bound at
    that path; the top directory of cwd (and of home) is added when no listed directory holds it
    ("/home/agent" -> "/home"). "/tmp" listed: /tmp is persistent instead of a fresh tmpfs per
    command. "/var" listed: it starts with empty log/ and tmp/. System directories (/usr, /etc,
    /bin, /lib*, /proc, /dev, /sys, /run, /sandbox, /boot, /sbin and what is under them), "/"
    and one listed directory inside another are refused. as_root: commands run as uid/gid 0 of
    their user namespace (whoami: root; no capabilities, no_new_privs; the host sees the
    session's uid). path: directories put in front of the default PATH of commands (never of
    isolated checks).
    """

    cwd: str = "/work"
    home: str | None = None
    dirs: tuple[str, ...] = ()
    as_root: bool = False
    path: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_abs_path("cwd", self.cwd)
        if self.home is not None:
            _check_abs_path("home", self.home)
        for name in ("dirs", "path"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
            elif not isinstance(v, tuple):
                raise ValueError(f"Workspace.{name} must be a tuple or list of absolute paths, "
                                 f"got {type(v).__name__} {v!r}")
            if len(getattr(self, name)) > MAX_WORKSPACE_DIRS:
                raise ValueError(f"Workspace.{name}: at most {MAX_WORKSPACE_DIRS} entries, got "
                                 f"{len(getattr(self, name))}")
        for d in self.dirs:
            _check_abs_path("dirs", d)
        for d in self.path:
            _check_abs_path("path", d, system_ok=True)
        if type(self.as_root) is not bool:
            raise ValueError(f"Workspace.as_root must be a bool, got {self.as_root!r}")
        self.mounts()  # nesting and duplicates

    def mounts(self) -> tuple[str, ...]:
        """The persistent directories: `dirs`, then the top directory of cwd and of home when no
        listed directory holds them. Raises ValueError on a duplicate or nested pair."""
        out = list(self.dirs)
        for p in (self.cwd, self.home or self.cwd):
            if not any(p == m or p.startswith(m + "/") for m in out):
                out.append("/" + p.split("/")[1])
        for i, a in enumerate(out):
            for b in out[i + 1:]:
                if a == b or b.startswith(a + "/") or a.startswith(b + "/"):
                    what = "listed twice" if a == b else "one inside the other"
                    raise ValueError(
                        f"Workspace.dirs: {a!r} and {b!r} are {what} (the top directories of cwd "
                        "and home count as listed); list each persistent directory once, none "
                        "inside another")
        return tuple(out)

    def plan(self) -> dict[str, Any]:
        """Plain data for the sandbox side: binds [(name under the session's disk, path)],
        cwd/home with their places on the disk, user, path, as_root."""
        mounts = self.mounts()

        def on_disk(p: str) -> str:
            for i, m in enumerate(mounts):
                if p == m or p.startswith(m + "/"):
                    return f"d{i}" + p[len(m):]
            raise AssertionError(p)

        home = self.home or self.cwd
        return {"binds": [(f"d{i}", m) for i, m in enumerate(mounts)], "cwd": self.cwd,
                "cwd_rel": on_disk(self.cwd), "home": home, "home_rel": on_disk(home),
                "user": "root" if self.as_root else "sandbox", "path": list(self.path),
                "as_root": self.as_root}

    @classmethod
    def coerce(cls, workspace: Workspace | dict | None) -> Workspace | None:
        """None -> None; a dict -> Workspace(**dict) (unknown keys raise ValueError)."""
        if workspace is None or isinstance(workspace, cls):
            return workspace
        if isinstance(workspace, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(workspace) - known)
            if unknown:
                raise ValueError(f"unknown Workspace field(s) {unknown}; known: {sorted(known)}")
            return cls(**workspace)
        raise ValueError(f"workspace must be a Workspace, a dict or None, got "
                         f"{type(workspace).__name__}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dirs"], d["path"] = list(self.dirs), list(self.path)
        return d


def _dir_mode(path: str) -> int:
    return {"/tmp": 0o1777, "/root": 0o700}.get(path, 0o755)


def _ensure_workspace(workdir: str, plan: dict, uid: int) -> None:
    """Makes the workspace's directories on the session's disk (host side, as root): each bound
    directory, the cwd and home, owned by `uid`, with owner rwx restored on the way to the cwd
    (a command may have chmod'ed them; the next must still start). Never follows a link (the
    commands own these directories); OSError when the cwd is no longer a directory."""
    root = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name, path in plan["binds"]:
            try:
                os.mkdir(name, _dir_mode(path), dir_fd=root)
                os.chown(name, uid, uid, dir_fd=root, follow_symlinks=False)
                _fchmod_at(root, name, _dir_mode(path))  # (mkdir's mode passed the umask)
                if path == "/var":
                    for sub in ("log", "tmp"):
                        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
                        try:
                            os.mkdir(sub, dir_fd=fd)
                            os.chown(sub, uid, uid, dir_fd=fd, follow_symlinks=False)
                            _fchmod_at(fd, sub, 0o1777 if sub == "tmp" else 0o755)
                        finally:
                            os.close(fd)
            except FileExistsError:
                st = os.stat(name, dir_fd=root, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                    _fchmod_at(root, name, stat.S_IMODE(st.st_mode) | 0o700)
        for key in ("cwd_rel", "home_rel"):
            try:
                _walk_dirs(root, plan[key], uid)
            except OSError as e:
                if key == "cwd_rel":
                    raise OSError(e.errno, f"the workspace directory {plan['cwd']} cannot be "
                                           f"entered: {e.strerror}") from None
    finally:
        os.close(root)


def _fchmod_at(dfd: int, name: str, mode: int) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _walk_dirs(root: int, rel: str, uid: int) -> None:
    """mkdir -p `rel` under the dir fd `root` without following links; each directory owned by
    `uid` gets owner rwx back."""
    fd = os.dup(root)
    try:
        for comp in rel.split("/"):
            try:
                os.mkdir(comp, 0o755, dir_fd=fd)
                os.chown(comp, uid, uid, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            try:
                nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                # a command put a link or a file there: the directory comes back in its place
                os.unlink(comp, dir_fd=fd)
                os.mkdir(comp, 0o755, dir_fd=fd)
                os.chown(comp, uid, uid, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if st.st_uid == uid and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    finally:
        os.close(fd)


class _WorkspaceFiles:
    """File helpers of a session, relative to its cwd (shared by the owner and worker sides;
    they use workdir, uid, root, none_mode and ws_plan)."""

    ws_plan: dict | None = None

    def _place_files(self, files: dict[str, bytes]) -> None:
        if self.ws_plan is None:
            return Slot._place_files(self, files)
        pre = self.ws_plan["cwd_rel"] + "/"
        try:
            place_files(self.workdir, {pre + k: v for k, v in files.items()}, self.uid)
        except OSError as e:
            raise OSError(e.errno, str(e.strerror or e).replace(pre, "", 1)) from None

    def _read_back(self, paths: list[str], limit: int) -> tuple[dict[str, bytes], list[str]]:
        if self.ws_plan is None:
            return Slot._read_back(self, paths, limit)
        pre = self.ws_plan["cwd_rel"] + "/"
        files, notes = read_back(self.workdir, [pre + p for p in paths], limit)
        return ({k[len(pre):]: v for k, v in files.items()}, [n.replace(pre, "") for n in notes])

    def _write_etc(self) -> None:
        if self.ws_plan is None:
            return Slot._write_etc(self)
        write_etc(self.etcdir, self.uid, self.ws_plan["home"], self.ws_plan["as_root"])


class SessionError(RuntimeError):
    """A session refused a request (subclasses say why)."""

    kind = "session"


class SessionClosed(SessionError):
    """The session is closed (by its owner, an idle timeout, its lifetime, or because it broke)."""

    kind = "closed"


class SessionLimitExceeded(SessionError):
    """A command would exceed one of the session's limits (commands, wall time, task runs)."""

    kind = "limit"


class SessionBusy(SessionError):
    """A command is still running in this session (one at a time per session)."""

    kind = "busy"


class SessionCapReached(SessionError):
    """The owner already has its maximum number of open sessions."""

    kind = "cap"


ERRORS = {c.kind: c for c in (SessionError, SessionClosed, SessionLimitExceeded, SessionBusy,
                              SessionCapReached)}


def _failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


# --------------------------------------------------------------------------------------------
# the public handle (local or remote backend)


class Session:
    """One episode's private, limited working directory (see the module docstring).

    `Session(executor, files=None, limits=None, workspace=None)` opens a session on `executor`
    (a SandboxPool or a SandboxClient; for the process-wide default pool,
    `sandbox.default_pool().session(...)`); `pool.session(...)` and `client.session(...)` do the
    same. `files` (relative path -> str/bytes) are placed in the working directory (/work, or
    the workspace's cwd) first. `workspace` (a Workspace or a dict of its fields): where
    commands run, which directories persist, uid 0 or not (see Workspace). Methods: submit/run
    (a command, bash by default, any `sandbox.run` argument plus `budget`), submit_check/check
    (isolated, budget=False), submit_start/start (a command whose background processes keep
    running), read_files, usage, close.
    """

    def __init__(self, executor=None, *, files: dict[str, str | bytes] | None = None,
                 limits: SessionLimits | dict | None = None,
                 workspace: Workspace | dict | None = None, _backend=None) -> None:
        if _backend is None:
            if executor is None or not hasattr(executor, "open_session"):
                raise TypeError(
                    f"Session needs an executor that opens sessions (a SandboxPool or a "
                    f"SandboxClient), got {executor!r}; for the process-wide default pool use "
                    f"sandbox.default_pool().session(...)")
            kw = {}
            ws = Workspace.coerce(workspace)
            if ws is not None:  # (a backend without workspaces still opens plain sessions)
                kw["workspace"] = ws
            _backend = executor.open_session(files=files, limits=SessionLimits.coerce(limits), **kw)
        self._b = _backend

    @property
    def id(self) -> str:
        return self._b.id

    @property
    def limits(self) -> SessionLimits:
        return self._b.limits

    @property
    def closed(self) -> bool:
        return self._b.closed

    @property
    def workspace(self) -> Workspace | None:
        """The session's Workspace (None: the plain /work session)."""
        return getattr(self._b, "workspace", None)

    def submit(self, code: str, *, language: str = "bash", budget: bool = True, **kw: Any) -> Future:
        """Runs `code` in the session; Future[ExecutionResult]. Arguments as `sandbox.run`
        (timeout_s, memory_mb, output_limit_bytes, stdin, files, collect, max_procs, isolated).
        budget=False: a task run (setup, check), counted against max_task_runs instead of the
        command and wall-time budgets. A SessionError comes back through the Future."""
        if type(budget) is not bool:
            raise InvalidRequest(f"budget must be a bool, got {budget!r}")
        req = normalize_request(code, language=language, **kw)
        return self._b.submit(req, budget)

    def run(self, code: str, **kw: Any) -> ExecutionResult:
        return self.submit(code, **kw).result()

    def submit_check(self, code: str, *, language: str = "bash", **kw: Any) -> Future:
        """The task's check over the session's current files: isolated (see the module
        docstring), budget=False."""
        return self.submit(code, language=language, isolated=True, budget=False, **kw)

    def check(self, code: str, **kw: Any) -> ExecutionResult:
        return self.submit_check(code, **kw).result()

    def submit_start(self, code: str, *, language: str = "bash", **kw: Any) -> Future:
        """A task's start command: runs like a command (same arguments, not isolated) and its
        result comes back when its foreground part exits; what it leaves running in the
        background (`server &`, `nohup ... &`) keeps running until the session closes, in a
        cgroup of its own (the memory_mb and max_procs of this call, plus the session's disk),
        writing to the session's files. A task run (budget=False), at most
        SessionLimits.max_starts per session. Later commands do not see these processes in
        `ps` (each sandbox has its own pid namespace), only what they write."""
        if kw.get("isolated"):
            raise InvalidRequest("a start command cannot be isolated (isolated=True is for checks)")
        req = normalize_request(code, language=language, **kw)
        return self._b.submit(req, False, background=True)

    def start(self, code: str, **kw: Any) -> ExecutionResult:
        return self.submit_start(code, **kw).result()

    def read_files(self, paths: list[str], *, limit_bytes: int = 1 << 20) -> dict[str, bytes]:
        """Regular files of /work (the workspace's cwd; paths relative to it, never through a
        symlink), at most `limit_bytes` each; a path
        that is missing, not a regular file or behind a link is absent from the answer."""
        if isinstance(paths, str) or not isinstance(paths, (list, tuple)):
            raise InvalidRequest(f"paths must be a list of relative paths, got {paths!r}")
        if type(limit_bytes) is not int or not 0 <= limit_bytes <= 1 << 30:
            raise InvalidRequest(f"limit_bytes must be an int in [0, 1 GiB], got {limit_bytes!r}")
        return self._b.read_files([check_rel_path(p) for p in paths], limit_bytes)

    def usage(self) -> dict[str, Any]:
        return self._b.usage()

    def close(self) -> None:
        self._b.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r}{', closed' if self.closed else ''})"


# --------------------------------------------------------------------------------------------
# owner side (the process holding the pool): uids, dirs, mounts, cgroups, limits


class _Uid:
    """A uid taken by flock, with its cgroup (owner side)."""

    def __init__(self, uid: int, lock_fd: int, cg: cgroups.SlotCgroup | None) -> None:
        self.uid, self.lock_fd, self.cg = uid, lock_fd, cg


class LocalSession(_WorkspaceFiles):
    """The owner-side state of one session (the backend of `Session` over a local pool)."""

    def __init__(self, mgr: SessionManager, sid: str, u: _Uid, limits: SessionLimits,
                 workspace: Workspace | None = None) -> None:
        self.mgr, self.id, self._u, self.limits = mgr, sid, u, limits
        self.workspace = workspace
        self.ws_plan = workspace.plan() if workspace is not None else None
        self.starts = 0
        self._bg_cg: cgroups.SlotCgroup | None = None  # b<uid>: start commands' processes
        self.uid = u.uid
        self.slot_dir = _slot_dir(mgr.cfg, u.uid)
        self.workdir = os.path.join(self.slot_dir, "work")
        self.progdir = os.path.join(self.slot_dir, "prog")
        self.etcdir = os.path.join(self.slot_dir, "etc")
        self.root, self.none_mode = True, False
        self.commands = self.task_runs = 0
        self.wall_s = 0.0
        self.created = self.last_used = time.monotonic()
        self.closed_reason: str | None = None
        self.close_kind = ""
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._inflight: Future | None = None
        self._seq = 0
        self._last: tuple[int, Future] | None = None

    # file helpers: _WorkspaceFiles (Slot's, relative to the workspace's cwd when there is one)

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def descriptor(self) -> dict[str, Any]:
        """What a worker needs to run a command of this session (plain data)."""
        return {"id": self.id, "uid": self.uid, "slot_dir": self.slot_dir, "workdir": self.workdir,
                "progdir": self.progdir, "etcdir": self.etcdir, "disk_mb": self.limits.disk_mb,
                "workspace": self.ws_plan, "max_lifetime_s": self.limits.max_lifetime_s}

    def _closed_error(self) -> SessionClosed:
        return SessionClosed(f"session {self.id} is closed: {self.closed_reason}")

    def submit(self, req: dict, budget: bool = True, seq: int | None = None,
               background: bool = False) -> Future:
        """Queues one normalised request in the pool; Future[ExecutionResult] (SessionErrors
        through the Future). `seq` (HTTP clients number their requests 1, 2, ...): a resend of
        the last number gets the same Future back (result or refusal) instead of running the
        command twice; a number that is neither the last nor the next is refused.
        background: a start command (Session.submit_start; a task run whatever `budget` says)."""
        if background:
            budget = False
            if req.get("isolated"):
                raise InvalidRequest("a start command cannot be isolated (isolated=True is for checks)")
        with self._lock:
            if seq is not None:
                again = self._last is not None and seq == self._last[0]
                if again and not self._last[1].cancelled():
                    return self._last[1]
                if seq <= self._seq and not again:  # (a gap is fine: a request lost on the way)
                    return _failed(SessionError(f"session {self.id}: request number {seq} out of "
                                                f"order (the last one was {self._seq})"))
            fut, counted = self._submit_locked(req, budget, background)
            if seq is not None:
                self._seq, self._last = seq, (seq, fut)
        if counted is not None:
            fut.add_done_callback(lambda f: self._done(f, budget, counted, background))
        return fut

    def _submit_locked(self, req: dict, budget: bool,
                       background: bool = False) -> tuple[Future, str | None]:
        """(future, note) where note is None when the request was refused (a failed future)."""
        if self.closed_reason is not None:
            return _failed(self._closed_error()), None
        if self._inflight is not None and not self._inflight.done():
            return _failed(SessionBusy(f"session {self.id}: a command is still running (one at a "
                                       "time per session)")), None
        now = time.monotonic()
        lim = self.limits
        if now - self.created > lim.max_lifetime_s:
            return _failed(SessionLimitExceeded(f"session {self.id}: lifetime of "
                                                f"{lim.max_lifetime_s:g}s is over")), None
        note = ""
        if budget:
            if self.commands >= lim.max_commands:
                return _failed(SessionLimitExceeded(
                    f"session {self.id}: command limit of {lim.max_commands} reached "
                    "(SessionLimits.max_commands)")), None
            left = lim.max_wall_s - self.wall_s
            if left <= 0.001:
                return _failed(SessionLimitExceeded(
                    f"session {self.id}: wall-time budget of {lim.max_wall_s:g}s used up "
                    "(SessionLimits.max_wall_s)")), None
            if req["timeout_s"] > left:
                req = {**req, "timeout_s": left}
                note = (f" (cut to the session's remaining wall-time budget of {left:.3g}s of "
                        f"{lim.max_wall_s:g}s)")
        elif self.task_runs >= lim.max_task_runs:
            return _failed(SessionLimitExceeded(
                f"session {self.id}: task-run limit of {lim.max_task_runs} reached "
                "(SessionLimits.max_task_runs)")), None
        if background and self.starts >= lim.max_starts:
            return _failed(SessionLimitExceeded(
                f"session {self.id}: start-command limit of {lim.max_starts} reached "
                "(SessionLimits.max_starts)")), None
        self._check_fits(req)  # InvalidRequest: the caller's mistake, raised
        desc = self.descriptor()
        if background:
            if self._u.cg is None:
                return _failed(SessionError(
                    "start commands need memory/pids cgroups on this machine (their processes "
                    "live in a cgroup of their own); this pool has none")), None
            if self._bg_cg is None:
                self._bg_cg = cgroups.SlotCgroup(self.mgr.layout, self.uid, "b")
            desc["background"] = True
        fut = self.mgr.pool._enqueue_session(desc, req, self._on_reply)
        if budget:
            self.commands += 1
        else:
            self.task_runs += 1
        if background:
            self.starts += 1
        self._inflight = fut
        self.last_used = now
        return fut, note

    def _check_fits(self, req: dict) -> None:
        files = req["files"]
        total = sum(len(v) for v in files.values())
        if total > self.limits.disk_mb << 20:
            raise InvalidRequest(f"files total {total} bytes; the session's disk holds "
                                 f"{self.limits.disk_mb} MiB (SessionLimits.disk_mb)")
        if len(files) > self.limits.disk_inodes - 16:
            raise InvalidRequest(f"{len(files)} files: the session has {self.limits.disk_inodes} "
                                 "inodes (SessionLimits.disk_inodes)")

    def _on_reply(self, reply: dict) -> None:
        if reply.get("session_broken"):
            self.broken = reply["session_broken"]

    def _done(self, fut: Future, budget: bool, note: str, background: bool = False) -> None:
        close_now = None
        with self._lock:
            self.last_used = time.monotonic()
            if fut.cancelled():
                if budget:
                    self.commands -= 1
                else:
                    self.task_runs -= 1
                if background:
                    self.starts -= 1
                return
            r = fut.result()
            if budget:
                self.wall_s += r.wall_s
            if note and r.status == "timeout":
                r.message = (r.message + note).strip()
            if self.broken and self.closed_reason is None:
                close_now = f"broken: {self.broken}"
                r.message = (r.message + f" (session closed: {self.broken})").strip()
        if close_now:
            self.mgr._close_async(self, close_now)

    def read_files(self, paths: list[str], limit_bytes: int = 1 << 20) -> dict[str, bytes]:
        self._wait_idle()
        with self._lock:
            if self.closed_reason is not None:
                raise self._closed_error()
            self.last_used = time.monotonic()
            files, _notes = self._read_back(paths, limit_bytes)
        return files

    def read_files_with_notes(self, paths: list[str], limit_bytes: int) -> tuple[dict[str, bytes], list[str]]:
        self._wait_idle()
        with self._lock:
            if self.closed_reason is not None:
                raise self._closed_error()
            self.last_used = time.monotonic()
            return self._read_back(paths, limit_bytes)

    def _wait_idle(self, timeout: float | None = None) -> None:
        fut = self._inflight
        if fut is not None and not fut.done():
            try:
                fut.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - the command's own caller sees it
                pass

    def usage(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            busy = self._inflight is not None and not self._inflight.done()
            return {"id": self.id, "commands": self.commands, "task_runs": self.task_runs,
                    "starts": self.starts,
                    "workspace": self.workspace.to_dict() if self.workspace else None,
                    "wall_s": round(self.wall_s, 4), "age_s": round(now - self.created, 3),
                    "idle_s": 0.0 if busy else round(now - self.last_used, 3), "busy": busy,
                    "closed": self.closed_reason is not None, "closed_reason": self.closed_reason,
                    "limits": self.limits.to_dict()}

    def close(self, reason: str = "closed by its owner", kind: str = "owner") -> None:
        """Kills what runs, waits for the command in flight, removes everything; idempotent.
        kind (owner | idle | lifetime | broken | pool) is counted in the manager's stats."""
        with self._lock:
            if self.closed_reason is not None:
                return
            self.closed_reason = reason
            self.close_kind = kind
            fut = self._inflight
        if fut is not None and not fut.done() and not fut.cancel():
            deadline = time.monotonic() + 60.0
            while not fut.done() and time.monotonic() < deadline:
                self._kill_processes()  # the command ends at once; a launch racing it too
                try:
                    fut.result(timeout=0.2)
                except Exception:  # noqa: BLE001 - cancelled, timed out or failed: all fine here
                    pass
        self.mgr._release(self)

    def _kill_processes(self) -> bool:
        if self._u.cg is not None:
            ok = self._bg_cg.kill_all() if self._bg_cg is not None else True
            return self._u.cg.kill_all() and ok
        return kill_uid(self.uid)


class SessionManager:
    """The sessions of one SandboxPool (owner side): creation, the cap, idle and lifetime
    timeouts, warm uids, the reaper. Used through `SandboxPool.open_session` / `session`."""

    WARM_MAX = 32  # closed sessions' uids (with their empty cgroups) kept for the next ones

    def __init__(self, pool, max_sessions: int) -> None:
        if pool.config.isolation != "bwrap" or os.geteuid() != 0:
            raise IsolationUnavailable(
                "sessions need a root launcher with bubblewrap isolation (each session gets its "
                "own uid, tmpfs and cgroup); this pool is "
                + ("unisolated (isolation='none')" if pool.config.isolation != "bwrap" else "not root"))
        if type(max_sessions) is not int or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.pool = pool
        self.cfg = pool.config
        self.layout = pool._layout
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._open: dict[str, LocalSession] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._warm: list[_Uid] = []
        self._opening = 0
        self._counts: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._shut = False
        _ensure_state_dir(self.cfg)
        from .reaper import ReaperHandle

        self.reaper = ReaperHandle(self.cfg, self.layout)
        for uid in pool.worker_uids():
            if uid is not None:
                self.reaper.add(uid)
        self._sweeper = threading.Thread(target=self._sweep_loop, daemon=True,
                                         name="sandbox-session-sweeper")
        self._sweeper.start()

    # ---- uids ---------------------------------------------------------------------------------
    def _take_uid(self) -> _Uid:
        with self._lock:
            if self._warm:
                return self._warm.pop()
        cfg = self.cfg
        for i in range(cfg.uid_count):
            uid = cfg.uid_base + i
            fd = _try_lock(cfg, uid)
            if fd is None:
                continue
            try:
                self.reaper.add(uid)
                _sweep_uid(cfg, self.layout, uid, keep_cgroup=True)  # what a dead owner left
                cg = cgroups.SlotCgroup(self.layout, uid) if self.layout and self.layout.version else None
                return _Uid(uid, fd, cg)
            except BaseException:
                self._drop_uid(_Uid(uid, fd, None))
                raise
        raise IsolationUnavailable(f"all {cfg.uid_count} sandbox uids are in use")

    def _drop_uid(self, u: _Uid) -> None:
        """Gives the uid back for good: its cgroup removed, the directory swept, lock closed."""
        try:
            if u.cg is not None:
                u.cg.kill_all()
                u.cg.remove()
            _sweep_uid(self.cfg, self.layout, u.uid)
        except OSError:
            pass
        finally:
            os.close(u.lock_fd)
            self.reaper.remove(u.uid)

    # ---- open / close -------------------------------------------------------------------------
    def open(self, *, files: dict | None = None, limits: SessionLimits | dict | None = None,
             workspace: Workspace | dict | None = None) -> LocalSession:
        limits = SessionLimits.coerce(limits)
        workspace = Workspace.coerce(workspace)
        if workspace == Workspace():
            workspace = None  # the plain session, exactly
        if files:
            req = normalize_request("", files=files)  # validates paths and contents
            files = req["files"]
        with self._lock:
            if self._shut:
                raise SessionClosed("the pool's sessions are shut down (pool closed)")
            if len(self._open) + self._opening >= self.max_sessions:
                self._counts["refused_cap"] += 1
                raise SessionCapReached(f"{self.max_sessions} sessions are open already "
                                        "(SandboxPool(max_sessions=...)); close one first")
            self._opening += 1
        try:
            u = self._take_uid()
            sid = "s-" + secrets.token_urlsafe(12)
            s = LocalSession(self, sid, u, limits, workspace)
            try:
                self._make_dirs(s)
                if files:
                    total = sum(len(v) for v in files.values())
                    if total > limits.disk_mb << 20 or len(files) > limits.disk_inodes - 16:
                        raise InvalidRequest(f"{len(files)} files of {total} bytes do not fit the "
                                             f"session's disk ({limits.disk_mb} MiB, "
                                             f"{limits.disk_inodes} inodes)")
                    s._place_files(files)
            except BaseException:
                self._teardown(s)
                self._give_back(u, keep=False)
                raise
            with self._lock:
                self._open[sid] = s
                self._counts["opened"] += 1
            return s
        finally:
            with self._lock:
                self._opening -= 1

    def _make_dirs(self, s: LocalSession) -> None:
        if os.path.lexists(s.slot_dir):
            raise IsolationUnavailable(f"session directory {s.slot_dir} exists already")
        os.makedirs(s.slot_dir, mode=0o711)
        os.makedirs(s.workdir, mode=0o700)
        os.makedirs(s.progdir, mode=0o755)
        os.makedirs(s.etcdir, mode=0o755)
        _mount_tmpfs(s.workdir, f"size={s.limits.disk_mb}m,nr_inodes={s.limits.disk_inodes},"
                                f"mode=0700,uid={s.uid},gid={s.uid}")
        if s.ws_plan is not None:
            _ensure_workspace(s.workdir, s.ws_plan, s.uid)
        s._write_etc()

    def _teardown(self, s: LocalSession) -> bool:
        """Kills the session's processes, detaches its tmpfs, removes its directory. True when
        nothing is left (the uid may then serve another session)."""
        ok = s._kill_processes()
        if s._bg_cg is not None:
            try:
                s._bg_cg.remove()
            except OSError:
                ok = False
        for _ in range(8):  # normally exactly one mount
            if _libc.umount2(s.workdir.encode(), MNT_DETACH) != 0:
                break
        shutil.rmtree(s.slot_dir, ignore_errors=True)
        return ok and not os.path.lexists(s.slot_dir) and s.workdir not in _mountpoints()

    def _give_back(self, u: _Uid, keep: bool) -> None:
        with self._lock:
            if keep and not self._shut and len(self._warm) < self.WARM_MAX:
                self._warm.append(u)
                return
        self._drop_uid(u)

    def _release(self, s: LocalSession) -> None:
        clean = self._teardown(s)
        with self._lock:
            self._open.pop(s.id, None)
            self._closed[s.id] = s.closed_reason or "closed"
            while len(self._closed) > 4096:
                self._closed.popitem(last=False)
            self._counts["closed"] += 1
            self._counts[f"closed_{s.close_kind or 'owner'}"] += 1
        self._give_back(s._u, keep=clean and s.broken is None)

    def _close_async(self, s: LocalSession, reason: str) -> None:
        threading.Thread(target=s.close, args=(reason, "broken"), daemon=True,
                         name="sandbox-session-close").start()

    def get(self, sid: str) -> LocalSession:
        """The open session `sid`; SessionClosed saying why when it was closed, KeyError when it
        never existed here."""
        with self._lock:
            s = self._open.get(sid)
            if s is not None:
                return s
            reason = self._closed.get(sid)
        if reason is not None:
            raise SessionClosed(f"session {sid} is closed: {reason}")
        raise KeyError(sid)

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._open)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"open": len(self._open), "max_sessions": self.max_sessions,
                    "warm_uids": len(self._warm), "opened": self._counts["opened"],
                    "closed": self._counts["closed"], "refused_cap": self._counts["refused_cap"],
                    **{k: v for k, v in self._counts.items() if k.startswith("closed_")}}

    # ---- timeouts ---------------------------------------------------------------------------
    def _sweep_loop(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self._lock:
                sessions = list(self._open.values())
            for s in sessions:
                u = s.usage()
                if now - s.created > s.limits.max_lifetime_s:
                    s.close(f"lifetime of {s.limits.max_lifetime_s:g}s is over "
                            "(SessionLimits.max_lifetime_s)", "lifetime")
                elif not u["busy"] and u["idle_s"] > s.limits.idle_timeout_s:
                    s.close(f"idle for {u['idle_s']:.1f}s (SessionLimits.idle_timeout_s "
                            f"{s.limits.idle_timeout_s:g}s)", "idle")

    def shutdown(self) -> None:
        """Closes every session (the pool is closing) and gives every uid back."""
        with self._lock:
            self._shut = True
            sessions = list(self._open.values())
        for s in sessions:
            s.close("the pool was closed", "pool")
        self._stop.set()
        self._sweeper.join(timeout=5.0)
        with self._lock:
            warm, self._warm = self._warm, []
        for u in warm:
            self._drop_uid(u)
        self.reaper.close()


# --------------------------------------------------------------------------------------------
# worker side: run one command with a session's uid, directories and cgroup


class _SessionCgroup(cgroups.SlotCgroup):
    """The session's cgroup as a worker sees it: never created here (the owner made it, and a
    closed session's must not come back), limits raised by the session's disk (its tmpfs pages
    are charged here)."""

    def __init__(self, layout: cgroups.CgroupLayout, uid: int, extra_bytes: int,
                 prefix: str = "u", extra_pids: int = 0) -> None:
        self.extra_bytes, self.extra_pids = extra_bytes, extra_pids
        super().__init__(layout, uid, prefix)

    def _make_dirs(self) -> None:
        missing = [d for d in self.dirs.values() if not os.path.isdir(d)]
        if missing:
            raise FileNotFoundError(f"the session's cgroup is gone: {missing[0]}")

    def set_limits(self, memory_bytes: int, max_pids: int, cpu_quota: float | None = None) -> None:
        super().set_limits(memory_bytes + self.extra_bytes, max_pids + self.extra_pids, cpu_quota)

    def trim(self, keep_bytes: int = 64 << 20) -> None:
        super().trim(keep_bytes + self.extra_bytes)


class _SessionRunner(_WorkspaceFiles, Slot):
    """A Slot view of a session inside a pool worker: the worker slot's machine setup (bwrap,
    seccomp program, launcher) with the session's uid, directories and cgroup (for a start
    command, its background cgroup, and no parent-death signal). Owns nothing."""

    def __init__(self, base: Slot, desc: dict) -> None:  # noqa: D107 - no Slot.__init__ on purpose
        self.cfg = base.cfg
        self.none_mode = False
        self.root = base.root
        self.bwrap = base.bwrap
        self.seccomp_prog = base.seccomp_prog
        self._devnull = base._devnull
        self.layout = base.layout
        self.features = base.features
        self._closed = False
        self._lock_fd = None
        self.broken = None
        self.resets = 0
        self.uid = int(desc["uid"])
        self.slot_dir, self.workdir = desc["slot_dir"], desc["workdir"]
        self.progdir, self.etcdir = desc["progdir"], desc["etcdir"]
        self.work_tmpfs = True
        self.disk_bytes = int(desc["disk_mb"]) << 20
        self.ws_plan = desc.get("workspace")
        self.background = bool(desc.get("background"))
        self.lifetime_s = float(desc.get("max_lifetime_s") or 3600.0)
        st, parent = os.lstat(self.workdir), os.lstat(self.slot_dir)
        if st.st_dev == parent.st_dev or st.st_uid != self.uid:
            raise FileNotFoundError(f"the session's working directory {self.workdir} is not its "
                                    "own tmpfs any more")
        if self.background:  # + the drain of its output pipes (one process)
            self.cg = (_SessionCgroup(base.layout, self.uid, self.disk_bytes, "b", 1)
                       if base.cg is not None else None)
            if self.cg is None:
                raise FileNotFoundError("start commands need the session's cgroups")
        else:
            self.cg = (_SessionCgroup(base.layout, self.uid, self.disk_bytes)
                       if base.cg is not None else None)
        self._static_args = self._bwrap_static_args()
        self._env = {False: self._env_args(False), True: self._env_args(True)}

    def _limits(self, req: dict, timeout_s: float) -> list[tuple[int, int, int]]:
        import resource as R

        cpu = int(self.lifetime_s) + 1  # start commands: what they leave runs for the session
        return [(res, self.disk_bytes, self.disk_bytes) if res == R.RLIMIT_FSIZE
                else (res, cpu, cpu + 1) if res == R.RLIMIT_CPU and self.background
                else (res, s, h) for res, s, h in super()._limits(req, timeout_s)]

    def _bwrap_static_args(self) -> list[str]:
        ws = self.ws_plan
        if ws is None:
            a = super()._bwrap_static_args()
        else:
            binds = [(os.path.join(self.workdir, name), path) for name, path in ws["binds"]]
            a = bwrap_args(self.bwrap, self.cfg, self.etcdir, self.workdir, self.progdir,
                           binds=binds, chdir=ws["cwd"], uid0=ws["as_root"])
        if self.background:  # what it leaves running must outlive this worker's wait
            a = [x for x in a if x != "--die-with-parent"]
        return a

    def _env_args(self, isolated: bool) -> list[str]:
        return env_args(self.cfg, isolated, self.ws_plan)

    def _supervise(self, proc, req, t0, out_r, err_r, st_r, timeout_s,
                   status_channel: bool = True) -> ExecutionResult:
        if not self.background:
            return super()._supervise(proc, req, t0, out_r, err_r, st_r, timeout_s, status_channel)
        handed: dict = {}
        res, broken = supervise(proc, req, t0, out_r, err_r, st_r, timeout_s, cg=self.cg,
                                uid=self.uid, root=self.root, background=handed)
        if broken:
            self.broken = broken
        if handed:
            _BACKGROUND.adopt(self, handed)
        return res

    def close(self) -> None:
        """Drops what this view opened (cgroup v2's memory.peak fd); the session's resources
        stay: the owner removes them, never a worker."""
        self._closed = True
        fd = getattr(self.cg, "_peak_fd", None)
        if fd is not None:
            os.close(fd)
            self.cg._peak_fd = None


# Reads and drops a start command's stdout (fd 0) and stderr (fd argv[1]) until both end: one
# process (no child that could be orphaned to the worker when the session's close kills it).
_DRAIN = ("import os, select, sys\nfds = [0, int(sys.argv[1])]\nwhile fds:\n"
          "    for fd in select.select(fds, [], [])[0]:\n"
          "        if not os.read(fd, 65536):\n            fds.remove(fd)\n")


class _Background:
    """In a pool worker: what the start commands it launched left running. Their output pipes
    go to a drain (one python process reading both into nothing, as the session's uid, in the
    background cgroup), so a background process that prints neither blocks nor dies of SIGPIPE; a thread
    reaps the drains and the sandboxes' pid 1 (orphaned to this subreaper) once they exit (the
    session's close kills them through the cgroup)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[int | None, Any]] = []  # (pidfd of the sandbox's pid 1, drain)
        self._thread: threading.Thread | None = None

    def adopt(self, runner: _SessionRunner, handed: dict) -> None:
        import resource as R
        import subprocess

        out_r, err_r = handed["out_r"], handed["err_r"]
        drain = None
        try:
            argv = shell_launcher(runner.cfg, [(R.RLIMIT_CORE, 0, 0)], runner.cg.procs_files,
                                  runner.root, runner.uid)
            argv += [runner.cfg.python, "-S", "-I", "-c", _DRAIN, str(err_r)]
            drain = subprocess.Popen(argv, stdin=out_r, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=(err_r,), env={},
                                     cwd="/", close_fds=True, start_new_session=True)
        except (OSError, subprocess.SubprocessError):
            pass  # the pipes close below: a background process that prints gets EPIPE
        finally:
            os.close(out_r)
            os.close(err_r)
        with self._lock:
            self._items.append((handed.get("pidfd"), drain))
            if self._thread is None:
                self._thread = threading.Thread(target=self._reap_loop, daemon=True,
                                                name="sandbox-session-background")
                self._thread.start()

    def _reap_loop(self) -> None:
        while True:
            with self._lock:
                items = list(self._items)
            fds = [fd for fd, _ in items if fd is not None]
            try:
                ready = set(select.select(fds, [], [], 1.0)[0]) if fds else set()
            except (OSError, ValueError):
                ready = set()
            if not fds:
                time.sleep(1.0)
            keep = []
            for fd, drain in items:
                if fd is not None and fd in ready:
                    try:
                        os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
                    except (ChildProcessError, OSError):
                        pass  # not our child (this worker is no subreaper): init reaps it
                    os.close(fd)
                    fd = None
                if drain is not None and drain.poll() is not None:
                    drain = None
                if fd is not None or drain is not None:
                    keep.append((fd, drain))
            with self._lock:
                new = self._items[len(items):]
                self._items = keep + new


_BACKGROUND = _Background()


def run_session_command(base: Slot, desc: dict, req: dict) -> tuple[ExecutionResult, str | None]:
    """In a pool worker: one command of the session `desc`. Returns (result, broken) where broken
    says why the session must be closed (its processes could not be killed, /work could not be
    restored), else None. Never marks the worker's own slot broken: it is not touched."""
    try:
        runner = _SessionRunner(base, desc)
    except Exception as e:  # noqa: BLE001 - gone or unreadable: this session's problem only
        return ExecutionResult.sandbox_error(f"session {desc.get('id')} is not available: {e}"), \
            f"not available: {e}"
    try:
        return _run_command(runner, req)
    finally:
        runner.close()


def _run_command(runner: _SessionRunner, req: dict) -> tuple[ExecutionResult, str | None]:
    try:
        if runner.background:
            pass  # its cgroup holds what earlier start commands left running: kept
        elif runner.cg is not None and runner.cg.pids() and not runner.cg.kill_all():
            runner.broken = "processes of an earlier command survive SIGKILL"
            return ExecutionResult.sandbox_error(f"session broken: {runner.broken}"), runner.broken
        runner._restore_work_root()
        if runner.ws_plan is not None:
            try:
                _ensure_workspace(runner.workdir, runner.ws_plan, runner.uid)
            except OSError as e:
                return ExecutionResult(status="error", message=str(e.strerror or e)), None
        try:
            runner._place_files(req.get("files") or {})
        except OSError as e:
            return ExecutionResult(status="error", message="could not place files over what earlier "
                                   f"commands left: {e.strerror or e}"), None
        r = runner._run_bwrap(req)
        runner._attach_collected(r, req)
        return r, runner.broken
    except SlotBroken as e:
        return ExecutionResult.sandbox_error(f"session broken: {e}"), str(e)
    except Exception as e:  # noqa: BLE001 - a failed command is a sandbox_error, the worker lives on
        why = f"{type(e).__name__}: {e}"
        return ExecutionResult.sandbox_error(f"session command failed: {why}"), why
