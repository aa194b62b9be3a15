"""XLA environment set before jax is imported (tests and scripts call this first).

jax/jaxlib 0.10.2 XLA:CPU: the experimental "YNN" fusions segfault on the gradient of some
broadcast-multiply-sum patterns (hit by the KDA chunked backward and a DSA scatter). An empty
`--xla_cpu_experimental_ynn_fusion_type=` disables them; other XLA_FLAGS are kept.

`fast_compile=True` (the test suite) also sets `--xla_backend_optimization_level=0` (LLVM code
generation without its optimisation passes) and `--xla_cpu_use_fusion_emitters=false` (XLA:CPU's
older elemental emitter for fusions instead of the MLIR fusion emitters). The suite's tiny
programs are dominated by compile time, which both flags shorten (a cold smoke demo; the smoke
model's forward+backward compile, with the same run time; numbers in docs/speed.md). The
numerics are unchanged within the tests' tolerances. Processes the tests start inherit them via
XLA_FLAGS. Scripts keep XLA's defaults. A value already in XLA_FLAGS wins.

It also keeps jax's backend probe quiet ("Unable to initialize backend 'tpu'" on every start of a
machine without a TPU); real warnings still print.

The allocator (`use_jemalloc`, called by `configure_xla_env`): XLA:CPU allocates each run's
temporary buffers with posix_memalign from its worker threads, and glibc serves a request that
large (the matched GRPO train step's 766 MB) with a fresh mmap and unmaps it on free, so every run
faults its whole working set in again (196K minor faults per train step).
jemalloc (Debian's libjemalloc2, installed by scripts/setup.sh) keeps freed pages for reuse:
with MALLOC_CONF `JEMALLOC_CONF` the matched train step, its (allocation-heavy) compile and
the matched GRPO first iteration run faster, with the same output bits (`python -m
benchmarks.grpo_matched`; docs/speed.md: f0dd6f7). A script's process re-executes itself
once at `configure_xla_env` with jemalloc preloaded (LD_PRELOAD can only take effect at process start); the re-executed process drops
LD_PRELOAD and MALLOC_CONF from its environment again, so its children (sandboxed programs,
workers) start as they would have. Not done under pytest, in interactive sessions and notebooks,
for `python -c` / stdin programs, or with KIMI_MALLOC=system; a missing library leaves glibc.

`unroll_threefry_on_cpu()` (called when model/transformer.py is imported, so after jax is) lowers
jax's threefry2x32 hash on CPU as straight-line code, as jax does on GPU and TPU, instead of its
CPU default, a 5-trip rolled loop. The rounds and so the bits are the same. XLA:CPU then fuses each hash
into one kernel instead of a loop of small ones. Every parameter initialiser draws through it, so
it shortens the jitted init (compile + run) and a run's set-up, with identical parameters
(docs/speed.md). The sampler's per-step draw did not change.
"""

import logging
import os

_NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


JEMALLOC_ENV = "KIMI_MALLOC"  # "system": keep glibc's malloc (no re-execution)
JEMALLOC_PATH_ENV = "KIMI_JEMALLOC"  # the library's path, where it is not in a standard place
JEMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2",
                  "/usr/local/lib/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2")
# oversize_threshold 0: requests of any size come from the arenas (jemalloc's default sends
# those over 8 MB to an arena that returns them to the OS at once, glibc's behaviour again);
# freed pages go back to the OS after a minute unused, not at once
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:60000,muzzy_decay_ms:60000"
_REEXEC_MARK = "_KIMI_MALLOC_REEXEC"  # set across the one re-execution (no loop if it fails)


def jemalloc_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """Whether this process runs with jemalloc mapped (preloaded)."""
    try:
        with open(maps_path) as f:
            return "libjemalloc" in f.read()
    except OSError:
        return False


def allocator() -> str:
    """"jemalloc" when this process runs on it, else "system" (recorded with results)."""
    return "jemalloc" if jemalloc_loaded() else "system"


def with_jemalloc(environ, library: str) -> dict:
    """A copy of `environ` that preloads `library` (ahead of any preload already there) with
    JEMALLOC_CONF unless MALLOC_CONF is set: the environment of a process started on jemalloc."""
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(filter(None, (library, environ.get("LD_PRELOAD", ""))))
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    return env


def find_jemalloc() -> str | None:
    """The jemalloc shared library: $KIMI_JEMALLOC, else the first of JEMALLOC_GLOBS present."""
    import glob

    explicit = os.environ.get(JEMALLOC_PATH_ENV)
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for pattern in JEMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def jemalloc_reexec_plan(environ, argv, orig_argv, modules, interactive: bool, loaded: bool,
                         library: str | None, test_suite: bool = False):
    """What `use_jemalloc` does, as a pure function: ("clean", None) to drop the preload from
    this (already re-executed) process's environment, ("keep", None) to keep it there (the test
    suite), ("skip", reason), or ("exec", new environment). argv / orig_argv: sys.argv /
    sys.orig_argv; modules: sys.modules; test_suite: called from the test suite's conftest
    (pytest is then expected, and the preload stays in the environment for its workers)."""
    if environ.get(JEMALLOC_ENV, "jemalloc") == "system":
        return "skip", f"{JEMALLOC_ENV}=system"
    if loaded:
        return ("keep", None) if test_suite else ("clean", None)
    if environ.get(_REEXEC_MARK):
        return "skip", "re-executed once and jemalloc is still not loaded"
    if interactive or "ipykernel" in modules or "IPython" in modules:
        return "skip", "interactive session"
    if ("pytest" in modules or "_pytest" in modules) and not test_suite:
        return "skip", "under pytest"
    if not argv or argv[0] in ("", "-", "-c") or not os.path.exists(argv[0]):
        return "skip", "not started from a script or module file"
    if not orig_argv:
        return "skip", "no original command line to re-execute"
    if library is None:
        return "skip", "libjemalloc.so.2 not found (scripts/setup.sh installs it)"
    env = with_jemalloc(environ, library)
    env[_REEXEC_MARK] = library
    return "exec", env


def use_jemalloc(test_suite: bool = False) -> str:
    """Run this script's process on jemalloc (module docstring): re-executes the process once
    with the library preloaded, or, in the re-executed process, removes the preload from the
    environment its children inherit. test_suite=True (tests/conftest.py): the pytest process
    re-executes itself the same way and keeps the preload, so pytest-xdist's workers start on
    jemalloc too. Returns what it did ("clean" / "keep" / "skip: <reason>"); "exec" does not
    return."""
    import sys

    action, arg = jemalloc_reexec_plan(
        os.environ, sys.argv, getattr(sys, "orig_argv", None), sys.modules,
        bool(getattr(sys, "ps1", None)) or sys.flags.interactive, jemalloc_loaded(),
        find_jemalloc(), test_suite)
    if action == "exec":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, arg)
    if action == "keep":  # the suite's workers inherit the preload (not the one-time mark)
        os.environ.pop(_REEXEC_MARK, None)
        return "keep"
    if action == "clean":
        library = os.environ.pop(_REEXEC_MARK, None)
        if library:  # drop what the re-execution added; a user's own preload stays
            rest = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p != library]
            if rest:
                os.environ["LD_PRELOAD"] = ":".join(rest)
            else:
                os.environ.pop("LD_PRELOAD", None)
            if os.environ.get("MALLOC_CONF") == JEMALLOC_CONF:
                os.environ.pop("MALLOC_CONF")
        return "clean"
    return f"skip: {arg}"


def configure_xla_env(fast_compile: bool = False, allocator: bool = True) -> None:
    """XLA_FLAGS (module docstring) and, with allocator=True, the process on jemalloc
    (`use_jemalloc`: may re-execute the process, so call this first, before other work)."""
    if allocator:
        use_jemalloc()
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.startswith("--xla_cpu_experimental_ynn_fusion_type") for f in flags):
        flags.append(_NO_YNN)
    if fast_compile:
        for flag in _FAST_COMPILE:
            name = flag.split("=")[0]
            if not any(f.split("=")[0] == name for f in flags):
                flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)
    # jax logs "Unable to initialize backend 'tpu' ... libtpu.so" at INFO on every start on a
    # machine without a TPU; absl's handler (scripts run under absl.app) would print it.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def _threefry2x32_unrolled(key1, key2, x1, x2):
    """Threefry-2x32, 20 rounds (Salmon et al. 2011, Random123): jax's own rounds, unrolled."""
    import numpy as np

    def rotl(v, r):
        return (v << np.uint32(r)) | (v >> np.uint32(32 - r))

    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (key1, key2, key1 ^ key2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in rotations[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ rotl(x[1], r)
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return tuple(x)


def unroll_threefry_on_cpu() -> None:
    """Lower jax.extend.random.threefry2x32_p on CPU with `_threefry2x32_unrolled` (module
    docstring). Idempotent; the values jax.random returns do not change."""
    from jax.extend.random import threefry2x32_p
    from jax.interpreters import mlir

    mlir.register_lowering(threefry2x32_p,
                           mlir.lower_fun(_threefry2x32_unrolled, multiple_results=True),
                           platform="cpu")
