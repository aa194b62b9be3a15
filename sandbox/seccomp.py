"""A seccomp deny-list, built as a classic BPF program in pure Python.

The program is an array of `struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}` records, packed with
`struct`, in the form bubblewrap's `--seccomp FD` reads (and `prctl(PR_SET_SECCOMP)` takes).

Layout of the filter (checked top to bottom):

1. the architecture must be the one this table was built for (x86_64 or aarch64), anything else
   (e.g. the i386 `int 0x80` entry point on x86_64) kills the process;
2. on x86_64, x32-ABI syscall numbers (bit 30 set) fail with ENOSYS;
3. dangerous syscalls fail with EPERM: ptrace, process_vm_readv/writev, mount and the new mount API,
   umount2, pivot_root, chroot, unshare, setns, bpf, perf_event_open, keyctl/add_key/request_key,
   io_uring_*, userfaultfd, kexec_*, (f)init_module/delete_module, reboot, swapon/off, acct, syslog,
   quotactl(_fd), open_by_handle_at/name_to_handle_at, lookup_dcookie, vhangup, kcmp, pidfd_getfd,
   fanotify_init, clock/time setting, iopl/ioperm/modify_ldt, uselib, _sysctl;
4. `clone` with any namespace flag fails with EPERM; `clone3` fails with ENOSYS so that libc falls
   back to `clone`, whose flags a classic BPF filter can inspect (clone3 passes them in memory);
5. `ioctl(fd, TIOCSTI | TIOCLINUX, ...)` fails with EPERM (terminal input injection); only the low
   32 bits of the request are compared, which is what the kernel uses (`unsigned int cmd`);
6. `socket()` is allowed for AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK only (AF_VSOCK, for one,
   is not isolated by a network namespace and would reach the hypervisor); others fail with
   EAFNOSUPPORT;
7. everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7

# offsets in struct seccomp_data (little-endian hosts)
_OFF_NR = 0
_OFF_ARCH = 4


def _off_arg_lo(i: int) -> int:
    return 16 + 8 * i


# Syscall numbers, from <asm/unistd_64.h> (x86_64) and <asm-generic/unistd.h> (aarch64).
_DENY_NAMES = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
    "unshare", "setns", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "syslog", "quotactl", "quotactl_fd", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "vhangup", "kcmp", "pidfd_getfd", "fanotify_init",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "fsopen", "fsconfig", "fsmount",
    "fspick", "open_tree", "move_mount", "mount_setattr", "iopl", "ioperm", "modify_ldt", "uselib",
    "_sysctl",
)

SYSCALLS = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "bpf": 321,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168,
        "acct": 163, "syslog": 103, "quotactl": 179, "quotactl_fd": 443, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "lookup_dcookie": 212, "vhangup": 153, "kcmp": 312,
        "pidfd_getfd": 438, "fanotify_init": 300, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "open_tree": 428, "move_mount": 429, "mount_setattr": 442, "iopl": 172,
        "ioperm": 173, "modify_ldt": 154, "uselib": 134, "_sysctl": 156,
        "ioctl": 16, "clone": 56, "clone3": 435, "socket": 41,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268, "bpf": 280,
        "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225,
        "acct": 89, "syslog": 116, "quotactl": 60, "quotactl_fd": 443, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "lookup_dcookie": 18, "vhangup": 58, "kcmp": 272,
        "pidfd_getfd": 438, "fanotify_init": 262, "settimeofday": 170, "clock_settime": 112,
        "clock_adjtime": 266, "adjtimex": 171, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "open_tree": 428, "move_mount": 429, "mount_setattr": 442,
        "ioctl": 29, "clone": 220, "clone3": 435, "socket": 198,
    },
}

AUDIT_ARCH = {"x86_64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64}

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
CLONE_NS_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
X32_SYSCALL_BIT = 0x40000000


class UnsupportedArch(RuntimeError):
    pass


def host_arch() -> str:
    m = platform.machine().lower()
    if m in ("x86_64", "amd64"):
        return "x86_64"
    if m in ("aarch64", "arm64"):
        return "aarch64"
    raise UnsupportedArch(f"no seccomp syscall table for architecture {m!r}")


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _ld(off: int) -> bytes:
    return _ins(_LD_W_ABS, 0, 0, off)


def _ret(k: int) -> bytes:
    return _ins(_RET_K, 0, 0, k)


def _errno(e: int) -> int:
    return RET_ERRNO | (e & 0xFFFF)


def build_filter(arch: str | None = None) -> bytes:
    """Returns the packed BPF program (a multiple of 8 bytes) for `arch` (default: this host)."""
    arch = arch or host_arch()
    if arch not in SYSCALLS:
        raise UnsupportedArch(f"no seccomp syscall table for architecture {arch!r}")
    nr = SYSCALLS[arch]
    prog: list[bytes] = [
        _ld(_OFF_ARCH),
        _ins(_JEQ_K, 1, 0, AUDIT_ARCH[arch]),
        _ret(RET_KILL_PROCESS),
        _ld(_OFF_NR),
    ]
    if arch == "x86_64":
        prog += [_ins(_JGE_K, 0, 1, X32_SYSCALL_BIT), _ret(_errno(errno.ENOSYS))]
    for name in _DENY_NAMES:
        if name in nr:
            prog += [_ins(_JEQ_K, 0, 1, nr[name]), _ret(_errno(errno.EPERM))]
    # clone3: ENOSYS, so libc uses clone(2) whose flags are visible to the filter.
    prog += [_ins(_JEQ_K, 0, 1, nr["clone3"]), _ret(_errno(errno.ENOSYS))]
    # clone: no namespace flags.
    prog += [
        _ins(_JEQ_K, 0, 4, nr["clone"]),
        _ld(_off_arg_lo(0)),
        _ins(_JSET_K, 0, 1, CLONE_NS_FLAGS),
        _ret(_errno(errno.EPERM)),
        _ret(RET_ALLOW),
    ]
    # ioctl: no terminal input injection.
    prog += [
        _ins(_JEQ_K, 0, 5, nr["ioctl"]),
        _ld(_off_arg_lo(1)),
        _ins(_JEQ_K, 1, 0, TIOCSTI),
        _ins(_JEQ_K, 0, 1, TIOCLINUX),
        _ret(_errno(errno.EPERM)),
        _ret(RET_ALLOW),
    ]
    # socket: allow-listed address families.
    fams = ALLOWED_SOCKET_FAMILIES
    block = [_ld(_off_arg_lo(0))]
    for i, fam in enumerate(fams):
        # jump to the final RET_ALLOW on a match: skip the remaining compares and the errno return
        block.append(_ins(_JEQ_K, len(fams) - i, 0, fam))
    block += [_ret(_errno(errno.EAFNOSUPPORT)), _ret(RET_ALLOW)]
    prog += [_ins(_JEQ_K, 0, len(block), nr["socket"])] + block
    prog.append(_ret(RET_ALLOW))
    out = b"".join(prog)
    assert len(out) % 8 == 0 and len(out) // 8 < 4096
    return out


def describe() -> dict:
    """What the filter denies (for reports)."""
    return {
        "arch": host_arch(),
        "denied_eperm": [n for n in _DENY_NAMES if n in SYSCALLS[host_arch()]],
        "clone_namespace_flags": "EPERM",
        "clone3": "ENOSYS",
        "ioctl": ["TIOCSTI", "TIOCLINUX"],
        "socket_families_allowed": ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"],
        "foreign_arch": "kill process",
    }


def install_current_process(program: bytes | None = None) -> None:
    """Installs the filter on the calling thread (and its future children) via prctl.

    Sets PR_SET_NO_NEW_PRIVS first, as an unprivileged process must. Used by the math worker; the
    code sandbox passes the program to bwrap instead.
    """
    import ctypes

    program = program if program is not None else build_filter()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "prctl(PR_SET_SECCOMP) failed")
