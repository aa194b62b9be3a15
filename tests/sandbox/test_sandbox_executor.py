"""Basic behaviour of one sandboxed run: statuses, stdin, files, limits, errors, isolation report."""

import os
import warnings

import pytest

import sandbox
from sandbox import InvalidRequest, IsolationUnavailable, SandboxPool, UnisolatedWarning
from sandbox.config import SandboxConfig
from sandbox.executor import Slot
from sandbox.preflight import check_isolation


def test_ok_and_exit_codes(pool, no_leftovers):
    r = pool.run("print('hello')")
    assert r.status == "ok" and r.exit_code == 0 and r.stdout == "hello\n" and r.stderr == ""
    r = pool.run("import sys; print('bad', file=sys.stderr); sys.exit(3)")
    assert r.status == "error" and r.exit_code == 3 and "bad" in r.stderr
    r = pool.run("raise ValueError('boom')")
    assert r.status == "error" and r.exit_code == 1 and "ValueError: boom" in r.stderr
    r = pool.run("echo hi; exit 7", language="bash")
    assert r.status == "error" and r.exit_code == 7 and r.stdout == "hi\n"
    r = pool.run("kill -KILL $$", language="bash")
    assert r.status == "error" and r.exit_code == 137 and r.signal == 9
    no_leftovers(pool)


def test_module_level_run_uses_default_pool():
    r = sandbox.run("print(6 * 7)")
    assert r.status == "ok" and r.stdout == "42\n"


def test_stdin_and_files(pool):
    r = pool.run("import sys; data = sys.stdin.read(); print(data[::-1])", stdin="abc")
    assert r.stdout == "cba\n"
    r = pool.run("cat -", language="bash", stdin=b"\x00\x01bytes")
    assert r.stdout == "\x00\x01bytes"
    files = {"data/in.txt": "line1\nline2\n", "blob.bin": b"\xff\x00", "helper.py": "X = 41\n"}
    r = pool.run("import helper\nprint(open('data/in.txt').read().split()[1], helper.X + 1, "
                 "open('blob.bin','rb').read())\nopen('out/res.txt','w') if False else None\n"
                 "import os; os.makedirs('out'); open('out/res.txt','w').write('done')",
                 files=files, collect=["out/res.txt", "missing.txt"])
    assert r.status == "ok", r.stderr
    assert r.stdout == "line2 42 b'\\xff\\x00'\n"
    assert r.files == {"out/res.txt": b"done"}


def test_working_directory_is_private_and_reset(pool):
    pool.run("open('left.txt','w').write('x')")
    r = pool.map(["import os; print(sorted(os.listdir('.')), os.getcwd())"] * 2)
    assert all(x.stdout == "[] /work\n" for x in r)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a/../b", "", "a\x00b", "."])
def test_bad_file_paths_are_rejected(pool, path):
    with pytest.raises(InvalidRequest):
        pool.submit("pass", files={path: "x"})


@pytest.mark.parametrize("kw", [{"language": "ruby"}, {"timeout_s": 0}, {"timeout_s": float("nan")},
                                {"memory_mb": 1}, {"output_limit_bytes": 0}])
def test_bad_requests_are_rejected(pool, kw):
    with pytest.raises(InvalidRequest):
        pool.submit("pass", **kw)


def test_collect_limits(pool):
    r = pool.run("open('big','w').write('x' * 5000)", collect=["big"], collect_limit_bytes=100)
    assert r.files["big"] == b"x" * 100 and "truncated" in r.message


def test_sandbox_identity_and_environment(pool):
    r = pool.run(
        "import os, json\n"
        "st = open('/proc/self/status').read()\n"
        "field = lambda k: [l.split(':',1)[1].strip() for l in st.splitlines() if l.startswith(k+':')][0]\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),\n"
        "  'cap': field('CapEff'), 'bnd': field('CapBnd'), 'nnp': field('NoNewPrivs'),\n"
        "  'seccomp': field('Seccomp'), 'pid': os.getpid(), 'env': dict(os.environ),\n"
        "  'init_env': open('/proc/1/environ').read(), 'hostname': os.uname().nodename,\n"
        "  'root': sorted(os.listdir('/')), 'ifaces': sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else None}))")
    import json

    d = json.loads(r.stdout)
    assert d["uid"] in pool.worker_uids() and d["uid"] != 0 and d["gid"] == d["uid"]
    assert d["cap"] == "0000000000000000" and d["bnd"] == "0000000000000000"
    assert d["nnp"] == "1" and d["seccomp"] == "2"
    assert d["pid"] == 2  # pid namespace: bwrap's reaper is 1, the program 2
    assert d["init_env"] == ""
    assert set(d["env"]) <= {"PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME", "PYTHONPATH",
                             "PYTHONHASHSEED", "PWD"}
    assert d["hostname"] == "sandbox"
    assert d["root"] == ["bin", "dev", "etc", "lib", "lib64", "proc", "sandbox", "sbin", "tmp", "usr", "work"] or \
        set(d["root"]) >= {"usr", "etc", "proc", "dev", "tmp", "work", "sandbox"}
    assert "root" not in d["root"] and "home" not in d["root"] and "run" not in d["root"]


def test_isolation_report(pool):
    rep = pool.isolation_report()
    assert rep["isolation"] == "bwrap" and rep["unprivileged_uid"]
    assert set(rep["namespaces"]) >= {"user", "pid", "net", "ipc", "uts", "mnt", "cgroup"}
    assert rep["nested_userns_disabled"] and rep["capabilities"] == "none"
    assert "ptrace" in rep["seccomp"]["denied_eperm"]
    assert rep["cgroups"]["version"] in ("v1", "v2")  # root on Linux: memory + pids cgroups
    assert rep["work_tmpfs"] is True


def test_missing_bubblewrap_is_a_clear_error(tmp_path):
    missing = SandboxConfig(bwrap=str(tmp_path / "no-such-bwrap"))
    problems = check_isolation(missing)
    assert any("bubblewrap" in p and "apt-get install bubblewrap" in p for p in problems)
    with pytest.raises(IsolationUnavailable, match="apt-get install bubblewrap"):
        Slot(missing)
    with pytest.raises(IsolationUnavailable, match="apt-get install bubblewrap"):
        SandboxPool(workers=1, bwrap=str(tmp_path / "no-such-bwrap"))


def test_isolation_none_is_explicit_and_warns():
    with pytest.warns(UnisolatedWarning):
        r = sandbox.run("import os; print(os.getuid())", isolation="none")
    assert r.status == "ok" and r.stdout.strip() == str(os.getuid()) and "UNISOLATED" in r.message
    with pytest.raises(ValueError):
        sandbox.run("pass", isolation="weak")


def test_slot_in_process_shell_launcher():
    """The dash + setpriv launcher (safe from multi-threaded callers) gives the same isolation."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        slot = Slot(SandboxConfig())
    try:
        from sandbox.result import normalize_request

        r = slot.run(normalize_request(f"import os; print(os.getuid() == {slot.uid}, open('/proc/self/status').read().count('NoNewPrivs:\\t1'))"))
        assert r.status == "ok" and r.stdout == "True 1\n"
        r = slot.run(normalize_request("x = bytearray(400 << 20); x[::4096] = b'y' * len(x[::4096])", memory_mb=64))
        assert r.status == "memory"
    finally:
        slot.close()


def test_isolated_runs(pool):
    """isolated=True (check scripts): isolated interpreter, fixed environment, exit codes and
    stdin as usual, and the program's text on no path inside the sandbox."""
    py = ("import os, sys\nprint(sys.flags.isolated, sys.flags.no_site, '/work' in sys.path, '' in sys.path)\n"
          "print(sorted(os.environ))\nprint(os.listdir('/sandbox'), sys.stdin.read())\nsys.exit(3)")
    r = pool.run(py, isolated=True, stdin="in", files={"encodings/__init__.py": "raise SystemExit(0)"})
    assert r.status == "error" and r.exit_code == 3, r
    lines = r.stdout.splitlines()
    assert lines[0] == "1 1 False False"
    assert lines[1] == str(sorted(["PATH", "HOME", "TMPDIR", "LANG", "USER", "LOGNAME", "PYTHONSAFEPATH",
                                   "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "PWD"]))
    assert lines[2] == "[] in"  # no program file under /sandbox
    sh = ("f() { echo \"$PATH $HOME $BASH_ENV\"; }; f; read x; echo got $x; ls -A /sandbox; "
          "ls /proc/self/fd | wc -l; exit 4")
    r = pool.run(sh, language="bash", isolated=True, stdin="line\n",
                 files={".bashrc": "echo RC", "python3": "#!/bin/sh\necho FAKE"})
    assert r.status == "error" and r.exit_code == 4, r
    # BASH_ENV empty, .bashrc not read, no program file under /sandbox, only fds 0-2 (+ ls's own)
    assert r.stdout == "/usr/bin:/bin /tmp \ngot line\n4\n", r.stdout
    # a normal run after a python one does not see the earlier program either
    pool.map(["print(1)"] * 4)
    rs = pool.map(["ls -A /sandbox"] * 4, language="bash")
    assert all(x.stdout == "main.sh\n" for x in rs), [x.stdout for x in rs]
