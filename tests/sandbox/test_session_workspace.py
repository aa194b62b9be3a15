"""Session workspaces and start commands (sandbox/session.py `Workspace`, `Session.start`): shell
tasks written for Docker containers run in a session. Covered: cwd, HOME, whoami and id -u (uid
0 inside, the session's uid on the host); files persisting in /home, /root, /tmp and /var; /tmp
fresh per command without the option; two sessions never seeing each other's /root or /home;
nothing outside the workspace directories writable; a command that replaces or chmods the cwd
cannot stop the next; a background writer left by start() seen growing by later commands, and
nothing of the session's uid left after close() (processes, background cgroup) or after the
owner is SIGKILLed; a start command reaching neither the network nor the host's files; the
isolated check ignoring the workspace's PATH; the limits on start commands; the same main cases
over HTTP (SandboxClient and raw requests); bad Workspace values naming the field.
Not covered here: the plain /work session (test_sessions.py)."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sandbox import SandboxClient, SandboxPool, Session, SessionLimitExceeded, Workspace
from sandbox.host import _mountpoints, live_pids_of_uid, pids_of_uid
from sandbox.server import SandboxServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENTBENCH = {"cwd": "/home/agent", "home": "/root", "dirs": ["/home", "/tmp", "/root"],
              "as_root": True, "path": ["/home/agent/local/bin", "/home/agent/bin"]}
TBENCH = Workspace(cwd="/app", dirs=("/app", "/root", "/tmp", "/logs", "/tests"), as_root=True)
WRITER = ("python3 -c 'import time\n"
          "while True:\n"
          "    open(\"/home/agent/log\", \"a\").write(\"x\\n\"); print(\"tick\", flush=True)\n"
          "    time.sleep(0.2)' &\n"
          "echo started")


def _leftovers(layout, uid: int) -> list[str]:
    """What of a session uid is still on the machine, the background cgroup included."""
    out = []
    d = f"/run/kimi-sandbox/slots/{uid}"
    if live_pids_of_uid(uid):
        out.append(f"processes {live_pids_of_uid(uid)}")
    if os.path.lexists(d):
        out.append(f"directory {d}")
    if any(m == d or m.startswith(d + "/") for m in _mountpoints()):
        out.append(f"mount under {d}")
    if layout is not None:
        for prefix in ("u", "b"):
            out += [f"cgroup {c}" for c in layout.slot_dirs(uid, prefix).values()
                    if os.path.exists(c)]
    return out


def _wait(pred, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def test_cwd_home_and_user(pool):
    with pool.session(workspace=AGENTBENCH, files={"note.txt": "hi\n"}) as s:
        assert s.workspace == Workspace(**AGENTBENCH)
        r = s.run('pwd; echo "$HOME"; whoami; id -u; id -g; cat note.txt; ls -ln note.txt; '
                  'touch f; chmod u+s f; stat -c %A f; echo "$PATH"; grep -c Cap.*[1-9] '
                  '/proc/self/status')
        out = r.stdout.split("\n")
        assert out[:6] == ["/home/agent", "/root", "root", "0", "0", "hi"], r
        assert out[6].split()[2:4] == ["0", "0"]  # ls -ln: owned by root inside
        assert out[7] == "-rwSr--r--"
        assert out[8] == "/home/agent/local/bin:/home/agent/bin:/usr/local/bin:/usr/bin:/bin"
        assert out[9] == "0"  # no capability in any set
        assert s.read_files(["note.txt", "f"]) == {"note.txt": b"hi\n", "f": b""}
        host = os.stat(os.path.join(s._b.workdir, s._b.ws_plan["cwd_rel"], "f"))
        assert host.st_uid == s._b.uid != 0  # the host sees the session's uid
    with pool.session(workspace={"cwd": "/app"}) as s:  # not as_root: the session's own uid
        r = s.run('pwd; echo "$HOME"; whoami; id -u')
        assert r.stdout.split("\n")[:3] == ["/app", "/app", "sandbox"], r
        assert int(r.stdout.split("\n")[3]) == s._b.uid


def test_files_persist_in_workspace_dirs(pool):
    ws = {**AGENTBENCH, "dirs": ["/home", "/tmp", "/root", "/var"]}
    with pool.session(workspace=ws) as s:
        assert s.run("echo a > /home/agent/a; echo r > /root/r; echo t > /tmp/t; "
                     "mkdir -p /root/.config && echo c > /root/.config/c; echo v > /var/log/v").ok
        r = s.run("cat /home/agent/a /root/r /tmp/t /root/.config/c /var/log/v; ls -d /var/tmp")
        assert r.stdout == "a\nr\nt\nc\nv\n/var/tmp\n", r
    with pool.session(workspace={"cwd": "/home/agent"}) as s:  # /tmp not listed: fresh each time
        assert s.run("echo t > /tmp/t; echo h > ~/h").ok
        r = s.run("cat /tmp/t 2>&1; cat ~/h")
        assert "No such file" in r.stdout and r.stdout.endswith("h\n"), r
    with pool.session() as s:  # the plain session: as before
        assert s.run("echo t > /tmp/t").ok
        assert "No such file" in s.run("cat /tmp/t 2>&1; pwd").stdout


def test_sessions_do_not_see_each_other(pool):
    a, b = pool.session(workspace=AGENTBENCH), pool.session(workspace=AGENTBENCH)
    try:
        tail = os.urandom(6).hex()
        assert a.run(f"echo kimi-secret-{tail} > /root/s; echo kimi-secret-{tail} > /home/agent/s; "
                     f"echo kimi-secret-{tail} > /tmp/s").ok
        r = b.run(f'p=kimi-secret-; grep -rls "${{p}}{tail}" /root /home /tmp /work /var /etc /sandbox '
                  "/run /dev/shm 2>/dev/null | wc -l; ls -A /root /home/agent /tmp | grep -c '^s$'")
        assert r.stdout.split() == ["0", "0"], r
    finally:
        a.close()
        b.close()


def test_nothing_outside_the_workspace_is_writable(pool):
    with pool.session(workspace=AGENTBENCH) as s:
        r = s.run("find / -path /proc -prune -o ! -type l -writable -print 2>/dev/null "
                  "| grep -v -e '^/home' -e '^/root' -e '^/tmp' -e '^/dev'; "
                  "for d in / /usr /usr/local /etc /bin /sandbox /var /opt /srv; do "
                  "touch $d/probe 2>/dev/null && echo WROTE $d; done; echo end", timeout_s=30)
        assert r.stdout == "end\n", r


def test_a_command_cannot_stop_the_next(pool):
    with pool.session(workspace=AGENTBENCH) as s:
        assert s.run("cd /; rm -rf /home/agent; ln -s /etc /home/agent").ok
        r = s.run("pwd; ls -A | wc -l")
        assert r.ok and r.stdout == "/home/agent\n0\n", r  # the directory is back, empty
        assert s.run("chmod 000 /home/agent /home /root").ok
        r = s.run("pwd; echo x > y; cat y")
        assert r.ok and r.stdout == "/home/agent\nx\n", r


def test_background_writer_keeps_running_until_close(pool):
    s = pool.session(workspace=AGENTBENCH, limits={"max_starts": 2})
    uid, layout = s._b.uid, pool._layout
    try:
        r = s.start(WRITER, timeout_s=10)
        assert r.ok and r.stdout.startswith("started\n"), r  # (+ any early tick)
        assert _wait(lambda: s.run("test -s /home/agent/log").ok)  # (python3 starting)
        n1 = int(s.run("wc -l < /home/agent/log").stdout)
        time.sleep(1.5)
        r = s.run("wc -l < /home/agent/log; ps -e -o comm= | grep -c python3")
        n2, seen = (int(x) for x in r.stdout.split())
        assert n2 >= n1 + 4, (n1, n2)  # every 0.2 s
        assert seen == 0  # another pid namespace
        assert s.check("test $(wc -l < /home/agent/log) -gt 3").ok
        assert live_pids_of_uid(uid)
        assert s.usage()["starts"] == 1
        r = s.start("sleep 5", timeout_s=0.5)  # a start that times out: its own tree is killed
        assert r.status == "timeout", r
        with pytest.raises(SessionLimitExceeded, match="start-command limit of 2"):
            s.start("true")
    finally:
        s.close()
    assert _wait(lambda: not _leftovers(layout, uid) or
                 _leftovers(layout, uid) == [f"cgroup {c}" for c in layout.slot_dirs(uid).values()])
    assert _wait(lambda: not pids_of_uid(uid)), [open(f"/proc/{p}/status").read()[:400] for p in pids_of_uid(uid)]  # reaped too, no zombie
    assert not any(os.path.exists(c) for c in layout.slot_dirs(uid, "b").values())
    for c in layout.slot_dirs(uid).values():  # the warm session cgroup is empty
        if os.path.exists(c):
            assert open(os.path.join(c, "cgroup.procs")).read() == ""


def test_start_command_is_sandboxed(pool):
    probe = ("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=1)' "
             "2>/dev/null && echo NET; ls /work/main 2>/dev/null && echo HOSTFILES; "
             "ls -A /root | grep -vc ^bg.txt$; unshare -U true 2>/dev/null && echo USERNS; echo done")
    with pool.session(workspace=AGENTBENCH) as s:
        r = s.start(f"({probe}) > /root/bg.txt 2>&1 &\n{probe}", timeout_s=15)
        assert r.stdout == "0\ndone\n", r
        assert _wait(lambda: s.run("cat /root/bg.txt").stdout == "0\ndone\n"), \
            s.run("cat /root/bg.txt")  # the background copy too


def test_check_is_isolated_from_the_workspace_path(pool):
    with pool.session(workspace=AGENTBENCH) as s:
        assert s.run("mkdir -p bin; printf '#!/bin/sh\\necho 42\\n' > bin/wc; chmod +x bin/wc; "
                     "printf 'a\\nb\\n' > f").ok
        assert s.run("wc -l < f").stdout == "42\n"  # the task's PATH reaches commands
        r = s.check('test "$(wc -l < f)" = 2 && pwd && echo "$HOME" && echo "$PATH"')
        assert r.ok and r.stdout == "/home/agent\n/root\n/usr/bin:/bin\n", r
        with pytest.raises(Exception, match="cannot be isolated"):
            s.start("true", isolated=True)


def test_killing_the_owner_sweeps_background_processes(pool):
    code = f"""
import json, time
from sandbox import SandboxPool
pool = SandboxPool(workers=1)
s = pool.session(workspace={AGENTBENCH!r})
assert s.start({WRITER!r}).ok
print(json.dumps({{"uid": s._b.uid}}), flush=True)
time.sleep(100)
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    try:
        uid = json.loads(p.stdout.readline())["uid"]
        assert live_pids_of_uid(uid)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert _wait(lambda: not _leftovers(pool._layout, uid), 30), _leftovers(pool._layout, uid)


def test_background_outlives_the_worker_that_started_it():
    """The start command's worker dies: what it left running goes on (no parent-death signal;
    its output drain is a process of its own) until the session closes."""
    with SandboxPool(workers=1) as own:
        s = own.session(workspace=AGENTBENCH)
        uid = s._b.uid
        assert s.start("(while :; do echo x >> /root/log; echo out; sleep 0.2; done) & echo up").ok
        os.kill(own.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.5)
        assert _wait(lambda: s.run("test -s /root/log").ok)
        n1 = int(s.run("wc -l < /root/log").stdout)
        time.sleep(1.0)
        assert int(s.run("wc -l < /root/log").stdout) >= n1 + 3
        s.close()
        assert _wait(lambda: not live_pids_of_uid(uid)), live_pids_of_uid(uid)


@pytest.mark.parametrize("bad, field", [
    ({"cwd": "app"}, "cwd"), ({"cwd": "/usr/local/app"}, "cwd"), ({"cwd": "/"}, "cwd"),
    ({"cwd": "/app/../etc"}, "cwd"), ({"home": "/etc"}, "home"), ({"dirs": "/tmp"}, "dirs"),
    ({"dirs": ["/proc"]}, "dirs"), ({"dirs": ["/sandbox"]}, "dirs"), ({"dirs": ["/run/x"]}, "dirs"),
    ({"dirs": ["/tmp", "/tmp"]}, "dirs"), ({"dirs": ["/opt", "/opt/app"]}, "dirs"),
    ({"cwd": "/home/agent", "dirs": ["/home/agent/x"]}, "dirs"), ({"as_root": 1}, "as_root"),
    ({"path": ["bin"]}, "path"), ({"path": ["/a:/b"]}, "path"), ({"cwd": 5}, "cwd"),
])
def test_bad_workspace_values_name_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"Workspace\.{field}"):
        Workspace.coerce(bad)


def test_bad_workspace_refused_before_anything_opens(pool):
    with pytest.raises(ValueError, match="unknown Workspace field"):
        pool.session(workspace={"cwdir": "/app"})
    with pytest.raises(ValueError, match=r"Workspace\.dirs"):
        pool.session(workspace={"dirs": ["/etc"]})
    assert Workspace.coerce(None) is None and Workspace.coerce(TBENCH) is TBENCH


@pytest.fixture(scope="module")
def token():
    return "kimi-secret-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def server(pool, token):
    srv = SandboxServer(pool, token=token).serve_in_thread()
    yield srv
    srv.stop()


def test_http_workspace_and_start(server, token, pool):
    with SandboxClient(server.url, token=token) as c:
        s = c.session(workspace=TBENCH, files={"in.txt": "3\n"})
        assert isinstance(s, Session) and s.workspace == TBENCH
        uid = pool.sessions.get(s.id).uid
        r = s.run("pwd; whoami; cat in.txt; echo k > /root/k; echo t > /tmp/t")
        assert r.stdout == "/app\nroot\n3\n", r
        r = s.start("(while :; do echo x >> /logs/bg; sleep 0.2; done) & echo up", timeout_s=10)
        assert r.ok and r.stdout == "up\n", r
        assert _wait(lambda: s.run("test -s /logs/bg").ok)
        n1 = int(s.run("cat /root/k /tmp/t >/dev/null && wc -l < /logs/bg").stdout)
        time.sleep(1.5)
        assert int(s.run("wc -l < /logs/bg").stdout) >= n1 + 4
        assert s.check("test -s /logs/bg && pwd").stdout == "/app\n"
        assert s.read_files(["in.txt"]) == {"in.txt": b"3\n"}
        assert s.usage()["starts"] == 1
        s.close()
    assert _wait(lambda: not live_pids_of_uid(uid)), live_pids_of_uid(uid)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    hdr = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    for ws in ({"dirs": ["/etc"]}, {"cwd": "rel"}, {"nope": 1}, {"as_root": "yes"}):
        conn.request("POST", "/sessions", body=json.dumps({"workspace": ws}), headers=hdr)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 422 and "Workspace" in body["message"], body
    conn.request("POST", "/sessions", body=json.dumps({"workspace": {"cwd": "/app"}}), headers=hdr)
    resp = conn.getresponse()
    created = json.loads(resp.read())
    assert resp.status == 200 and created["workspace"]["cwd"] == "/app", created
    sid = created["session_id"]
    conn.request("POST", f"/sessions/{sid}/run", headers=hdr, body=json.dumps(
        {"code": "true", "language": "bash", "background": True, "isolated": True}))
    resp = conn.getresponse()
    assert resp.status == 422 and "cannot be isolated" in json.loads(resp.read())["message"]
    conn.request("POST", f"/sessions/{sid}/close", body="{}", headers=hdr)
    conn.getresponse().read()
    conn.close()
