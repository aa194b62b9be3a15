"""Sessions (sandbox/session.py): one episode's private working directory kept
across commands. Covered: files persist and stay private (another session sees neither files nor
processes, and runs as another uid), nothing survives a command or a close, each limit (commands,
wall time, disk, inodes, task runs, one command at a time, idle timeout, the cap on open
sessions), a program cannot break the next command (chmod 000 /work, a FIFO where files go),
SIGKILL of the owning process leaves no process, mount, cgroup or directory (the reaper), and the
HTTP counterpart (same interface, same errors, auth, a resent command never runs twice).
Not covered here: the episode loop over sessions (test_session_env.py) and reward hacks against
the session check (test_session_env.py)."""

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sandbox import (
    SandboxClient,
    Session,
    SessionBusy,
    SessionCapReached,
    SessionClosed,
    SessionLimitExceeded,
)
from sandbox.host import _mountpoints, live_pids_of_uid
from sandbox.server import SandboxServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _leftovers(layout, uid: int) -> list[str]:
    """What of a session or slot uid is still on the machine (zombies are dead processes waiting
    for init to reap them: not counted)."""
    out = []
    d = f"/run/kimi-sandbox/slots/{uid}"
    if live_pids_of_uid(uid):
        out.append(f"processes {live_pids_of_uid(uid)}")
    if os.path.lexists(d):
        out.append(f"directory {d}")
    if any(m == d or m.startswith(d + "/") for m in _mountpoints()):
        out.append(f"mount under {d}")
    if layout is not None:
        out += [f"cgroup {c}" for c in layout.slot_dirs(uid).values() if os.path.exists(c)]
    return out


def test_files_persist_and_sessions_are_private(pool):
    a, b = pool.session(), pool.session()
    try:
        assert a.id != b.id
        r = a.run("umask 077; echo kimi-secret-7f3a > s.txt; mkdir -p d/e; echo deep > d/e/f; "
                  "(sleep 30 &) ; id -u")
        assert r.status == "ok", r
        uid_a = int(r.stdout)
        r = a.run("cat s.txt d/e/f; ps -e -o comm= | grep -c sleep")
        assert r.stdout.split("\n")[:2] == ["kimi-secret-7f3a", "deep"], r
        assert r.stdout.split("\n")[2] == "0"  # the background sleep died with its command
        assert a.read_files(["s.txt", "d/e/f", "missing"]) == {"s.txt": b"kimi-secret-7f3a\n",
                                                                "d/e/f": b"deep\n"}
        probe = ("id -u; ls -A /work | wc -l; ps -e -o pid= | wc -l; p=kimi-secret-; "  # (the
                 'grep -rls "${p}7f3a" /work /tmp /dev/shm /etc /sandbox /run /var /home /root '  # text)
                 "2>/dev/null | wc -l; "
                 "ls /run/kimi-sandbox 2>&1 | head -c 60")
        r = b.run(probe)
        uid_b, n_files, n_procs, hits, run_dir = r.stdout.split("\n")[:5]
        assert int(uid_b) != uid_a and uid_a not in pool.worker_uids()
        assert n_files == "0" and hits == "0", r.stdout
        assert int(n_procs) <= 4  # its own pid 1, bash and the pipeline: nothing of a
        assert "No such file" in run_dir
    finally:
        a.close()
        b.close()


def test_close_leaves_nothing_and_refuses_later_use(pool):
    s = pool.session(files={"a.txt": "x"})
    uid = s._b.uid
    assert s.run("sleep 0.1; echo hi").stdout == "hi\n"
    s.close()
    assert s.closed
    with pytest.raises(SessionClosed, match="closed by its owner"):
        s.run("echo again")
    with pytest.raises(SessionClosed):
        s.read_files(["a.txt"])
    assert not live_pids_of_uid(uid)
    d = f"/run/kimi-sandbox/slots/{uid}"
    assert not os.path.lexists(d) and not any(m.startswith(d) for m in _mountpoints())
    # the uid may serve the next session (kept warm with its empty cgroup): nothing of the old one
    s2 = pool.session()
    try:
        assert s2.run("ls -A; cat /work/a.txt 2>&1 | head -c 80").stdout.startswith("cat:")
    finally:
        s2.close()


def test_close_kills_a_running_command(pool):
    s = pool.session()
    fut = s.submit("echo started; sleep 30", timeout_s=60)
    time.sleep(0.3)
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 10
    r = fut.result(timeout=10)
    assert r.status != "ok" and not live_pids_of_uid(s._b.uid)


def test_limits(pool):
    s = pool.session(limits={"max_commands": 3, "max_wall_s": 1.0, "disk_mb": 1,
                             "disk_inodes": 64, "max_task_runs": 1})
    try:
        r = s.run("head -c 700000 /dev/zero > big; head -c 700000 /dev/zero > big2; echo $?")
        assert r.stdout.strip() != "0" and "No space left" in r.stderr, r  # the 1 MiB tmpfs
        r = s.run("for i in $(seq 100); do : > f$i || break; done; ls | wc -l", timeout_s=5)
        assert int(r.stdout) < 64 and "No space left" in r.stderr, r
        r = s.run("sleep 5", timeout_s=10)  # the third command: cut to the wall time left (< 1 s)
        assert r.status == "timeout" and "remaining wall-time budget" in r.message, r
        with pytest.raises(SessionLimitExceeded, match="command limit of 3|wall-time budget"):
            s.run("echo no")
        assert s.check("test -e big").status in ("ok", "error")  # a task run: not the budget
        with pytest.raises(SessionLimitExceeded, match="task-run limit of 1"):
            s.check("true")
        u = s.usage()
        assert u["commands"] == 3 and u["task_runs"] == 1 and u["wall_s"] < 2.5  # not 5 s
    finally:
        s.close()
    s = pool.session(limits={"max_commands": 5})
    try:
        f1 = s.submit("sleep 0.5")
        with pytest.raises(SessionBusy):
            s.submit("echo two").result()
        assert f1.result().ok
    finally:
        s.close()
    with pytest.raises(ValueError, match="disk_mb"):
        pool.session(limits={"disk_mb": 0})
    with pytest.raises(ValueError, match="unknown SessionLimits"):
        pool.session(limits={"max_cmds": 1})


def test_idle_timeout_and_cap(pool):
    s = pool.session(limits={"idle_timeout_s": 0.3})
    assert s.run("true").ok
    deadline = time.monotonic() + 10
    mgr = pool.sessions
    while s.id in mgr.open_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(SessionClosed, match="idle"):
        s.run("true")
    cap, mgr.max_sessions = mgr.max_sessions, mgr.stats()["open"] + 2
    try:
        a, b = pool.session(), pool.session()
        with pytest.raises(SessionCapReached, match="sessions are open"):
            pool.session()
        a.close()
        pool.session().close()  # a closed session frees its place
        b.close()
    finally:
        mgr.max_sessions = cap


def test_a_command_cannot_break_the_next(pool, clean_next):
    s = pool.session()
    try:
        assert s.run("mkdir sub; chmod 000 sub /work").ok
        assert s.run("echo fine > f; cat f").stdout == "fine\n"
        assert s.run("mkfifo p; ln -s /etc/passwd l; echo ok").ok
        r = s.run("cat p", files={"p": "x"})  # files over a FIFO: refused, never blocks
        assert r.status == "error" and "could not place files" in r.message, r
        assert s.read_files(["l", "p"]) == {}  # no link followed, no FIFO opened
        r = s.run("kill -9 -1; echo survived")
        assert r.status != "sandbox_error"
        assert s.check("test -f f").ok
    finally:
        s.close()
    clean_next(pool)


def test_killing_the_owner_leaves_nothing(pool):
    """The owner (a pool with two open sessions, one running a command) is SIGKILLed: its
    reaper removes the sessions' and the slots' processes, mounts, cgroups and directories."""
    code = r"""
import json, sys, time
from sandbox import SandboxPool
pool = SandboxPool(workers=1)
a = pool.session(files={"f": "x"})
b = pool.session()
b.submit("sleep 60 & sleep 60", timeout_s=100)
time.sleep(0.3)
print(json.dumps({"uids": [a._b.uid, b._b.uid] + pool.worker_uids(),
                  "reaper": pool.sessions.reaper.pid}), flush=True)
time.sleep(100)
"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                         cwd=ROOT)
    try:
        info = json.loads(p.stdout.readline())
        layout = pool._layout
        assert all(_leftovers(layout, u) for u in info["uids"][:2])  # they exist before
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    deadline = time.monotonic() + 30
    left = {u: _leftovers(layout, u) for u in info["uids"]}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {u: _leftovers(layout, u) for u in info["uids"]}
    assert not any(left.values()), left

    def reaper_alive():
        try:
            with open(f"/proc/{info['reaper']}/status") as f:
                return "State:\tZ" not in f.read()
        except FileNotFoundError:
            return False
    while reaper_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not reaper_alive()


@pytest.fixture(scope="module")
def token():
    return "kimi-secret-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def server(pool, token):
    srv = SandboxServer(pool, token=token).serve_in_thread()
    yield srv
    srv.stop()


def test_http_session_has_the_same_interface(server, token, pool):
    with SandboxClient(server.url, token=token, busy_timeout_s=0.5) as c:
        s = c.session(files={"n.txt": "ab12.txt\n", "ab12.txt": "payload\n"},
                      limits={"max_commands": 3})
        assert isinstance(s, Session) and s.id in server.sessions
        assert s.run("cat n.txt").stdout == "ab12.txt\n"
        assert s.run("cp ab12.txt out.txt").ok
        assert s.check("grep -qx payload out.txt").ok
        r = s.run("printf 'x%.0s' $(seq 3000)", output_limit_bytes=100)
        assert r.status == "output_limit" and len(r.stdout) == 100
        with pytest.raises(SessionLimitExceeded, match="command limit of 3"):
            s.run("true")
        assert s.read_files(["out.txt", "nope"]) == {"out.txt": b"payload\n"}
        assert s.usage()["commands"] == 3
        s.close()
        with pytest.raises(SessionClosed):
            s.run("true")
        with pytest.raises(SessionClosed):
            s.read_files(["x"])
        # the cap answers 429: the client waits (busy_timeout_s), then says so
        mgr = pool.sessions
        cap, mgr.max_sessions = mgr.max_sessions, mgr.stats()["open"]
        try:
            with pytest.raises(SessionCapReached):
                c.session()
        finally:
            mgr.max_sessions = cap
    with SandboxClient(server.url) as anon:  # no token: refused like every other endpoint
        with pytest.raises(Exception, match="401"):
            anon.session()


def test_http_resent_command_runs_once(server, token):
    with SandboxClient(server.url, token=token) as c:
        s = c.session()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        hdr = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

        def post(path, body):
            conn.request("POST", path, body=json.dumps(body), headers=hdr)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())

        body = {"code": "echo line >> f; wc -l < f", "language": "bash", "seq": 1}
        first = post(f"/sessions/{s.id}/run", body)
        again = post(f"/sessions/{s.id}/run", body)  # a client resending after a lost answer
        assert first == again and first[1]["stdout"] == "1\n", (first, again)
        assert post(f"/sessions/{s.id}/run", {**body, "seq": 3})[1]["stdout"] == "2\n"  # (2 lost)
        status, err = post(f"/sessions/{s.id}/run", {**body, "seq": 2})
        assert status == 409 and "out of order" in err["message"]
        status, files = post(f"/sessions/{s.id}/files", {"paths": ["f"]})
        assert base64.b64decode(files["files"]["f"]) == b"line\nline\n"
        status, err = post("/sessions/s-nope/run", body)
        assert status == 404 and err["session_error"] == "unknown"
        status, err = post(f"/sessions/{s.id}/run", {**body, "seq": 4, "budget": "yes"})
        assert status == 422
        conn.close()
        s.close()
