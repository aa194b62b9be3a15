"""The isolation preflight: can bubblewrap isolation be set up on this host, and if not, why.

`check_isolation(cfg)` lists what prevents it (bwrap missing, user namespaces disabled or
restricted by sysctl/AppArmor, setpriv or dash missing, interpreters outside /usr, which is all a
sandbox sees), each with the command that fixes it; empty means go. It reads files and looks up
binaries only: nothing is started. The probe run that proves a sandbox really starts is part of
`Slot` set-up (sandbox/executor.py).
"""

from __future__ import annotations

import os
import shutil

from .config import INSTALL_HINT, SandboxConfig


def _which(path: str, name: str) -> str | None:
    """An explicit path must exist; a bare name is looked up on PATH, then in /usr/bin."""
    if "/" in path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    found = shutil.which(path)
    if found:
        return os.path.realpath(found)
    fallback = os.path.join("/usr/bin", path)
    return fallback if os.path.isfile(fallback) and os.access(fallback, os.X_OK) else None


# kernel knobs that stop unprivileged user namespaces: (sysctl, blocking value, fix, message);
# a knob this kernel lacks blocks nothing
_SYSCTL_PROBLEMS = (
    ("kernel.unprivileged_userns_clone", "0", "1", "unprivileged user namespaces are disabled"),
    ("kernel.apparmor_restrict_unprivileged_userns", "1", "0",
     "AppArmor restricts unprivileged user namespaces"),
)


def check_isolation(cfg: SandboxConfig) -> list[str]:
    """Problems that prevent bubblewrap isolation here (empty when it can be set up)."""
    problems = []
    if _which(cfg.bwrap, "bwrap") is None:
        where = cfg.bwrap if "/" in cfg.bwrap else f"{cfg.bwrap!r} on PATH or in /usr/bin"
        problems.append(f"bubblewrap (bwrap) not found ({where}): {INSTALL_HINT}")
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read().strip() or 0) == 0:
                problems.append("user namespaces are disabled (user.max_user_namespaces = 0): "
                                "sysctl -w user.max_user_namespaces=15000")
    except OSError:
        problems.append("this kernel has no user namespaces (/proc/sys/user/max_user_namespaces)")
    for key, bad, fix, message in _SYSCTL_PROBLEMS:
        try:
            with open("/proc/sys/" + key.replace(".", "/")) as f:
                if f.read().strip() == bad:
                    problems.append(f"{message}: sysctl -w {key}={fix}")
        except OSError:
            pass
    for tool, name in ((cfg.setpriv, "setpriv (util-linux)"), (cfg.shell, "dash")):
        if tool == cfg.setpriv and os.geteuid() != 0:
            continue
        if not (os.path.isfile(tool) and os.access(tool, os.X_OK)):
            problems.append(f"{name} not found at {tool}: apt-get install util-linux dash")
    for interp in (cfg.python, cfg.bash):
        if not os.path.realpath(interp).startswith("/usr/"):
            problems.append(f"interpreter {interp} is not under /usr, which is all the sandbox sees")
        elif not os.path.isfile(interp):
            problems.append(f"interpreter {interp} not found (apt-get install python3 bash)")
    return problems
