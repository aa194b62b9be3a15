"""The seccomp BPF program: structure, arch check, and its effect on a real process."""

import os
import struct
import subprocess
import sys

import pytest

from sandbox import seccomp


def _decode(prog):
    return [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_program_structure(arch):
    prog = seccomp.build_filter(arch)
    ins = _decode(prog)
    assert len(prog) % 8 == 0 and 10 < len(ins) < 255
    assert ins[0] == (0x20, 0, 0, 4)  # load arch
    assert ins[1][3] == seccomp.AUDIT_ARCH[arch]
    assert ins[2] == (0x06, 0, 0, seccomp.RET_KILL_PROCESS)
    assert ins[-1] == (0x06, 0, 0, seccomp.RET_ALLOW)
    # every jump lands inside the program
    for pc, (code, jt, jf, _) in enumerate(ins):
        if code & 0x07 == 0x05:
            assert pc + 1 + max(jt, jf) < len(ins)
    denied = {k for (c, jt, jf, k) in ins if c == 0x15 and jt == 0 and jf == 1}
    nr = seccomp.SYSCALLS[arch]
    for name in ("ptrace", "mount", "unshare", "setns", "bpf", "keyctl", "io_uring_setup", "perf_event_open",
                 "process_vm_readv", "process_vm_writev", "clone3"):
        assert nr[name] in denied, name


def test_unknown_arch():
    with pytest.raises(seccomp.UnsupportedArch):
        seccomp.build_filter("mips")


def test_filter_in_a_real_process():
    """install_current_process() in a child: denied calls fail with EPERM, the rest works."""
    code = (
        "import ctypes, os, socket, threading\n"
        "from sandbox import seccomp\n"
        "seccomp.install_current_process()\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = seccomp.SYSCALLS[seccomp.host_arch()]\n"
        "print(libc.syscall(nr['ptrace'], 0, 0, 0, 0), ctypes.get_errno())\n"
        "print(libc.syscall(nr['unshare'], 0x10000000), ctypes.get_errno())\n"
        "try:\n    socket.socket(40, socket.SOCK_STREAM)\nexcept OSError as e:\n    print('vsock', e.errno)\n"
        "socket.socket().close(); socket.socketpair()\n"
        "t = threading.Thread(target=print, args=('thread ok',)); t.start(); t.join()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    os._exit(7)\n"
        "print('fork', os.waitpid(pid, 0)[1] >> 8)\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:5] == ["-1 1", "-1 1", "vsock 97", "thread ok", "fork 7"]
