"""Machine-level sandbox configuration and the errors every sandbox layer raises.

`SandboxConfig` holds what is fixed per machine (binaries, uid range, state directory, tmpfs and
process caps, CPU quota); per-call limits (timeout, memory, output) are arguments of each run
(sandbox/result.py). Validation of the config fields happens on construction. The errors:
`IsolationUnavailable` (isolation cannot be set up here: says what is missing and the fix),
`UnisolatedWarning` (isolation="none") and `SlotBroken` (a slot cannot guarantee a clean next run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

INSTALL_HINT = "install it with: apt-get install bubblewrap"

DEFAULT_UID_BASE = int(os.environ.get("KIMI_SANDBOX_UID_BASE", "1900000000"))
DEFAULT_STATE_DIR = os.environ.get("KIMI_SANDBOX_STATE_DIR", "/run/kimi-sandbox")


class IsolationUnavailable(RuntimeError):
    """The isolation the sandbox needs cannot be set up here (says what is missing and the fix)."""


class UnisolatedWarning(UserWarning):
    """Emitted when code runs with isolation="none" (trusted local debugging only)."""


@dataclass
class SandboxConfig:
    """Machine-level settings of the sandbox (per-call limits are arguments of `run`)."""

    isolation: str = "bwrap"  # "bwrap" or "none" (trusted local debugging only: warns)
    bwrap: str = "bwrap"  # a name is looked up on PATH (then /usr/bin); a path must exist
    python: str = "/usr/bin/python3"  # must live under /usr (the sandbox sees only /usr)
    python_flags: tuple[str, ...] = ("-S", "-B")  # no site import (fast start), no .pyc writes
    bash: str = "/usr/bin/bash"
    setpriv: str = "/usr/bin/setpriv"
    shell: str = "/usr/bin/dash"
    state_dir: str = DEFAULT_STATE_DIR
    uid_base: int = DEFAULT_UID_BASE
    uid_count: int = 4096
    work_mb: int = 64  # /work tmpfs size (files in, files written by the program)
    work_inodes: int = 8192
    tmp_mb: int = 64  # /tmp and /dev/shm tmpfs size each
    max_procs: int = 64  # pids cgroup limit (processes + threads) and RLIMIT_NPROC backstop
    nofile: int = 1024
    # CPUs per sandbox (cgroup cpu.max in v2, cpu.cfs_quota_us in v1); None = no quota. Needs the
    # cpu controller; where it is missing the isolation report says so (and require_cgroups
    # raises).
    cpu_quota: float | None = 1.0
    # RLIMIT_AS in MB. None = automatic: no address-space limit where the memory cgroup enforces
    # memory_mb (threads and malloc arenas reserve far more address space than they use), and
    # memory_mb + 4096 where there is no memory cgroup (then the only memory limit).
    address_space_mb: int | None = None
    require_cgroups: bool = False  # raise instead of warning when no memory/pids cgroup exists
    extra_ro_binds: tuple[tuple[str, str], ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # extra variables (not for isolated runs)

    def __post_init__(self) -> None:
        if self.cpu_quota is not None and not (isinstance(self.cpu_quota, (int, float))
                                               and 0.01 <= self.cpu_quota <= 1024):
            raise ValueError(f"cpu_quota must be None or a number of CPUs in [0.01, 1024], "
                             f"got {self.cpu_quota!r}")
        if self.address_space_mb is not None and not (isinstance(self.address_space_mb, int)
                                                      and self.address_space_mb >= 64):
            raise ValueError(f"address_space_mb must be None or an int >= 64, got "
                             f"{self.address_space_mb!r}")


class SlotBroken(RuntimeError):
    """The slot cannot guarantee a clean next run (its working directory could not be reset, or
    a process of it could not be killed). The worker answers the current run, then is replaced."""
