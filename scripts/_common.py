"""Shared script setup: XLA flags before jax, JAX compilation cache, multi-host init, logging.

The scripts import the project's packages as installed (scripts/setup.sh installs the repository
editable into .venv); they do not patch sys.path. `import _common` works because Python puts the
running script's directory (scripts/) first on the path.
"""

import contextlib
import logging
import os
import sys

from model._xla_env import configure_xla_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

configure_xla_env()  # before jax is imported


ENV_PACKAGES = ("jax", "jaxlib", "flax", "optax", "grain", "orbax-checkpoint", "numpy",
                "ml-collections", "sympy")


def environment() -> dict:
    """What a run's numbers depend on outside the repository (recorded with results): Python,
    the installed versions of ENV_PACKAGES (None: not installed), the allocator
    (model/_xla_env.py) and XLA_FLAGS."""
    import importlib.metadata as md
    import platform

    from model._xla_env import allocator

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"python": platform.python_version(),
            "packages": {name: version(name) for name in ENV_PACKAGES},
            "allocator": allocator(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def setup_jax() -> None:
    import jax

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".cache", "jax"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:  # multi-host: driven by JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
        from model.sharding import maybe_initialize_distributed
        maybe_initialize_distributed()
    except ImportError:
        pass
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("jax", "absl", "orbax", "grain", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def define_dry_run():
    """The run scripts' --dry_run flag (rl.loop.validate_run_config)."""
    from absl import flags

    return flags.DEFINE_bool(
        "dry_run", False, "only validate the config and flags (model, algorithm, task families, "
        "mesh and batch splits for this host's devices), print what would run, and exit")


def stop_on_bad_config(config, phases) -> str:
    """Before anything runs: rl.loop.validate_run_config (what --dry_run prints), and a config it
    rejects (ValueError: a field out of range, an unknown name, a batch that does not split)
    ends the script with the message on stderr and exit code 2, not a traceback. Call after
    setup_jax (on several hosts the device count needs jax.distributed). Returns the report."""
    from rl.loop import validate_run_config

    try:
        return validate_run_config(config, phases=tuple(phases))
    except ValueError as e:
        print(f"error: the config is rejected before anything ran: {e}", file=sys.stderr)
        sys.exit(2)


def dry_run(config, phases) -> None:
    """--dry_run: print validate_run_config's report, or end as stop_on_bad_config does (the
    rejection on stderr, exit code 2)."""
    print(stop_on_bad_config(config, phases))


@contextlib.contextmanager
def stop_on_workdir_mismatch():
    """A workdir that holds another config's checkpoints (rl.workdir.ResumeConfigError) ends the
    script with its message on stderr and exit code 2, not a traceback: it is the user's input,
    and the message names the differing fields and the ways out."""
    from rl.workdir import ResumeConfigError

    try:
        yield
    except ResumeConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
