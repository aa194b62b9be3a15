"""Adversarial programs: each must be contained, leave no process of the sandbox uid behind, and
leave the host (files, network listeners, other processes, other runs) untouched.

Bombs use 1-2 s timeouts so the whole suite stays short on 2 cores.
"""

import json
import os
import socket
import subprocess

import pytest

from sandbox import SandboxConfig, SandboxPool
from sandbox.seccomp import SYSCALLS, host_arch


def _host_alive():
    """The host still runs things while (or after) a bomb ran."""
    return subprocess.run(["/bin/true"], timeout=120).returncode == 0


def _concurrent(pool, bomb_kw, *, check=True):
    """Runs a bomb next to a well-behaved run: the well-behaved one must be unaffected."""
    bomb = pool.submit(**bomb_kw)
    good = pool.submit("import time; time.sleep(0.3); print('still fine')", timeout_s=60)
    assert _host_alive()
    r_good = good.result()
    assert r_good.status == "ok" and r_good.stdout == "still fine\n", r_good
    return bomb.result()


def test_fork_bomb_python(pool, no_leftovers):
    r = _concurrent(pool, dict(code="import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                               timeout_s=2))
    assert r.status == "timeout"
    no_leftovers(pool)


def test_fork_bomb_shell(pool, no_leftovers):
    r = _concurrent(pool, dict(code="bomb() { bomb | bomb & }; bomb; sleep 30", language="bash", timeout_s=2))
    assert r.status in ("timeout", "error")
    no_leftovers(pool)


def test_process_limit_is_enforced(pool, no_leftovers):
    code = ("import os, time\nn = 0\nfor _ in range(500):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n        break\n"
            "print(n)")
    r = pool.run(code, timeout_s=10, max_procs=32)
    assert r.status == "ok", r
    assert 0 < int(r.stdout) < 32
    no_leftovers(pool)


def test_thread_bomb(pool, no_leftovers):
    r = _concurrent(pool, dict(code="import threading, time\nwhile True:\n    try:\n        threading.Thread(target=time.sleep, args=(60,)).start()\n"
                                    "    except (RuntimeError, MemoryError):\n        pass", timeout_s=2))
    assert r.status == "timeout"
    no_leftovers(pool)


def test_memory_bomb(pool, no_leftovers):
    r = _concurrent(pool, dict(code="x = []\nwhile True:\n    x.append(bytearray(8 << 20))", memory_mb=128, timeout_s=20))
    assert r.status == "memory", r
    r = pool.run("x = bytearray(8 << 30)", memory_mb=128)
    assert r.status == "memory", r
    # a memory bomb in a child process is charged to the same cgroup
    r = pool.run("python3 -c 'x = []\nwhile True: x.append(bytearray(8 << 20))' & wait", language="bash",
                 memory_mb=96, timeout_s=20)
    assert r.status in ("memory", "error") and r.status != "ok", r
    no_leftovers(pool)


def test_infinite_loop(pool, no_leftovers):
    r = pool.run("while True:\n    pass", timeout_s=1)
    assert r.status == "timeout" and r.exit_code is None
    r = pool.run("sleep 1000", language="bash", timeout_s=1)
    assert r.status == "timeout"
    no_leftovers(pool)


def test_cpu_bound_past_the_limit(pool, no_leftovers):
    # four processes and two threads each burning CPU: wall-clock or RLIMIT_CPU stops it
    code = ("import os, threading\nfor _ in range(2):\n    os.fork()\n"
            "def burn():\n    while True:\n        pass\n"
            "threading.Thread(target=burn, daemon=True).start()\nburn()")
    r = _concurrent(pool, dict(code=code, timeout_s=2))
    assert r.status == "timeout"
    no_leftovers(pool)


def test_huge_stdout_and_stderr(pool, no_leftovers):
    for stream in ("stdout", "stderr"):
        r = pool.run(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)", timeout_s=20,
                     output_limit_bytes=100_000)
        assert r.status == "output_limit", r.status
        assert len(getattr(r, stream)) == 100_000 and getattr(r, f"{stream}_truncated")
    r = pool.run("yes | head -c 100000000; yes >&2", language="bash", timeout_s=20, output_limit_bytes=1 << 20)
    assert r.status == "output_limit" and len(r.stdout) == 1 << 20
    no_leftovers(pool)


def test_filling_tmp_shm_and_work(pool, no_leftovers):
    name = "kimi-fill-" + os.urandom(4).hex()
    code = (f"dd if=/dev/zero of=/tmp/{name} bs=1M count=2000 2>/dev/null; "
            f"dd if=/dev/zero of=/dev/shm/{name} bs=1M count=2000 2>/dev/null; "
            f"dd if=/dev/zero of=/work/{name} bs=1M count=2000 2>/dev/null; "
            "for d in /tmp /dev/shm /work; do df -k --output=size $d | tail -1; done; "
            f"ls -l /tmp/{name} /work/{name} | awk '{{print $5}}'")
    r = pool.run(code, language="bash", timeout_s=30, memory_mb=512)
    assert r.status == "ok", r
    sizes = [int(x) for x in r.stdout.split()]
    assert all(s <= 64 * 1024 for s in sizes[:3])  # KiB: the tmpfs caps (64 MiB each)
    assert all(s <= 64 << 20 for s in sizes[3:])
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/dev/shm/{name}")
    # many small files: inode cap on /work, no effect on the host
    r = pool.run("i = 0\ntry:\n    while True:\n        open(f'f{i}', 'w').close()\n        i += 1\n"
                 "except OSError:\n    pass\nprint(i)", timeout_s=60)
    assert r.status == "ok" and 0 < int(r.stdout) <= 8192
    no_leftovers(pool)


def test_reading_host_files(pool, no_leftovers, secret_token, tmp_path):
    host_files = [tmp_path / "secret.txt", "/root/" + secret_token + ".txt", "/tmp/" + secret_token]
    for p in host_files:
        with open(p, "w") as f:
            f.write(secret_token)
    try:
        # the token is assembled at run time, so the program's own text never contains it
        half = len(secret_token) // 2
        paths = " ".join(str(p).replace(secret_token, '"$T"') for p in host_files)
        code = (
            f"A={secret_token[:half]}; B={secret_token[half:]}; T=$A$B; "
            f"for p in {paths} /etc/shadow /root /home /run /var; do "
            "cat $p 2>/dev/null; ls $p 2>/dev/null; done; "
            'grep -rs "$T" /etc /tmp /work 2>/dev/null | head; cat /proc/1/environ; '
            'find / -xdev -name "*$T*" 2>/dev/null; echo END')
        r = pool.run(code, language="bash", timeout_s=60)
        assert r.status == "ok" and r.stdout.endswith("END\n"), r
        assert secret_token not in r.stdout and secret_token not in r.stderr
        r = pool.run("import os; print(os.path.exists('/etc/shadow'), os.path.exists('/root'), "
                     "sorted(os.listdir('/etc')))")
        assert r.stdout.startswith("False False "), r.stdout
    finally:
        for p in host_files:
            os.unlink(p)
    no_leftovers(pool)


def test_callers_environment_is_not_visible(secret_token, no_leftovers):
    os.environ["KIMI_SANDBOX_TEST_SECRET"] = secret_token
    try:
        with SandboxPool(workers=1) as p:  # workers inherit the secret; the sandbox must not
            code = ("import os, glob\nout = [repr(dict(os.environ))]\n"
                    "for f in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
                    "    try:\n        out.append(open(f, 'rb').read().decode(errors='replace'))\n"
                    "    except OSError as e:\n        out.append(str(e))\n"
                    "print('\\n'.join(out)); print(len(glob.glob('/proc/[0-9]*')))")
            r = p.run(code)
            assert r.status == "ok", r
            assert secret_token not in r.stdout
            assert int(r.stdout.split()[-1]) <= 3  # only the sandbox's own processes are visible
            no_leftovers(p)
    finally:
        del os.environ["KIMI_SANDBOX_TEST_SECRET"]


def test_writing_outside_the_sandbox(pool, no_leftovers, tmp_path):
    marker = tmp_path / "host.txt"
    marker.write_text("original")
    targets = ["/usr/kimi-x", "/etc/kimi-x", "/kimi-x", "/sandbox/kimi-x", "/proc/kimi-x", "/dev/kimi-x",
               str(marker), "/usr/bin/python3"]
    code = (f"import os, json\nres = {{}}\nfor t in {targets!r}:\n    try:\n        with open(t, 'w') as f:\n"
            "            f.write('pwned')\n        res[t] = 'written'\n    except OSError as e:\n"
            "        res[t] = e.strerror\nprint(json.dumps(res))")
    r = pool.run(code)
    res = json.loads(r.stdout)
    written = [t for t, v in res.items() if v == "written"]
    # nothing of the host is writable; a path that only exists inside (a fresh tmpfs) is harmless
    assert written == [] or all(not os.path.exists(t) for t in written), res
    assert marker.read_text() == "original"
    assert not os.path.exists("/usr/kimi-x") and not os.path.exists("/etc/kimi-x") and not os.path.exists("/kimi-x")
    no_leftovers(pool)


def test_network_is_isolated(pool, no_leftovers):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0)
    port = srv.getsockname()[1]
    try:
        code = ("import socket, json\nres = {}\n"
                f"for fam, addr in [(socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_INET6, ('::1', {port})),\n"
                "                  (socket.AF_INET, ('10.0.2.2', 80)), (socket.AF_INET, ('1.1.1.1', 53))]:\n"
                "    s = socket.socket(fam)\n    s.settimeout(2)\n    try:\n        s.connect(addr)\n"
                "        res[str(addr)] = 'CONNECTED'\n    except OSError as e:\n        res[str(addr)] = str(e)\n"
                "for fam in (40, 17, 5):  # AF_VSOCK, AF_PACKET, AF_APPLETALK\n    try:\n"
                "        socket.socket(fam, socket.SOCK_DGRAM if fam != 40 else socket.SOCK_STREAM)\n"
                "        res[fam] = 'CREATED'\n    except OSError as e:\n        res[fam] = e.errno\n"
                "import os\nres['ifaces'] = sorted(n for _, n in socket.if_nameindex())\nprint(json.dumps(res))")
        r = pool.run(code, timeout_s=30)
        res = json.loads(r.stdout)
        assert "CONNECTED" not in r.stdout, res
        assert res["40"] != "CREATED" and res["17"] != "CREATED"
        assert res["ifaces"] == ["lo"]
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing reached the host listener
    finally:
        srv.close()
    no_leftovers(pool)


def test_kill_all_processes(pool, no_leftovers):
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        r = _concurrent(pool, dict(code="kill -9 -1; kill -9 1; echo survived", language="bash"))
        assert r.status == "ok" and r.stdout == "survived\n"
        r = pool.run("import os, signal\nfor p in range(1, 5000):\n    try:\n        os.kill(p, signal.SIGKILL) if p != os.getpid() else None\n"
                     "    except OSError:\n        pass\nprint('done')")
        assert r.stdout == "done\n"
        assert sentinel.poll() is None
    finally:
        sentinel.kill()
        sentinel.wait()
    no_leftovers(pool)


def test_daemons_do_not_outlive_the_run(pool, no_leftovers):
    r = pool.run("(setsid sleep 1000 &); (nohup sleep 999 >/dev/null 2>&1 &); "
                 "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)' ; echo started",
                 language="bash")
    assert r.status == "ok" and r.stdout.endswith("started\n")
    no_leftovers(pool)
    # a daemon holding stdout open does not hang the run either
    r = pool.run("(sleep 1000 &); echo out", language="bash", timeout_s=30)
    assert r.status == "ok" and r.stdout == "out\n"
    no_leftovers(pool)


def test_ptrace_and_friends_are_denied(pool, no_leftovers):
    nr = SYSCALLS[host_arch()]
    calls = {
        "ptrace_traceme": (nr["ptrace"], 0, 0, 0, 0), "ptrace_attach_1": (nr["ptrace"], 16, 1, 0, 0),
        "process_vm_readv": (nr["process_vm_readv"], 1, 0, 0, 0, 0, 0), "bpf": (nr["bpf"], 0, 0, 0),
        "perf_event_open": (nr["perf_event_open"], 0, 0, -1, -1, 0), "keyctl": (nr["keyctl"], 0, 0, 0, 0, 0),
        "io_uring_setup": (nr["io_uring_setup"], 1, 0), "unshare_user": (nr["unshare"], 0x10000000),
        "setns": (nr["setns"], 0, 0), "mount": (nr["mount"], 0, 0, 0, 0, 0),
        "userfaultfd": (nr["userfaultfd"], 0), "clone_newuser": (nr["clone"], 0x10000000 | 17, 0, 0, 0, 0),
        "ioctl_tiocsti": (nr["ioctl"], 0, 0x5412, 0), "kexec_load": (nr["kexec_load"], 0, 0, 0, 0),
    }
    code = ("import ctypes, json\nlibc = ctypes.CDLL(None, use_errno=True)\nres = {}\n"
            f"for name, args in {calls!r}.items():\n"
            "    r = libc.syscall(*args)\n    res[name] = ctypes.get_errno() if r == -1 else 'ALLOWED'\n"
            "print(json.dumps(res))")
    r = pool.run(code)
    res = json.loads(r.stdout)
    assert set(res) == set(calls)
    assert all(v == 1 for v in res.values()), res  # every one EPERM
    no_leftovers(pool)


def test_nested_namespaces_are_denied(pool, no_leftovers):
    r = pool.run("unshare -U true; echo $?; unshare -n true; echo $?; unshare -r true; echo $?; "
                 "bwrap --ro-bind / / true 2>/dev/null; echo $?; cat /proc/sys/user/max_user_namespaces",
                 language="bash")
    codes = r.stdout.split()
    assert codes[:4] == ["1", "1", "1", "1"] or all(c != "0" for c in codes[:4]), r
    no_leftovers(pool)


def test_symlink_tricks(pool, no_leftovers, tmp_path):
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    keep = host_dir / "keep.txt"
    keep.write_text("keep me")
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    os.chmod(tmp_path, 0o755)
    code = (f"ln -s {secret} leak.txt; ln -s /etc/hostname host.txt; ln -s / rootlink; "
            f"ln -s {host_dir} hostdir; ln -s {keep} keep.txt; mkdir d; ln -s {host_dir} d/sub; "
            "mkfifo fifo; echo ok")
    r = pool.run(code, language="bash", collect=["leak.txt", "host.txt", "rootlink/etc/passwd",
                                                   "hostdir/keep.txt", "d/sub/keep.txt", "fifo"])
    assert r.status == "ok", r
    assert r.files == {}, r.files  # no link followed, the fifo not read
    assert keep.read_text() == "keep me" and secret.read_text() == "top secret"  # cleanup did not follow
    # a later step cannot make the sandbox write files through a link left by an earlier one
    rs = pool.run_sequence([{"code": f"ln -s {keep} planted.txt", "language": "bash"},
                            {"code": "cat planted.txt", "language": "bash", "files": {"planted.txt": "overwrite"}}])
    assert keep.read_text() == "keep me"
    # the program caused it: "error" (not run), never sandbox_error (which a trainer may skip)
    assert rs[1].status == "error" and rs[1].exit_code is None, rs[1]
    assert "left by an earlier step" in rs[1].message and "planted.txt" in rs[1].message
    no_leftovers(pool)


def test_device_and_proc_surface(pool, no_leftovers):
    r = pool.run("ls /dev; ls /sys 2>&1; cat /proc/kcore 2>&1 | head -c 50; echo; "
                 "echo 1 > /proc/sysrq-trigger 2>&1; echo c > /proc/sysrq-trigger 2>&1; "
                 "cat /proc/self/mountinfo | wc -l", language="bash")
    assert r.status == "ok"
    assert "sda" not in r.stdout and "vda" not in r.stdout and "kmsg" not in r.stdout
    assert _host_alive()
    no_leftovers(pool)


def test_worker_state_is_private_on_the_host(pool):
    """The host-side slot directories are root-owned and not listable by other users."""
    state = SandboxConfig().state_dir
    st = os.stat(state)
    assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o711
    st = os.stat(os.path.join(state, "locks"))
    assert (st.st_mode & 0o777) == 0o700
