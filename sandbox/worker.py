"""A pool worker process: owns one `Slot` and runs requests one at a time.

Started by `SandboxPool` (through sandbox/workers.py) as `python -S -c "... sandbox.worker import
main ..."` with a pipe on stdin (requests) and one on stdout (replies), framed by sandbox/wire.py.
Runs are launched with vfork+exec through dash and setpriv, which measured cheaper than forking
the worker to set up in the child. It is the child subreaper of its sandboxes (the sandbox's pid 1 is reaped here, by pid, never by
waitpid(-1)), and it dies with the pool (parent-death signal, and EOF on its request pipe).

A command of a session (op "session") runs with the session's uid, tmpfs and cgroup, never the
worker's own (sandbox/session.py); a session that breaks is reported as "session_broken" and
closed by its owner, while the worker goes on. A session's start command leaves its sandbox
running after its answer; a thread of the worker reaps that sandbox's pid 1 and its output drain
once the session's close has killed them.

A slot that cannot guarantee a clean next run (`Slot.broken`: its working directory could not be
reset, a process could not be killed) answers the current request with `"broken": reason` and
the worker exits; the pool replaces it with a fresh worker and slot (new uid, new mount).
"""

from __future__ import annotations

import os
import sys
import traceback

from .wire import read_msg, write_msg


def main() -> int:
    # Protocol on private fds; fd 1 now points at stderr so stray prints cannot corrupt it.
    rfd = os.dup(0)
    wfd = os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    from .config import IsolationUnavailable, SlotBroken
    from .executor import Slot
    from .host import set_child_subreaper, set_parent_death_signal
    from .result import ExecutionResult

    ppid = os.getppid()
    set_parent_death_signal()
    if os.getppid() != ppid:  # parent already gone
        return 1
    set_child_subreaper()
    msg = read_msg(rfd)
    if msg is None:
        return 1
    cfg = msg["config"]
    if cfg.isolation == "none":  # the pool warned its caller already
        import warnings

        from .config import UnisolatedWarning

        warnings.simplefilter("ignore", UnisolatedWarning)
    try:
        slot = Slot(cfg, sweep=msg.get("sweep", True), layout=msg.get("layout"))
    except IsolationUnavailable as e:
        write_msg(wfd, {"ok": False, "kind": "isolation", "error": str(e)})
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the pool
        write_msg(wfd, {"ok": False, "kind": "error",
                        "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
        return 2
    write_msg(wfd, {"ok": True, "info": slot.info(), "pid": os.getpid()})
    try:
        while True:
            msg = read_msg(rfd)
            if msg is None or msg.get("op") == "close":
                break
            op = msg.get("op")
            try:
                if op == "run":
                    reply = {"ok": True, "results": [slot.run(msg["req"])]}
                elif op == "seq":
                    reply = {"ok": True, "results": slot.run_sequence(msg["reqs"])}
                elif op == "session":  # sandbox/session.py: the session's uid/tmpfs/cgroup, not ours
                    from .session import run_session_command

                    r, session_broken = run_session_command(slot, msg["session"], msg["req"])
                    reply = {"ok": True, "results": [r]}
                    if session_broken:
                        reply["session_broken"] = session_broken
                elif op == "ping":
                    reply = {"ok": True, "info": slot.info()}
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}"}
            except SlotBroken as e:
                n = len(msg.get("reqs") or [None])
                reply = {"ok": True, "results": [ExecutionResult.sandbox_error(
                    f"sandbox slot broken before the run: {e}") for _ in range(n)]}
            except Exception as e:  # noqa: BLE001 - a failed run is a sandbox_error, not a crash
                n = len(msg.get("reqs") or [None])
                slot.broken = slot.broken or f"worker error {type(e).__name__}: {e}"  # unknown state
                reply = {"ok": True,
                         "results": [ExecutionResult.sandbox_error(
                             f"worker error: {type(e).__name__}: {e}") for _ in range(n)],
                         "traceback": traceback.format_exc()}
            if slot.broken:
                reply["broken"] = slot.broken
            write_msg(wfd, reply)
            if slot.broken:
                break
    finally:
        slot.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
