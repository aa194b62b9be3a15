"""The command line of one sandboxed run, built from plain values (no state of its own).

A run is `dash -c '<attach cgroups; ulimit ...; exec "$@"'` (`shell_launcher`, with the rlimits of
`rlimits`), then, under a root launcher, `setpriv` to the slot uid with no groups, no
capabilities and no_new_privs, then `bwrap` with `bwrap_args` + `env_args` + the seccomp and
status fds, then the interpreter on the program (`write_program`: /sandbox/main.py|sh, or for
isolated checks a boot program reading the check's text from an fd of an unlinked root-only file).
`write_etc` writes the synthetic /etc that bwrap binds. Used by `Slot` (sandbox/executor.py) and by
sessions (sandbox/session.py) through the Slot methods that wrap these.
"""

from __future__ import annotations

import os
import shlex
import shutil

from .config import SandboxConfig

# Isolated runs (check scripts over files a completion wrote): the program arrives on an fd from
# a root-only, unlinked file, so its text is on no path inside the sandbox; the interpreter
# ignores /work and the environment for its own start-up and search path.
ISOLATED_PY_BOOT = ("import sys\nwith open(int(sys.argv.pop(1)), 'rb') as _kimi_f:\n"
                    "    _kimi_code = compile(_kimi_f.read(), '<check>', 'exec')\n"
                    "del _kimi_f\nexec(_kimi_code)\n")
ISOLATED_SH_BOOT = ('IFS= read -r -d "" __kimi_src <&"$1"; eval "exec $1<&-"; set --; '
                    'eval "$__kimi_src"')
ISOLATED_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                "USER": "sandbox", "LOGNAME": "sandbox", "PYTHONSAFEPATH": "1",
                "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def write_etc(etcdir: str, uid: int, home: str = "/work", as_root: bool = False) -> None:
    """The sandbox's synthetic /etc: passwd and group naming `uid` "sandbox" (home `home`), hosts,
    nsswitch.conf, copies of ld.so.cache and localtime. as_root (a session workspace whose
    commands run as uid 0 of their user namespace): root's home is `home` and its shell bash."""
    root = f"root:x:0:0:root:{home}:/bin/bash\n" if as_root else "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    files = {
        "passwd": f"{root}sandbox:x:{uid}:{uid}:sandbox:{home}:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }
    for name, content in files.items():
        p = os.path.join(etcdir, name)
        with open(p, "w") as f:
            f.write(content)
        os.chmod(p, 0o644)
    for name in ("ld.so.cache", "localtime"):
        src = os.path.join("/etc", name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(etcdir, name))  # follows the localtime link
            os.chmod(os.path.join(etcdir, name), 0o644)
    if os.path.isdir("/etc/alternatives"):
        os.makedirs(os.path.join(etcdir, "alternatives"), exist_ok=True)


def bwrap_args(bwrap: str, cfg: SandboxConfig, etcdir: str, workdir: str, progdir: str, *,
               binds: list[tuple[str, str]] | None = None, chdir: str = "/work",
               uid0: bool = False) -> list[str]:
    """bwrap's options for every run of a slot or session (namespaces, the read-only system view,
    /etc, tmpfs /tmp and /dev/shm, /work, /sandbox, an empty environment), up to the per-run
    ones (environment, seccomp and status fds, the program).

    A session workspace (sandbox/session.py) passes `binds` (host directory, sandbox path) in
    place of `workdir` at /work (a bind at /tmp replaces the per-run tmpfs there), its `chdir`,
    and uid0 (the program runs as uid and gid 0 of its user namespace: still the session's uid on
    the host, no capabilities)."""
    a = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
         "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if uid0:
        a += ["--uid", "0", "--gid", "0"]
    a += ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + d
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
    # /etc: one bind of the slot's synthetic etc (passwd, group, hosts, nsswitch.conf and
    # copies of ld.so.cache and localtime) plus the alternatives symlinks.
    a += ["--ro-bind", etcdir, "/etc"]
    if os.path.isdir("/etc/alternatives"):
        a += ["--ro-bind", "/etc/alternatives", "/etc/alternatives"]
    for src, dst in cfg.extra_ro_binds:
        a += ["--ro-bind", src, dst]
    size = str(cfg.tmp_mb << 20)
    binds = [(workdir, "/work")] if binds is None else binds
    a += ["--proc", "/proc", "--dev", "/dev"]
    if "/tmp" not in {dst for _, dst in binds}:
        a += ["--size", size, "--tmpfs", "/tmp"]
    a += ["--size", size, "--tmpfs", "/dev/shm"]
    for src, dst in binds:
        a += ["--bind", src, dst]
    a += ["--ro-bind", progdir, "/sandbox",
          "--remount-ro", "/",
          "--chdir", chdir, "--clearenv"]
    return a


def env_args(cfg: SandboxConfig, isolated: bool, workspace: dict | None = None) -> list[str]:
    """The program's whole environment (bwrap starts from --clearenv). `workspace` (a session
    workspace, sandbox/session.py: "cwd", "home", "user", "path") sets HOME, USER, LOGNAME and,
    for normal runs, PYTHONPATH (the cwd) and the PATH entries put before the default ones;
    an isolated run keeps its fixed PATH."""
    if isolated:
        env = dict(ISOLATED_ENV)
        if workspace is not None:
            env.update(HOME=workspace["home"], USER=workspace["user"], LOGNAME=workspace["user"])
    else:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8",
               "TMPDIR": "/tmp", "USER": "sandbox", "LOGNAME": "sandbox", "PYTHONPATH": "/work",
               "PYTHONHASHSEED": "0"}
        if workspace is not None:
            env.update(PATH=":".join([*workspace["path"], env["PATH"]]), HOME=workspace["home"],
                       USER=workspace["user"], LOGNAME=workspace["user"],
                       PYTHONPATH=workspace["cwd"])
        env.update(cfg.env)
    a = []
    for k, v in env.items():
        a += ["--setenv", k, v]
    return a


def write_program(cfg: SandboxConfig, progdir: str, req: dict,
                  in_sandbox: bool = True) -> tuple[list[str], int | None]:
    """The program's argv, and for isolated runs the fd its text is read from (else None).

    Normal runs: the program is /sandbox/main.py|sh (read-only bind, mode 0644). Isolated runs:
    the text goes to a root-only (0600) file in the slot's program directory that is opened
    and unlinked at once; the fd is passed down and read by a short boot program given on the
    command line (`-c`), which closes it before the check starts. Under a root launcher the
    check's text is then on no path inside the sandbox, and re-opening the fd through /proc
    is refused (the file belongs to root), so nothing a completion left in /work (a symlink
    to the program, say) lets the check or its children read the check's own source.
    in_sandbox=False (isolation="none"): the program's host path instead of /sandbox/...
    """
    py = req["language"] == "python"
    for stale in ("main.py", "main.sh"):  # no run sees an earlier run's program
        try:
            os.unlink(os.path.join(progdir, stale))
        except FileNotFoundError:
            pass
    if req.get("isolated"):
        path = os.path.join(progdir, ".check")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            data = memoryview(req["code"].encode("utf-8", "surrogateescape"))
            while data:
                data = data[os.write(fd, data):]
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)
        if py:
            return [cfg.python, "-I", "-S", "-B", "-c", ISOLATED_PY_BOOT, str(fd)], fd
        return [cfg.bash, "--norc", "--noprofile", "-c", ISOLATED_SH_BOOT, "check", str(fd)], fd
    if py:
        name, argv = "main.py", [cfg.python, *cfg.python_flags]
    else:
        name, argv = "main.sh", [cfg.bash, "--noprofile", "--norc"]
    path = os.path.join(progdir, name)
    # one run at a time per slot and no sandbox alive now (mode 0644)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(req["code"])
    inner = "/sandbox/" + name if in_sandbox else path
    return argv + [inner], None


def rlimits(cfg: SandboxConfig, req: dict, timeout_s: float, *, memory_cgroup: bool,
            root: bool) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) rlimits of a run: backstops behind the cgroups."""
    import resource as R

    max_procs = req.get("max_procs") or cfg.max_procs
    mem = req["memory_mb"] << 20
    # RLIMIT_AS (see SandboxConfig.address_space_mb): off behind the memory cgroup, which
    # judges what a program uses, not what its threads and malloc arenas reserve.
    if cfg.address_space_mb is not None:
        as_bytes = cfg.address_space_mb << 20
    else:
        as_bytes = None if memory_cgroup else mem + (4096 << 20)
    cpu = int(timeout_s) + 1
    lim = [(R.RLIMIT_CORE, 0, 0), (R.RLIMIT_CPU, cpu, cpu + 1),
           (R.RLIMIT_FSIZE, cfg.work_mb << 20, cfg.work_mb << 20),
           (R.RLIMIT_NOFILE, cfg.nofile, cfg.nofile)]
    if as_bytes is not None:
        lim.append((R.RLIMIT_AS, as_bytes, as_bytes))
    if root:  # RLIMIT_NPROC counts every process of the real uid: only for the slot uid
        lim.append((R.RLIMIT_NPROC, max_procs + 8, max_procs + 8))
    return lim


def shell_launcher(cfg: SandboxConfig, limits: list[tuple[int, int, int]], procs_files: list[str],
                   root: bool, uid: int | None) -> list[str]:
    """dash: attach the slot cgroups, set rlimits, exec setpriv -> bwrap (all in argv).

    Forking the calling process is unsafe (a multi-threaded caller): the launch is a plain
    vfork+exec, at the price of two more execs than setting up in a forked child.
    """
    import resource as R

    flag = {R.RLIMIT_CORE: "-c", R.RLIMIT_CPU: "-t", R.RLIMIT_AS: "-v", R.RLIMIT_FSIZE: "-f",
            R.RLIMIT_NOFILE: "-n", R.RLIMIT_NPROC: "-p"}
    unit = {R.RLIMIT_AS: 1024, R.RLIMIT_FSIZE: 512}
    steps = []
    steps += [f"echo $$ >{shlex.quote(p)}" for p in procs_files]
    for res, soft, hard in limits:
        u = unit.get(res, 1)
        steps.append(f"ulimit -S {flag[res]} {soft // u}")  # soft first: hard >= soft always
        steps.append(f"ulimit -H {flag[res]} {hard // u}")
    steps.append('unset PWD OLDPWD')  # dash exports PWD: keep bwrap's environment empty
    steps.append('exec "$@"')
    argv = [cfg.shell, "-c", " && ".join(steps), "sandbox-launch"]
    if root:
        argv += [cfg.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--"]
    return argv
