"""Host operations of the sandbox: uid locks, /proc scans, kills, mounts, prctl, sweeping.

Everything here acts on the host, outside any sandbox, as the (normally root) launcher:
  - uids: each slot or session takes a uid of `SandboxConfig.uid_base + [0, uid_count)` by
    `flock` on a lock file under `state_dir/locks` (`_try_lock`); processes of that real uid are
    its processes (`pids_of_uid`, `kill_uid`, never uid 0);
  - mounts: the per-slot /work tmpfs (`_mount_tmpfs`, `_umount`, `_mountpoints`);
  - process attributes through prctl (`set_child_subreaper`, `set_parent_death_signal`);
  - sweeping: `_sweep_uid` cleans what a dead owner of a uid left (processes, cgroups, the /work
    mount, the slot directory); `sweep_stale` does it for every unlocked uid of the range.
Not covered here: building or running a sandbox (sandbox/executor.py) and cgroup files
(sandbox/cgroups.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import stat
import time

from . import cgroups
from .config import IsolationUnavailable, SandboxConfig

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper() -> bool:
    return _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    return _libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def _mount_tmpfs(target: str, opts: str) -> None:
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {target}: {os.strerror(e)}")


def _umount(target: str) -> None:
    _libc.umount2(target.encode(), MNT_DETACH)


def _mountpoints() -> set[str]:
    out = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 4:
                    out.add(parts[4].replace("\\040", " "))
    except OSError:
        pass
    return out


def _proc_uids(live_only: bool = False) -> dict[int, list[int]]:
    """uid -> pids, from /proc (real uid). live_only: without zombies (dead processes whose
    parent has not reaped them yet: they hold no resources and cannot be killed again)."""
    res: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                zombie = False
                for line in f:
                    if line.startswith(b"State:"):
                        zombie = line.split()[1] == b"Z"
                    elif line.startswith(b"Uid:"):
                        if not (live_only and zombie):
                            res.setdefault(int(line.split()[1]), []).append(int(name))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return res


def pids_of_uid(uid: int) -> list[int]:
    return _proc_uids().get(uid, [])


def live_pids_of_uid(uid: int) -> list[int]:
    """pids_of_uid without zombies (an orphan's zombie waits for init, which may reap slowly)."""
    return _proc_uids(live_only=True).get(uid, [])


def kill_uid(uid: int, timeout_s: float = 5.0) -> bool:
    """SIGKILLs every process whose real uid is `uid` (never uid 0). True when none is left."""
    if uid == 0:
        raise ValueError("refusing to kill uid 0")
    deadline = time.monotonic() + timeout_s
    while True:
        pids = live_pids_of_uid(uid)
        if not pids:
            return True
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
            try:  # reap it if it was reparented to us
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _lock_path(cfg: SandboxConfig, uid: int) -> str:
    return os.path.join(cfg.state_dir, "locks", f"{uid}.lock")


def _try_lock(cfg: SandboxConfig, uid: int) -> int | None:
    fd = os.open(_lock_path(cfg, uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _ensure_state_dir(cfg: SandboxConfig) -> None:
    for d, mode in ((cfg.state_dir, 0o711), (os.path.join(cfg.state_dir, "locks"), 0o700),
                    (os.path.join(cfg.state_dir, "slots"), 0o711)):
        os.makedirs(d, mode=mode, exist_ok=True)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise IsolationUnavailable(f"sandbox state dir {d} is not a directory owned by us")
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(d, mode)


def _slot_dir(cfg: SandboxConfig, uid: int) -> str:
    return os.path.join(cfg.state_dir, "slots", str(uid))


def _sweep_uid(cfg: SandboxConfig, layout: cgroups.CgroupLayout | None, uid: int,
               keep_cgroup: bool = False) -> None:
    """Cleans what a dead owner of `uid` may have left. Caller holds the uid's lock."""
    if uid != 0 and os.geteuid() == 0 and uid != os.getuid():
        kill_uid(uid)
    if layout is not None and layout.version and not keep_cgroup:
        for d in [*layout.slot_dirs(uid).values(), *layout.slot_dirs(uid, "b").values()]:
            try:
                cgroups.remove_dir(d)
            except OSError:
                pass
    sd = _slot_dir(cfg, uid)
    work = os.path.join(sd, "work")
    mps = _mountpoints()
    if work in mps:
        _umount(work)
    if os.path.isdir(sd) and not os.path.islink(sd):
        shutil.rmtree(sd, ignore_errors=True)


def sweep_stale(cfg: SandboxConfig, layout: cgroups.CgroupLayout | None) -> list[int]:
    """Cleans slots (processes, mounts, cgroups, dirs) whose owner is gone. Returns their uids."""
    cand: set[int] = set()
    try:
        cand |= {int(n) for n in os.listdir(os.path.join(cfg.state_dir, "slots")) if n.isdigit()}
    except OSError:
        pass
    if layout is not None:
        for gd in layout.group_dirs():
            try:
                cand |= {int(n[1:]) for n in os.listdir(gd) if n[:1] in ("u", "b") and n[1:].isdigit()}
            except OSError:
                pass
    swept = []
    for uid in sorted(cand):
        if not (cfg.uid_base <= uid < cfg.uid_base + cfg.uid_count):
            continue
        fd = _try_lock(cfg, uid)
        if fd is None:
            continue
        try:
            _sweep_uid(cfg, layout, uid)
            swept.append(uid)
        finally:
            os.close(fd)
    if layout is not None and swept:
        cgroups.remove_group_dirs(layout)
    return swept


def _read_uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
