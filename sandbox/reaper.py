"""The reaper: removes what a pool's sessions and slots left when the process owning them dies.

A `SessionManager` (sandbox/session.py) starts one reaper process and tells it, over a pipe, each
uid it takes (its sessions' and its workers' slots) and each it gives back. The reaper does
nothing while the pipe is open. When the pipe reaches EOF without a goodbye (the owner was
killed, even by SIGKILL), it sweeps every uid it still knows once its lock is free (the owner's
lock fds close with it, its workers die of their parent-death signal): the uid's processes are
killed, the cgroups removed, the /work tmpfs detached and the slot directory deleted (the same
`_sweep_uid` the start-up sweep of every pool uses; a uid another process holds is never
touched). So killing the owner leaves no process, mount, cgroup or directory behind, without
waiting for the next pool to start.

Framing: sandbox/wire.py (8-byte length + pickle; both ends are this package). Messages:
{"config", "layout"} first, then {"add": uid}, {"remove": uid}, {"bye": True}.
Not covered: a reaper killed together with its owner (then the next pool's start-up sweep
removes it all, as before sessions existed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from . import wire as _wire

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_WAIT_S = 30.0  # how long a dead owner's uids may stay locked (its workers dying)


class ReaperHandle:
    """Owner side: starts the reaper and keeps it told which uids to sweep if this process dies."""

    def __init__(self, cfg, layout) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", "import sys; from sandbox.reaper import main; sys.exit(main())"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=_PKG_PARENT,
            close_fds=True, start_new_session=True)  # outlives its owner on purpose
        self._w = self.proc.stdin.fileno()
        self._send({"config": cfg, "layout": layout})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, msg: dict) -> None:
        with self._lock:
            if self.proc.stdin.closed:
                return
            try:
                _wire.write_msg(self._w, msg)
            except OSError:
                pass

    def add(self, uid: int) -> None:
        self._send({"add": int(uid)})

    def remove(self, uid: int) -> None:
        self._send({"remove": int(uid)})

    def close(self) -> None:
        """Owner closing normally: the reaper leaves without sweeping."""
        self._send({"bye": True})
        with self._lock:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def sweep(cfg, layout, uids: set[int], wait_s: float = SWEEP_WAIT_S) -> list[int]:
    """Sweeps each uid once its lock is free (within wait_s); returns the uids swept."""
    from .cgroups import remove_group_dirs
    from .host import _sweep_uid, _try_lock

    left, done = set(uids), []
    deadline = time.monotonic() + wait_s
    while left:
        for uid in sorted(left):
            fd = _try_lock(cfg, uid)
            if fd is None:
                continue
            try:
                _sweep_uid(cfg, layout, uid)
            finally:
                os.close(fd)
            left.discard(uid)
            done.append(uid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if layout is not None and done:
        remove_group_dirs(layout)
    return done


def main() -> int:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C for the owner is not for us
    rfd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    first = _wire.read_msg(rfd)
    if not first:
        return 1
    cfg, layout = first["config"], first["layout"]
    uids: set[int] = set()
    while True:
        try:
            msg = _wire.read_msg(rfd)
        except Exception:  # noqa: BLE001 - a torn message: the owner died mid-write
            msg = None
        if msg is None:  # the owner died
            sweep(cfg, layout, uids)
            return 0
        if msg.get("bye"):
            return 0
        if "add" in msg:
            uids.add(msg["add"])
        elif "remove" in msg:
            uids.discard(msg["remove"])


if __name__ == "__main__":
    sys.exit(main())
