"""One isolated execution slot: bubblewrap + unprivileged uid + seccomp + cgroups + rlimits.

A `Slot` owns, for its lifetime:
  - a uid (and gid) of its own, taken from a range by `flock` on a lock file, so several pools and
    processes on one machine never share one; processes of that uid are the slot's processes;
  - a working directory: a size- and inode-capped tmpfs mounted on the host (owned by the slot uid),
    bound read-write at /work in the sandbox; emptied after every run (or sequence of runs);
  - a program directory bound read-only at /sandbox (the program being run, /sandbox/main.py or
    /sandbox/main.sh) and a synthetic /etc (passwd, group, hosts);
  - one pre-created cgroup per hierarchy (memory, pids; v1 or v2), reused by every run.

A run is launched as

  dash -c 'echo $$ > <slot cgroup.procs>...; ulimit ...; exec "$@"'  (root, attaches the cgroups)
    setpriv --reuid=U --regid=U --clear-groups --no-new-privs --bounding-set=-all   (drops root)
      bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session ...
            --seccomp FD --json-status-fd FD -- /usr/bin/python3 -S -B /sandbox/main.py

with an empty environment from the first exec on (bwrap's pid 1 would expose its environment via
/proc/1/environ). bwrap reports the pid of the sandbox's pid 1 and, only if the program was
exec'd, its exit code; no exit code means the sandbox itself failed (`sandbox_error`). On the
deadline or an output overflow the monitor and the sandbox's pid 1 are SIGKILLed, which kills the
whole pid namespace; the slot then waits on a pidfd for that pid 1 to be gone (reaping it when the
worker process is its subreaper) and checks the slot cgroup is empty, so no process of the slot
survives a run.

This module is the slot: set-up, the /work lifecycle, running and teardown. Its parts live in one
file per job: sandbox/config.py (SandboxConfig and the errors), sandbox/host.py (uid locks,
/proc, kills, mounts, sweeping), sandbox/preflight.py (`check_isolation`), sandbox/launch.py (the
command line of a run: launcher, rlimits, bwrap options, environment, program), sandbox/monitor.py
(watching a launched run to its verdict) and sandbox/workfiles.py (files into and out of /work).
Names other modules import from here (SandboxConfig, IsolationUnavailable, UnisolatedWarning,
check_isolation, ...) are re-exported.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
import warnings

from . import cgroups, seccomp
from .config import (
    INSTALL_HINT,
    IsolationUnavailable,
    SandboxConfig,
    SlotBroken,
    UnisolatedWarning,
)
from .host import (
    MNT_DETACH,
    _ensure_state_dir,
    _libc,
    _mount_tmpfs,
    _slot_dir,
    _sweep_uid,
    _try_lock,
    kill_uid,
    set_child_subreaper,  # noqa: F401 - re-exported (benchmarks/sandbox_pool.py imports it here)
    sweep_stale,
)
from .launch import (
    ISOLATED_ENV,
    bwrap_args,
    env_args,
    rlimits,
    shell_launcher,
    write_etc,
    write_program,
)
from .monitor import supervise
from .preflight import _which, check_isolation
from .result import ExecutionResult, normalize_request
from .workfiles import clear_dir, place_files, read_back


class Slot:
    """One isolated execution slot (not thread-safe: one run at a time)."""

    def __init__(self, cfg: SandboxConfig | None = None, *, sweep: bool = True,
                 layout: cgroups.CgroupLayout | None = None) -> None:
        """Runs are launched through vfork+exec of dash + setpriv (safe from any thread and,
        measured, cheaper than forking the caller)."""
        self.cfg = cfg = cfg or SandboxConfig()
        self.uid: int | None = None
        self._lock_fd: int | None = None
        self.cg: cgroups.SlotCgroup | None = None
        self.layout: cgroups.CgroupLayout | None = None
        self.features: dict = {}
        self._closed = False
        self.broken: str | None = None  # why this slot must not run again (see SlotBroken)
        self.resets = 0
        self.none_mode = cfg.isolation == "none"
        self._given_layout = layout
        if cfg.isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be 'bwrap' or 'none', got {cfg.isolation!r}")
        if self.none_mode:
            warnings.warn("sandbox isolation='none': code runs UNISOLATED on this host "
                          "(trusted local debugging only)", UnisolatedWarning, stacklevel=2)
            self._init_none()
            return
        problems = check_isolation(cfg)
        if problems:
            raise IsolationUnavailable("cannot isolate untrusted code: " + "; ".join(problems))
        self.bwrap = _which(cfg.bwrap, "bwrap")
        self.root = os.geteuid() == 0
        try:
            self._init_bwrap(sweep)
        except BaseException:
            self.close()
            raise

    # ---- setup ------------------------------------------------------------------------------
    def _init_none(self) -> None:
        import tempfile

        self.root = False
        self.work_tmpfs = False

        self.workdir = tempfile.mkdtemp(prefix="kimi-sandbox-none-")
        self.progdir = tempfile.mkdtemp(prefix="kimi-sandbox-none-prog-")
        self.features = {"isolation": "none"}
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _init_bwrap(self, sweep: bool) -> None:
        cfg = self.cfg
        if self.root:
            _ensure_state_dir(cfg)
            self.layout = self._given_layout or cgroups.CgroupLayout()
            if sweep:
                sweep_stale(cfg, self.layout)
            for i in range(cfg.uid_count):
                fd = _try_lock(cfg, cfg.uid_base + i)
                if fd is not None:
                    self.uid, self._lock_fd = cfg.uid_base + i, fd
                    break
            if self.uid is None:
                raise IsolationUnavailable("all sandbox uids are in use")
            _sweep_uid(cfg, self.layout, self.uid, keep_cgroup=True)
            sd = _slot_dir(cfg, self.uid)
            os.makedirs(sd, mode=0o711)
        else:
            # Not root: no uid switch, no cgroups, no host mount. Namespaces and seccomp still apply.
            self.uid = os.getuid()
            base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
            import tempfile

            sd = tempfile.mkdtemp(prefix="kimi-sandbox-", dir=base)
        self.slot_dir = sd
        self.workdir = os.path.join(sd, "work")
        self.progdir = os.path.join(sd, "prog")
        self.etcdir = os.path.join(sd, "etc")
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        os.makedirs(self.progdir, mode=0o755, exist_ok=True)
        os.makedirs(self.etcdir, mode=0o755, exist_ok=True)
        self.work_tmpfs = False
        if self.root:
            try:
                self._mount_work()
                self.work_tmpfs = True
            except OSError:
                os.chown(self.workdir, self.uid, self.uid)
        self._write_etc()
        cg_ok = False
        if self.root and self.layout is not None and self.layout.version:
            self.cg = cgroups.SlotCgroup(self.layout, self.uid)
            cg_ok = True
        if not cg_ok:
            reason = self.layout.reason if self.layout is not None else "not root"
            if cfg.require_cgroups:
                raise IsolationUnavailable(f"no memory/pids cgroups: {reason}")
            warnings.warn(f"sandbox: no memory/pids cgroups ({reason}); limits fall back to "
                          "rlimits (RLIMIT_AS; RLIMIT_NPROC as root)", RuntimeWarning, stacklevel=3)
        elif cfg.cpu_quota is not None and not self.layout.cpu:
            if cfg.require_cgroups:
                raise IsolationUnavailable(f"no cpu cgroup for cpu_quota: {self.layout.cpu_reason}")
            warnings.warn(f"sandbox: no CPU quota per sandbox ({self.layout.cpu_reason})",
                          RuntimeWarning, stacklevel=3)
        self.seccomp_prog = seccomp.build_filter()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._static_args = self._bwrap_static_args()
        self._env = {False: self._env_args(False), True: self._env_args(True)}
        self.features = {
            "isolation": "bwrap",
            "bwrap": self.bwrap,
            "uid": self.uid,
            "unprivileged_uid": self.uid != 0,
            "root_launcher": self.root,
            "namespaces": ["user", "pid", "net", "ipc", "uts", "cgroup", "mnt"],
            "nested_userns_disabled": True,
            "capabilities": "none",
            "seccomp": seccomp.describe(),
            "cgroups": self.layout.describe() if self.layout else {"version": None},
            "work_tmpfs": self.work_tmpfs,
            "tmp_tmpfs_mb": cfg.tmp_mb,
            "max_procs": cfg.max_procs,
            "cpu_quota": cfg.cpu_quota if self.cg is not None and self.layout.cpu else None,
            "address_space_limit": "off (memory cgroup)" if (self.cg is not None and
                                                             cfg.address_space_mb is None)
            else (f"{cfg.address_space_mb} MB" if cfg.address_space_mb else "memory_mb + 4096 MB"),
            "fresh_work_mount_per_run": self.work_tmpfs,
        }
        # Probe once: catches missing user namespaces, broken mounts, etc. with bwrap's own words.
        probe = self._run_bwrap(normalize_request("", language="bash", timeout_s=20.0, memory_mb=256))
        if probe.status != "ok":
            msg = (probe.stderr or probe.message).strip()
            raise IsolationUnavailable(
                f"bubblewrap could not start a sandbox ({msg or probe.status}). Check that user "
                "namespaces are enabled (user.max_user_namespaces > 0, and on Debian "
                f"kernel.unprivileged_userns_clone=1) and that bubblewrap works: {INSTALL_HINT}")

    def _write_etc(self) -> None:
        write_etc(self.etcdir, self.uid)

    def _bwrap_static_args(self) -> list[str]:
        return bwrap_args(self.bwrap, self.cfg, self.etcdir, self.workdir, self.progdir)

    def _env_args(self, isolated: bool) -> list[str]:
        return env_args(self.cfg, isolated)

    def info(self) -> dict:
        return dict(self.features)

    # ---- files --------------------------------------------------------------------------------
    def _place_files(self, files: dict[str, bytes]) -> None:
        """Request files into /work (sandbox/workfiles.py), owned by the slot uid under root."""
        place_files(self.workdir, files, self.uid if self.root and not self.none_mode else None)

    def _attach_collected(self, r: ExecutionResult, req: dict) -> None:
        """The request's `collect` files into r.files (notes on what could not be read join
        r.message)."""
        if req.get("collect"):
            files, notes = self._read_back(req["collect"], req.get("collect_limit_bytes", 1 << 20))
            r.files = files
            if notes:
                r.message = "; ".join(filter(None, [r.message] + notes))

    def _read_back(self, paths: list[str], limit: int) -> tuple[dict[str, bytes], list[str]]:
        """Files from /work (sandbox/workfiles.py): no link followed, regular files, capped."""
        return read_back(self.workdir, paths, limit)

    # ---- the working directory: a fresh mount per run or sequence ---------------------------
    def _mount_work(self) -> None:
        _mount_tmpfs(self.workdir, f"size={self.cfg.work_mb}m,nr_inodes={self.cfg.work_inodes},"
                     f"mode=0700,uid={self.uid},gid={self.uid}")

    def _work_is_fresh(self) -> bool:
        """/work is empty (and, with a host tmpfs, is its own mount, owned by the slot uid)."""
        try:
            if self.work_tmpfs:
                st, parent = os.lstat(self.workdir), os.lstat(self.slot_dir)
                if st.st_dev == parent.st_dev or st.st_uid != self.uid or \
                        stat.S_IMODE(st.st_mode) != 0o700:
                    return False
            with os.scandir(self.workdir) as it:
                return next(it, None) is None
        except OSError:
            return False

    def _reset_workdir(self) -> None:
        """Gives /work a fresh, empty filesystem; raises SlotBroken if it cannot.

        With a host tmpfs (root) the old mount is detached lazily and a new one mounted: nothing a
        program left (a tree 10,000 deep, FIFOs, unreadable or oddly named files, a full disk, no
        inodes left) is ever walked. Without one (not root) the old directory is renamed away and
        removed by `rm -rf` (iterative, any depth) after its permissions are restored, unless the
        quick in-process removal already succeeded.
        """
        self.resets += 1
        try:
            if self.work_tmpfs:
                for _ in range(8):  # detach every mount stacked there (normally exactly one)
                    if _libc.umount2(self.workdir.encode(), MNT_DETACH) != 0:
                        break
                self._mount_work()
            else:
                try:  # the common case, in-process; anything odd -> rename away, rm -rf
                    clear_dir(self.workdir)
                except (OSError, RecursionError):
                    trash = f"{self.workdir}.old{self.resets}"
                    os.rename(self.workdir, trash)
                    os.mkdir(self.workdir, 0o700)
                    if self.root:
                        os.chown(self.workdir, self.uid, self.uid)
                    subprocess.run(["chmod", "-R", "u+rwx", trash], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=120)
                    subprocess.run(["rm", "-rf", "--one-file-system", trash],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            self.broken = f"cannot reset the working directory: {e}"
            raise SlotBroken(self.broken) from e
        if not self._work_is_fresh():
            self.broken = "the working directory is not empty after a reset"
            raise SlotBroken(self.broken)

    def _restore_work_root(self) -> None:
        """Between steps of a sequence: /work itself back to the slot's 0700 directory. A step
        may chmod it (it owns it); the next step's sandbox could not even chdir there, and a
        sandbox_error caused by the program (which a trainer may skip rather than score 0)
        must not be possible."""
        if self.none_mode:
            os.chmod(self.workdir, 0o700)
            return
        try:  # the host path and the mount root: nothing the program can swap for a link
            os.chown(self.workdir, self.uid, self.uid)
            os.chmod(self.workdir, 0o700)
        except OSError as e:
            self.broken = f"cannot restore the working directory between steps: {e}"
            raise SlotBroken(self.broken) from e

    # ---- running ----------------------------------------------------------------------------
    def run(self, req: dict) -> ExecutionResult:
        """Runs one normalised request (see result.normalize_request); the work dir is reset after."""
        return self.run_sequence([req])[0]

    def run_sequence(self, reqs: list[dict]) -> list[ExecutionResult]:
        """Runs requests one after another in this slot sharing /work; resets /work at the end.

        Each step is its own sandbox (no process survives from one step to the next), so a check
        script run as a later step sees the files an earlier step left but nothing else of it.
        A step whose files cannot be placed over what an earlier step left (a link, a FIFO, a
        directory, a full disk) is not run and comes back as "error" saying why.

        Raises SlotBroken (after resetting what it can) when the slot cannot guarantee a clean
        next run; `self.broken` then says why, and the slot must not be used again.
        """
        if self._closed:
            raise RuntimeError("slot is closed")
        if self.broken:
            raise SlotBroken(self.broken)
        if not self._work_is_fresh():
            self._reset_workdir()
        results = []
        try:
            for k, req in enumerate(reqs):
                if k:
                    self._restore_work_root()
                try:
                    self._place_files(req.get("files") or {})
                except OSError as e:
                    who = "left by an earlier step" if k else "in a fresh working directory"
                    r = ExecutionResult(status="error" if k else "sandbox_error",
                                        message=f"could not place files ({who}): {e.strerror or e}")
                    results.append(r)
                    continue
                if self.none_mode:
                    r = self._run_none(req)
                else:
                    r = self._run_bwrap(req)
                self._attach_collected(r, req)
                results.append(r)
        finally:
            try:
                self._reset_workdir()
            except SlotBroken:
                pass  # self.broken says why: the owner replaces this slot after this answer
        return results

    def _stdin_fd(self, data: bytes | None) -> tuple[int, bool]:
        if data is None:
            return self._devnull, False
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd, True

    def _limits(self, req: dict, timeout_s: float) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) rlimits of a run: backstops behind the cgroups."""
        return rlimits(self.cfg, req, timeout_s, memory_cgroup=self.cg is not None, root=self.root)

    def _run_bwrap(self, req: dict) -> ExecutionResult:
        timeout_s = req["timeout_s"]
        if self.cg is not None:
            max_procs = req.get("max_procs") or self.cfg.max_procs
            # + bwrap monitor and init; resets the peak and notes the usage it starts from
            self.cg.set_limits(req["memory_mb"] << 20, max_procs + 2, self.cfg.cpu_quota)
        cmd, prog_fd = write_program(self.cfg, self.progdir, req)
        sc_r, sc_w = os.pipe2(os.O_CLOEXEC)
        os.write(sc_w, self.seccomp_prog)  # < pipe buffer: never blocks
        os.close(sc_w)
        st_r, st_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        stdin_fd, own_stdin = self._stdin_fd(req.get("stdin"))
        tail = (self._static_args + self._env[bool(req.get("isolated"))]
                + ["--seccomp", str(sc_r), "--json-status-fd", str(st_w), "--"] + cmd)
        passed = (sc_r, st_w) if prog_fd is None else (sc_r, st_w, prog_fd)
        procs = self.cg.procs_files if self.cg is not None else []
        argv = shell_launcher(self.cfg, self._limits(req, timeout_s), procs, self.root, self.uid) + tail
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=out_w, stderr=err_w,
                                    pass_fds=passed, env={}, cwd="/", close_fds=True,
                                    start_new_session=True)
        except (OSError, subprocess.SubprocessError) as e:
            for fd in (sc_r, st_r, st_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            if own_stdin:
                os.close(stdin_fd)
            if prog_fd is not None:
                os.close(prog_fd)
            return ExecutionResult.sandbox_error(f"cannot launch sandbox: {e}")
        for fd in (sc_r, st_w, out_w, err_w):
            os.close(fd)
        if prog_fd is not None:
            os.close(prog_fd)
        if own_stdin:
            os.close(stdin_fd)
        return self._supervise(proc, req, t0, out_r, err_r, st_r, timeout_s)

    def _supervise(self, proc, req, t0, out_r, err_r, st_r, timeout_s,
                   status_channel: bool = True) -> ExecutionResult:
        """The run monitor (sandbox/monitor.py) on this slot's cgroup and uid; a slot whose
        processes survive SIGKILL is marked broken (never reused)."""
        res, broken = supervise(proc, req, t0, out_r, err_r, st_r, timeout_s, cg=self.cg,
                                uid=self.uid, root=self.root, status_channel=status_channel)
        if broken:
            self.broken = broken
        return res

    # ---- isolation="none" -------------------------------------------------------------------
    def _run_none(self, req: dict) -> ExecutionResult:
        cmd, prog_fd = write_program(self.cfg, self.progdir, req, in_sandbox=False)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        st_r, st_w = os.pipe2(os.O_CLOEXEC)
        os.close(st_w)  # no status channel: EOF at once
        stdin_fd, own = self._stdin_fd(req.get("stdin"))
        if req.get("isolated"):
            env = dict(ISOLATED_ENV)
        else:
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.workdir, "LANG": "C.UTF-8",
                   "PYTHONPATH": self.workdir}
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=stdin_fd, stdout=out_w, stderr=err_w, env=env,
                                    cwd=self.workdir, close_fds=True, start_new_session=True,
                                    pass_fds=() if prog_fd is None else (prog_fd,))
        finally:
            if prog_fd is not None:
                os.close(prog_fd)
        os.close(out_w)
        os.close(err_w)
        if own:
            os.close(stdin_fd)

        class _P:  # kill the process group rather than the process
            def __init__(self, p):
                self.p, self.pid = p, p.pid

            def kill(self):
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except OSError:
                    pass

            def poll(self):
                return self.p.poll()

            def wait(self, timeout=None):
                return self.p.wait(timeout)

            @property
            def returncode(self):
                return self.p.returncode

        res = self._supervise(_P(proc), req, t0, out_r, err_r, st_r, req["timeout_s"],
                              status_channel=False)
        res.message = (res.message + " [UNISOLATED]").strip()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        return res

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.close(self._devnull)
        except (AttributeError, OSError):
            pass
        if self.none_mode:
            shutil.rmtree(self.workdir, ignore_errors=True)
            shutil.rmtree(self.progdir, ignore_errors=True)
            return
        if getattr(self, "root", False) and self.uid is not None and self._lock_fd is not None:
            if self.cg is not None:
                self.cg.kill_all()
                try:
                    self.cg.remove()
                except OSError:
                    pass
            kill_uid(self.uid)
            _sweep_uid(self.cfg, self.layout, self.uid)
        elif hasattr(self, "slot_dir") and not getattr(self, "root", False):
            shutil.rmtree(self.slot_dir, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
