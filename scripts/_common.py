"""Shared script setup: XLA flags before jax, JAX compilation cache, multi-host init, logging.

The scripts import the project's packages as installed (scripts/setup.sh installs the repository
editable into .venv); they do not patch sys.path. `import _common` works because Python puts the
running script's directory (scripts/) first on the path.
"""

import contextlib
import logging
import os
import sys

from runtime.xla_env import configure_xla_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

configure_xla_env()  # before jax is imported


ENV_PACKAGES = ("jax", "jaxlib", "flax", "optax", "grain", "orbax-checkpoint", "numpy",
                "ml-collections", "sympy")


def environment() -> dict:
    """What a run's numbers depend on outside the repository (recorded with results): Python,
    the installed versions of ENV_PACKAGES (None: not installed), the allocator
    (runtime/xla_env.py) and XLA_FLAGS."""
    import importlib.metadata as md
    import platform

    from runtime.xla_env import allocator

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


DEVICE_KINDS = ("h200", "b200", "tpu-v5p", "tpu-v6e")  # model/plan.py:DEVICES


def define_launch_flags():
    """The run scripts' launch-check flags: (--dry_run, --check_devices, --device,
    --processes) as absl flag holders (launch_check says what they check)."""
    from absl import flags

    dry = flags.DEFINE_bool(
        "dry_run", False, "only check the config for the job at hand (its fully sized mesh, "
        "else this host's devices) and exit: model, algorithm, task domains, mesh, batch and "
        "group splits, the train state built for the mesh, memory with --device; exit code 2 "
        "with the reason when something would fail")
    check = flags.DEFINE_integer(
        "check_devices", 0, "--dry_run for a job of this many devices (no device touched: a "
        "pod slice's launch line checked on a laptop)")
    device = flags.DEFINE_enum(
        "device", None, list(DEVICE_KINDS), "the accelerator the launch check plans memory for "
        "(scripts/plan.py; default: this host's when it is one of them, else memory unchecked)")
    processes = flags.DEFINE_integer(
        "processes", 0, "processes of the checked job (default: this job's for its own devices, "
        "else one per 4 devices)")
    return dry, check, device, processes


def define_dry_run():
    """--dry_run alone (scripts without the other launch flags): launch_check for this job."""
    from absl import flags

    return flags.DEFINE_bool(
        "dry_run", False, "only check the config for the job at hand (model, algorithm, task "
        "domains, mesh, batch and group splits, the train state built for the mesh), print "
        "what would run, and exit; exit code 2 with the reason when something would fail")


def host_device_kind() -> str | None:
    """This host's accelerator as a planner device name, or None (CPU, or a kind the planner
    does not know)."""
    import jax

    kind = jax.devices()[0].device_kind.lower()
    for name, key in (("h200", "h200"), ("b200", "b200"), ("tpu-v5p", "v5p"),
                      ("tpu-v6e", "v6")):
        if key in kind:
            return name
    return None


def device_memory(config, phase: str, shape: dict, device: str) -> dict:
    """Per-device bytes the phase needs on a mesh of `shape` of `device`s -> {"train",
    "rollout" (RL; None otherwise), "usable", "source"}: the one place the launch check reads
    memory from. train.aot.launch_memory decides: the programs compiled for the TPU slice where
    libtpu is installed, else the planner; "source" says which."""
    from train.aot import launch_memory

    return launch_memory(config, phase, shape, device)


def memory_check(config, phase: str, shape: dict, device: str | None) -> str:
    """A report line on the phase's per-device memory (device_memory), or ValueError naming what
    does not fit, by how much, and the planner command that shows the breakdown."""
    if device is None:
        return (f"  {phase} memory: NOT CHECKED (no --device given and this host is not one of "
                f"{', '.join(DEVICE_KINDS)})")
    m = device_memory(config, phase, shape, device)
    gb = 1e9
    parts = [("training", m["train"])] + ([("rollouts next to the train state", m["rollout"])]
                                          if m["rollout"] is not None else [])
    over = [f"{what} needs {v / gb:.1f} GB per device, {m['usable'] / gb:.1f} GB usable"
            for what, v in parts if v > m["usable"]]
    mesh = ",".join(f"{a}={n}" for a, n in shape.items())
    if over:
        raise ValueError(
            f"{phase} does not fit on {device} with mesh {mesh} ({m['source']}): "
            + "; ".join(over) + f". The breakdown: python scripts/plan.py --config <this "
            f"config> --mesh {mesh} --device {device} --batch <rows> --seq <row width>")
    return (f"  {phase} memory on {device} ({m['source']}): "
            + ", ".join(f"{what} {v / gb:.1f} GB" for what, v in parts)
            + f" of {m['usable'] / gb:.1f} GB usable per device")


def _unknown_override(argv, config) -> str | None:
    """The first --config.<path>=... of `argv` that names no field of `config` (the ConfigDict
    the --config flag loaded), as an error naming the dotted field and its section's fields."""
    from train.run_config import renamed

    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0]
        if why := renamed(path):
            return why
        node, done = config, []
        for part in path.split("."):
            if not hasattr(node, "keys") or part not in node:
                where = ".".join(done)
                fields = sorted(node.keys()) if hasattr(node, "keys") else []
                return (f"{'.'.join(done + [part])}: unknown field (--config.{path}); valid "
                        f"fields{' of ' + where if where else ''}: {fields}")
            node, done = node[part], done + [part]
    return None


def parse_flags(argv):
    """absl's flag parsing (app.run's flags_parser) where a --config.<field> override naming no
    field of the run config ends the script with the dotted field and the fields its section
    has (exit code 2); any other flag error is absl's."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:  # ConfigDict raises the latter two
        bad = None
        if "config" in flags.FLAGS:  # the --config file's ConfigDict, before its overrides
            flag, spec = flags.FLAGS["config"], None
            for i, a in enumerate(argv):
                if a == "--config" and i + 1 < len(argv):
                    spec = argv[i + 1]
                elif a.startswith("--config="):
                    spec = a.split("=", 1)[1]
            bad = _unknown_override(argv, flag.parser.parse(spec or flag.default_unparsed))
        if bad:
            print(f"error: the config is rejected before anything ran: {bad}", file=sys.stderr)
            sys.exit(2)
        if not isinstance(e, flags.Error):
            raise
        print(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on "
              "flags.", file=sys.stderr)
        sys.exit(1)


def load_run_config(config):
    """The validated run config (train/run_config.py: RunConfig.from_config) of a --config
    ConfigDict after its flags; a field that is unknown, of the wrong type or out of range ends
    the script with the message on stderr and exit code 2 before anything loads."""
    from train.run_config import RunConfig, RunConfigError

    try:
        return RunConfig.from_config(config)
    except RunConfigError as e:
        print(f"error: the config is rejected before anything ran: {e}", file=sys.stderr)
        sys.exit(2)


def launch_check(config, phases, *, num_devices: int | None = None, device: str | None = None,
                 processes: int = 0, start: bool = False) -> str:
    """What --dry_run / --check_devices print: train.launch.validate_run_config for the job (its
    mesh for `num_devices`, default the config's fully sized mesh or this host's devices; its
    `processes`), then the memory of each phase on `device` (memory_check; default this host's
    accelerator), and for RL alone the weights it starts from (train.launch.check_rl_start: a
    missing SFT checkpoint fails a run's start (`start`), and is a warning for --dry_run and
    --check_devices, which may check a launch line away from the job's files).
    Raises ValueError with the reason on anything that would fail."""
    from model import sharding as shd
    from train.launch import check_rl_start, default_processes, resolve_devices, validate_run_config

    n = resolve_devices(config, num_devices)
    try:
        shape = shd.mesh_shape(config.sharding.mesh, n)
    except ValueError as e:
        raise ValueError(f"{e} (sharding.mesh {config.sharding.mesh!r} for {n} devices; to "
                         "check a job of another size: --check_devices=N)") from None
    processes = processes or default_processes(n)
    report = validate_run_config(config, phases=tuple(phases), num_devices=n,
                                 processes=processes)
    device = device or host_device_kind()
    lines = [report] + [memory_check(config, p, shape, device) for p in phases]
    if "rl" in phases and "sft" not in phases:  # RL alone starts from what rl.init_from names
        lines.append(check_rl_start(config, required=start))
    return "\n".join(lines) + "\nOK: nothing above would stop this run at start-up"


def stop_on_bad_config(config, phases, **kw) -> str:
    """Before anything runs (call after setup_jax: on several hosts the device count needs
    jax.distributed): every process checks that all run the same config
    (train.launch.config_agreement: a digest through the distributed runtime, the differing fields
    named), then launch_check (what --dry_run prints; memory only when this host's accelerator
    is known), and the processes exchange their verdicts. Anything rejected on any process (a
    field out of range, an unknown name, a batch that does not split, a state that does not fit,
    a missing checkpoint on one host) ends every process with the message on stderr and exit
    code 2, not a traceback or a hang. Returns the report."""
    from model import sharding as shd
    from train.launch import config_agreement

    try:
        agreed = config_agreement(config)
        report, error = launch_check(config, phases, start=True, **kw), None
    except ValueError as e:
        report, error = None, str(e)
    errors = shd.allgather_json(error)  # every process's verdict: all stop, or none
    bad = [(i, e) for i, e in enumerate(errors) if e]
    if bad:
        where = "" if len(errors) == 1 else " (" + ", ".join(
            f"process {i}" for i, _ in bad) + ")"
        msgs = sorted({e for _, e in bad})
        print(f"error: the config is rejected before anything ran{where}: " + " | ".join(msgs),
              file=sys.stderr)
        sys.exit(2)
    return agreed + "\n" + report


def dry_run(config, phases, **kw) -> None:
    """--dry_run / --check_devices: print launch_check's report, or end with the rejection on
    stderr and exit code 2. Runs without jax.distributed (a launch line checked on a laptop)."""
    try:
        print(launch_check(config, phases, **kw))
    except ValueError as e:
        print(f"error: the config is rejected before anything ran: {e}", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def stop_on_workdir_mismatch():
    """A workdir that holds another config's checkpoints (train.workdir.ResumeConfigError) ends the
    script with its message on stderr and exit code 2, not a traceback: it is the user's input,
    and the message names the differing fields and the ways out. So does a data stream that
    ended on some process (train.phase.DataExhausted, raised on every process at the same step)."""
    from train.phase import DataExhausted
    from train.workdir import ResumeConfigError

    try:
        yield
    except (ResumeConfigError, DataExhausted) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
