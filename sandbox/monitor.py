"""The run monitor: one launched sandbox watched from launch to verdict.

`supervise` reads the program's stdout and stderr (capped, the rest counted as truncation) and
bwrap's JSON status channel, enforces the wall-clock deadline and the output limit by SIGKILLing
the launcher, the sandbox's pid 1 (whose death ends its whole pid namespace) and the slot cgroups,
then waits for the sandbox to be gone (`reap_sandbox`) and turns what happened into a status
(`classify`: timeout, output_limit, memory, sandbox_error, ok, error). No exit code from bwrap
means the program never started: that is a sandbox_error, never the program's verdict.
Not covered here: launching (sandbox/executor.py) and cgroup files (sandbox/cgroups.py).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

from . import cgroups
from .host import _read_uid_of, kill_uid, pids_of_uid
from .result import ExecutionResult


def supervise(proc, req: dict, t0: float, out_r: int, err_r: int, st_r: int, timeout_s: float, *,
              cg: cgroups.SlotCgroup | None, uid: int | None, root: bool,
              status_channel: bool = True,
              background: dict | None = None) -> tuple[ExecutionResult, str | None]:
    """Watches one launched sandbox to its end: reads stdout/stderr (each capped at the request's
    output_limit_bytes) and bwrap's JSON status channel (the sandbox's pid 1, then the program's
    exit code); on the deadline or an output overflow kills the launcher, the sandbox's pid 1
    (through a pidfd, only if it runs as `uid`) and the cgroups; then reaps the sandbox and
    classifies the run. Returns (result, broken): broken says why the slot must not run again
    (a process survived SIGKILL), else None. status_channel=False (isolation="none"): the exit
    code is the launcher's own.

    background (a dict; a session's start command, sandbox/session.py, launched without
    --die-with-parent): once bwrap reports the program's exit code, what is in the pipes already
    is read without waiting for their end (processes it left running may hold them open) and
    the run is over; unless it was killed, the pipes, the pidfd and pid of the sandbox's pid 1
    are handed over in `background` ("out_r", "err_r", "pidfd", "pid") instead of being closed,
    and the sandbox is left running."""
    limit = req["output_limit_bytes"]
    deadline = t0 + timeout_s
    bufs = {out_r: bytearray(), err_r: bytearray()}
    trunc = {out_r: False, err_r: False}
    status_buf = bytearray()
    child_pid = None
    pidfd = None
    exit_code = None
    killed_for = None
    poller = select.poll()
    open_fds = {out_r, err_r, st_r}
    for fd in open_fds:
        poller.register(fd, select.POLLIN)

    def kill_tree():
        try:
            proc.kill()
        except OSError:
            pass
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
        if cg is not None:
            for d in cg.dirs.values():
                kf = os.path.join(d, "cgroup.kill")
                if os.path.exists(kf):
                    try:
                        with open(kf, "w") as f:
                            f.write("1")
                    except OSError:
                        pass

    detached = False

    def take(fd: int, chunk: bytes) -> None:
        nonlocal killed_for
        buf = bufs[fd]
        room = limit - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > room:
            trunc[fd] = True
            if killed_for is None:
                killed_for = "output_limit"
                kill_tree()

    try:
        while open_fds:
            now = time.monotonic()
            if killed_for is None and now >= deadline:
                killed_for = "timeout"
                kill_tree()
            wait_ms = 1000 if killed_for else max(0, int((deadline - now) * 1000) + 1)
            events = poller.poll(min(wait_ms, 1000))
            if killed_for and not events and time.monotonic() > deadline + 10:
                break  # pipes held open by something we cannot kill: give up on them
            for fd, _ev in events:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                if fd == st_r:
                    status_buf += chunk
                    while b"\n" in status_buf:
                        line, _, rest = bytes(status_buf).partition(b"\n")
                        status_buf = bytearray(rest)
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if "child-pid" in msg and child_pid is None:
                            child_pid = int(msg["child-pid"])
                            try:
                                pidfd = os.pidfd_open(child_pid)
                                if _read_uid_of(child_pid) != uid:
                                    os.close(pidfd)
                                    pidfd = None
                            except OSError:
                                pidfd = None
                            if killed_for:
                                kill_tree()
                        if "exit-code" in msg:
                            exit_code = int(msg["exit-code"])
                    continue
                take(fd, chunk)
            if background is not None and exit_code is not None and killed_for is None:
                for fd in (out_r, err_r):  # written before the program exited: there already
                    while fd in open_fds and killed_for is None:
                        try:
                            chunk = os.read(fd, 65536) if select.select([fd], [], [], 0)[0] else None
                        except OSError:
                            chunk = b""
                        if chunk is None:
                            break
                        if not chunk:
                            open_fds.discard(fd)
                        else:
                            take(fd, chunk)
                detached = killed_for is None
                break
        if killed_for and proc.poll() is None:
            kill_tree()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree()
            proc.wait()
        wall = time.monotonic() - t0
        if detached:
            broken = None
            background.update(out_r=out_r, err_r=err_r, pidfd=pidfd, pid=child_pid)
        else:
            if killed_for and cg is not None and background is not None:
                cg.kill_all()  # a start command's sandbox has no parent-death signal
            broken = reap_sandbox(pidfd, cg, root, uid)
    finally:
        for fd in ((st_r,) if detached else (out_r, err_r, st_r)):
            try:
                os.close(fd)
            except OSError:
                pass
        if pidfd is not None and not detached:
            os.close(pidfd)
    if not status_channel and proc.returncode is not None:
        rc = proc.returncode
        exit_code = rc if rc >= 0 else 128 - rc
    oom = cg.oom_killed_since_last() if cg is not None else False
    peak = cg.run_peak_bytes() if cg is not None else None
    if cg is not None and not detached:
        cg.trim()
    stdout, stderr = _decode(bytes(bufs[out_r])), _decode(bytes(bufs[err_r]))
    res = ExecutionResult(status="ok", exit_code=exit_code, stdout=stdout, stderr=stderr,
                          wall_s=wall, stdout_truncated=trunc[out_r],
                          stderr_truncated=trunc[err_r],
                          memory_peak_mb=round(peak / 2**20, 2) if peak is not None else None)
    classify(res, killed_for, oom, req, started=exit_code is not None,
             launcher_rc=proc.returncode)
    return res, broken


def reap_sandbox(pidfd: int | None, cg: cgroups.SlotCgroup | None, root: bool,
                 uid: int | None) -> str | None:
    """Waits until the sandbox's pid 1 (hence its whole pid namespace) is gone; reaps it.
    Returns why the slot is broken (never reused) when its processes cannot all be killed."""
    if pidfd is not None:
        r, _, _ = select.select([pidfd], [], [], 10.0)
        if not r:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            select.select([pidfd], [], [], 10.0)
        try:  # we are its subreaper once the monitor exits (pool workers set that)
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        except (ChildProcessError, OSError):
            pass
    if cg is not None:
        if cg.pids() and not cg.kill_all():
            return f"processes of the slot cgroup survive SIGKILL: {cg.pids()[:10]}"
    elif root and uid:
        if pids_of_uid(uid) and not kill_uid(uid):
            return f"processes of uid {uid} survive SIGKILL"
    return None


def classify(res: ExecutionResult, killed_for, oom, req, started, launcher_rc) -> None:
    code = res.exit_code
    if code is not None and 128 < code <= 128 + 64:
        res.signal = code - 128
    if killed_for == "timeout":
        res.status, res.message = "timeout", f"wall-clock limit of {req['timeout_s']:g}s exceeded"
    elif killed_for == "output_limit":
        res.status = "output_limit"
        res.message = f"output exceeded {req['output_limit_bytes']} bytes"
    elif oom:
        res.status, res.message = "memory", f"memory limit of {req['memory_mb']} MB exceeded"
    elif not started:
        res.status = "sandbox_error"
        res.exit_code = None
        res.message = f"sandbox setup failed (launcher exit {launcher_rc}): {res.stderr.strip()[-2000:]}"
    elif code == 0:
        res.status = "ok"
    elif code == 128 + signal.SIGXCPU:
        res.status, res.message = "timeout", "CPU-time limit exceeded"
    elif _looks_like_oom(res.stderr, req["language"]):
        res.status, res.message = "memory", "the program ran out of memory"
    else:
        res.status = "error"


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def _looks_like_oom(stderr: str, language: str) -> bool:
    tail = stderr[-2000:]
    if language == "python":
        lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
        return bool(lines) and lines[-1].startswith("MemoryError")
    return "Cannot allocate memory" in tail or "xmalloc: cannot allocate" in tail
