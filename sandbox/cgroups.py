"""cgroup v1 / v2 detection and one pre-created cgroup per sandbox slot.

Layout (nested under the caller's own cgroup, so the caller's limits still apply; a session's
background processes get a second cgroup `b<UID>` next to `u<UID>`):

  v1: <mount of controller>/<caller's path for that controller>/kimi-sandbox/u<UID>   for memory,
      pids and (when mounted and writable) cpu
  v2: <cgroup2 mount>/<caller's path>/kimi-sandbox/u<UID>   (memory, pids and, when delegated,
      cpu enabled on the way)

memory and pids are required; cpu is optional (the CPU quota per sandbox). Where it is missing,
`CgroupLayout.cpu` is False and `describe()` says why.

A slot's cgroup is created once and reused for every run of that slot: attaching a process to a
freshly created cgroup costs 6-16 ms per v1 hierarchy; a warm one costs tens of microseconds.
Processes are attached by the launcher shell (`echo $$ > cgroup.procs`) before it drops privileges
and execs bubblewrap, so every process of a run is accounted from its first instruction.
"""

from __future__ import annotations

import errno
import os
import signal
import time

GROUP = "kimi-sandbox"
CONTROLLERS = ("memory", "pids")
OPTIONAL = ("cpu",)
CPU_PERIOD_US = 100_000


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, list[str]]]:
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                lparts, rparts = left.split(), right.split()
                if len(rparts) < 3 or len(lparts) < 5:
                    continue
                fstype, opts = rparts[0], rparts[2].split(",")
                mnt = lparts[4].replace("\\040", " ")
                if fstype in ("cgroup", "cgroup2"):
                    out.append((fstype, mnt, opts + lparts[5].split(",")))
    except OSError:
        pass
    return out


def _self_cgroups() -> dict[str, str]:
    """controller name (or '' for the v2 unified hierarchy) -> path of this process."""
    res: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                _, ctrls, path = parts
                if ctrls == "":
                    res[""] = path
                for c in ctrls.split(","):
                    if c:
                        res[c] = path
    except OSError:
        pass
    return res


class CgroupSetupError(RuntimeError):
    pass


class CgroupLayout:
    """Where the slot cgroups live on this machine (or why they can't)."""

    def __init__(self) -> None:
        self.version: str | None = None  # "v1", "v2" or None
        self.reason = ""
        self.v1_parents: dict[str, str] = {}  # controller -> dir that holds kimi-sandbox/
        self.v2_parent: str | None = None
        self.nested_under = "caller"
        self.cpu = False
        self.cpu_reason = ""
        self._detect()

    def _detect(self) -> None:
        if os.geteuid() != 0:
            self.reason = "not root: cannot create cgroups"
            return
        mounts = _mounts()
        mine = _self_cgroups()
        v1 = {}
        for fstype, mnt, opts in mounts:
            if fstype == "cgroup":
                for c in CONTROLLERS + OPTIONAL:
                    if c in opts and c not in v1 and c in mine:
                        v1[c] = os.path.join(mnt, mine[c].lstrip("/"))
        if all(c in v1 for c in CONTROLLERS):
            ok = all(os.path.isdir(v1[c]) and os.access(v1[c], os.W_OK) for c in CONTROLLERS)
            if ok:
                self.version = "v1"
                cpu = v1.get("cpu")
                if cpu and os.path.isdir(cpu) and os.access(cpu, os.W_OK) and \
                        os.path.exists(os.path.join(cpu, "cpu.cfs_quota_us")):
                    self.cpu = True
                else:
                    v1.pop("cpu", None)
                    self.cpu_reason = "cgroup v1 has no writable cpu controller with CFS quota"
                self.v1_parents = v1
                return
        v2mnt = [mnt for fstype, mnt, _ in mounts if fstype == "cgroup2"]
        if v2mnt and "" in mine:
            root = v2mnt[0]
            base = os.path.join(root, mine[""].lstrip("/"))
            errors = []
            # Nested under the caller's cgroup; if cgroup v2's no-internal-process rule makes that
            # impossible (other processes share it), under its parent, next to it.
            cands = [(base, "caller")]
            if os.path.normpath(base) != os.path.normpath(root):
                cands.append((os.path.dirname(base), "caller's parent"))
            for cand, where in cands:
                try:
                    avail = _read(os.path.join(cand, "cgroup.controllers")).split()
                except OSError as e:
                    errors.append(f"{cand}: {e}")
                    continue
                if not all(c in avail for c in CONTROLLERS):
                    errors.append(f"{cand} does not delegate {'/'.join(CONTROLLERS)} (has {avail})")
                    continue
                try:
                    self._v2_prepare(cand, is_root=os.path.normpath(cand) == os.path.normpath(root),
                                     is_own=where == "caller")
                except (OSError, CgroupSetupError) as e:
                    errors.append(f"{cand}: {e}")
                    continue
                self.version, self.v2_parent, self.nested_under = "v2", cand, where
                self._v2_enable_cpu(cand, avail)
                return
            self.reason = "cgroup v2: " + "; ".join(errors)
            if v1:
                self.reason += f"; cgroup v1 has only {sorted(v1)}"
            return
        self.reason = "no usable memory+pids cgroup hierarchy found"

    @staticmethod
    def _v2_prepare(base: str, is_root: bool, is_own: bool) -> None:
        """Enables memory+pids for children of `base`.

        cgroup v2 forbids processes in a (non-root) cgroup whose children have controllers
        enabled. If `base` is the caller's cgroup and holds only this process, the process moves
        into a leaf `base/kimi-sandbox-host` first; processes that are not ours are never moved.
        """
        ctl_path = os.path.join(base, "cgroup.subtree_control")
        have = _read(ctl_path).split()
        need = [c for c in CONTROLLERS if c not in have]
        if not need:
            return
        try:
            _write(ctl_path, " ".join("+" + c for c in need))
            return
        except OSError as e:
            if e.errno != errno.EBUSY or is_root:
                raise
        procs = [int(p) for p in _read(os.path.join(base, "cgroup.procs")).split()]
        if not is_own or set(procs) - {os.getpid()}:
            raise CgroupSetupError(
                f"{base} holds other processes, so memory/pids cannot be enabled for sub-cgroups "
                "(cgroup v2 no-internal-process rule); run the sandbox from its own cgroup "
                "(e.g. systemd-run --scope) to nest its cgroups there")
        leaf = os.path.join(base, GROUP + "-host")
        os.makedirs(leaf, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
        _write(ctl_path, " ".join("+" + c for c in need))

    def _v2_enable_cpu(self, base: str, avail: list[str]) -> None:
        if "cpu" not in avail:
            self.cpu_reason = f"{base} does not delegate the cpu controller"
            return
        ctl = os.path.join(base, "cgroup.subtree_control")
        try:
            if "cpu" not in _read(ctl).split():
                _write(ctl, "+cpu")
            self.cpu = True
        except OSError as e:
            self.cpu_reason = f"cannot enable cpu in {ctl}: {e}"

    # ---- per slot -------------------------------------------------------------------------
    def slot_dirs(self, uid: int, prefix: str = "u") -> dict[str, str]:
        """The cgroup dirs of `uid`: `u<uid>` (the slot's or session's), `b<uid>` with
        prefix="b" (a session's background processes, sandbox/session.py)."""
        name = f"{prefix}{uid}"
        if self.version == "v1":
            return {c: os.path.join(p, GROUP, name) for c, p in self.v1_parents.items()}
        if self.version == "v2":
            return {"unified": os.path.join(self.v2_parent, GROUP, name)}
        return {}

    def group_dirs(self) -> list[str]:
        if self.version == "v1":
            return [os.path.join(p, GROUP) for p in self.v1_parents.values()]
        if self.version == "v2":
            return [os.path.join(self.v2_parent, GROUP)]
        return []

    def describe(self) -> dict:
        return {
            "version": self.version,
            "reason": self.reason,
            "parents": self.v1_parents if self.version == "v1" else self.v2_parent,
            "nested_under": self.nested_under if self.version else None,
            "cpu_quota": self.cpu,
            "cpu_reason": self.cpu_reason,
        }


def _pids_in(d: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def kill_all_in(d: str, timeout_s: float = 5.0) -> bool:
    """SIGKILLs every process in cgroup dir `d` until it is empty. Returns True when empty."""
    deadline = time.monotonic() + timeout_s
    kill_file = os.path.join(d, "cgroup.kill")
    while True:
        pids = _pids_in(d)
        if not pids:
            return True
        if os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def remove_dir(d: str) -> None:
    if not os.path.isdir(d):
        return
    kill_all_in(d)
    for _ in range(100):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.01)


class SlotCgroup:
    """The pre-created cgroup(s) of one slot: limits are written only when they change."""

    def __init__(self, layout: CgroupLayout, uid: int, prefix: str = "u") -> None:
        self.layout = layout
        self.version = layout.version
        self.dirs = layout.slot_dirs(uid, prefix)
        self._mem: int | None = None
        self._pids: int | None = None
        self._cpu: float | None | bool = False  # False = never written
        self._oom_seen = 0
        self._base = 0  # memory charged to the cgroup when the current run started
        self._peak_fd: int | None = None
        for attempt in range(5):  # another pool may remove an empty group dir concurrently
            try:
                self._make_dirs()
                break
            except FileNotFoundError:
                if attempt == 4:
                    raise
        if self.version == "v2":
            u = self.dirs["unified"]
            for fname, val in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                try:
                    _write(os.path.join(u, fname), val)
                except OSError:
                    pass
            try:  # since Linux 6.12 a write resets the peak seen through this same fd
                self._peak_fd = os.open(os.path.join(u, "memory.peak"), os.O_RDWR | os.O_CLOEXEC)
                os.write(self._peak_fd, b"reset")
            except OSError:
                if self._peak_fd is not None:
                    os.close(self._peak_fd)
                self._peak_fd = None
        self._oom_seen = self._read_oom()

    def _make_dirs(self) -> None:
        for gd in self.layout.group_dirs():
            os.makedirs(gd, exist_ok=True)
            if self.version == "v2":
                ctl = os.path.join(gd, "cgroup.subtree_control")
                have = _read(ctl).split()
                need = [c for c in CONTROLLERS + (OPTIONAL if self.layout.cpu else ())
                        if c not in have]
                if need:
                    _write(ctl, " ".join("+" + c for c in need))
        for d in self.dirs.values():
            if os.path.isdir(d):
                kill_all_in(d)
            else:
                os.mkdir(d)

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def _mem_dir(self) -> str:
        return self.dirs["memory"] if self.version == "v1" else self.dirs["unified"]

    def _pids_dir(self) -> str:
        return self.dirs["pids"] if self.version == "v1" else self.dirs["unified"]

    def _cpu_dir(self) -> str | None:
        if not self.layout.cpu:
            return None
        return self.dirs.get("cpu") if self.version == "v1" else self.dirs["unified"]

    def set_limits(self, memory_bytes: int, max_pids: int, cpu_quota: float | None = None) -> None:
        """Limits for the next run (written only when they change); then resets the memory peak
        and notes the memory already charged (page cache of earlier runs), so that
        run_peak_bytes() measures this run only."""
        md = self._mem_dir()
        if memory_bytes != self._mem:
            if self.version == "v1":
                lim = os.path.join(md, "memory.limit_in_bytes")
                sw = os.path.join(md, "memory.memsw.limit_in_bytes")
                has_sw = os.path.exists(sw)
                # memsw must stay >= limit: raise memsw first when growing, lower it last.
                cur = int(_read(lim).strip())
                if has_sw and memory_bytes > cur:
                    _write(sw, str(memory_bytes))
                    _write(lim, str(memory_bytes))
                else:
                    _write(lim, str(memory_bytes))
                    if has_sw:
                        _write(sw, str(memory_bytes))
            else:
                _write(os.path.join(md, "memory.max"), str(memory_bytes))
            self._mem = memory_bytes
        if max_pids != self._pids:
            _write(os.path.join(self._pids_dir(), "pids.max"), str(max_pids))
            self._pids = max_pids
        cd = self._cpu_dir()
        if cd is not None and cpu_quota != self._cpu:
            quota = int(cpu_quota * CPU_PERIOD_US) if cpu_quota is not None else None
            if self.version == "v1":
                _write(os.path.join(cd, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(cd, "cpu.cfs_quota_us"), str(quota if quota else -1))
            else:
                _write(os.path.join(cd, "cpu.max"), f"{quota or 'max'} {CPU_PERIOD_US}")
            self._cpu = cpu_quota
        if self.version == "v1":
            try:
                _write(os.path.join(md, "memory.max_usage_in_bytes"), "0")
            except OSError:
                pass
        elif self._peak_fd is not None:
            try:
                os.write(self._peak_fd, b"reset")
            except OSError:
                pass
        self._base = self._usage()

    def trim(self, keep_bytes: int = 64 << 20) -> None:
        """Between runs (no process in the cgroup): if more than 2*keep_bytes of page cache is
        still charged to the slot (a run read many files), reclaim it down to keep_bytes, so the
        next run's memory_peak_mb is not understated by cache reclaimed under its limit. Keeps
        the hot part (the interpreter's own pages)."""
        if self._usage() <= 2 * keep_bytes:
            return
        md = self._mem_dir()
        try:
            if self.version == "v1":
                lim = os.path.join(md, "memory.limit_in_bytes")
                prev = _read(lim).strip()
                try:
                    _write(lim, str(keep_bytes))
                except OSError:
                    pass  # EBUSY: could not shrink that far; what was reclaimed stays reclaimed
                _write(lim, prev)
            else:
                _write(os.path.join(md, "memory.reclaim"), str(self._usage() - keep_bytes))
        except OSError:
            pass

    def cpu_quota_written(self) -> float | None:
        """The quota in CPUs currently set on the slot cgroup (None: no quota or no controller)."""
        cd = self._cpu_dir()
        if cd is None:
            return None
        if self.version == "v1":
            q = int(_read(os.path.join(cd, "cpu.cfs_quota_us")))
            p = int(_read(os.path.join(cd, "cpu.cfs_period_us")))
            return None if q < 0 else q / p
        q, p = _read(os.path.join(cd, "cpu.max")).split()
        return None if q == "max" else int(q) / int(p)

    def _usage(self) -> int:
        fname = "memory.usage_in_bytes" if self.version == "v1" else "memory.current"
        try:
            return int(_read(os.path.join(self._mem_dir(), fname)).split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def _read_oom(self) -> int:
        md = self._mem_dir()
        fname = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            for line in _read(os.path.join(md, fname)).splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_killed_since_last(self) -> bool:
        n = self._read_oom()
        hit = n > self._oom_seen
        self._oom_seen = n
        return hit

    def memory_peak_bytes(self) -> int | None:
        """The cgroup's memory peak since the last reset (None where it cannot be reset: cgroup
        v2 before Linux 6.12, whose memory.peak is the lifetime maximum)."""
        try:
            if self.version == "v1":
                return int(_read(os.path.join(self._mem_dir(), "memory.max_usage_in_bytes")).split()[0])
            if self._peak_fd is None:
                return None
            return int(os.pread(self._peak_fd, 64, 0).split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def run_peak_bytes(self) -> int | None:
        """Memory this run added at its peak: the peak minus what was already charged when it
        started (cached pages of earlier runs stay charged to the slot's cgroup)."""
        peak = self.memory_peak_bytes()
        return None if peak is None else max(0, peak - self._base)

    def pids(self) -> list[int]:
        return _pids_in(self._pids_dir())

    def kill_all(self, timeout_s: float = 5.0) -> bool:
        ok = True
        for d in self.dirs.values():
            ok = kill_all_in(d, timeout_s) and ok
        return ok

    def remove(self) -> None:
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        for d in self.dirs.values():
            remove_dir(d)
        remove_group_dirs(self.layout)


def remove_group_dirs(layout: CgroupLayout) -> None:
    """Removes the `kimi-sandbox` group dirs when no slot cgroup is left in them (so the
    caller's cgroup can be removed by whoever owns it)."""
    for gd in layout.group_dirs():
        try:
            os.rmdir(gd)
        except OSError:
            pass  # other slots still live there, or already gone
