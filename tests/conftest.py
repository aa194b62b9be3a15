"""Shared test setup: a persistent JAX compilation cache under .cache/ (git-ignored), f32 matmuls,
XLA:CPU without LLVM optimisation passes and with its elemental fusion emitter
(runtime/xla_env.py: compile time dominates here).

Tests stay tiny (2 layers, d_model <= 128, T <= 64) so the whole suite fits in 15 minutes on
2 CPU cores, run by pytest-xdist on one worker per core (setup.cfg: `-n auto --dist loadfile`).
"""

import gc
import os
import pathlib

# jax 0.10.2's XLA:CPU "YNN" fusions segfault on some broadcast-multiply-sum gradients (seen in the
# KDA and DSA backward); disabling that fusion type avoids it (runtime/xla_env.py, same for scripts).
from runtime.xla_env import configure_xla_env, use_jemalloc  # noqa: E402

configure_xla_env(fast_compile=True, allocator=False)  # the allocator: pytest_configure
import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "jax"
CACHE.mkdir(parents=True, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    """The suite's processes on jemalloc, as the scripts (runtime/xla_env.py:use_jemalloc): the
    pytest process re-executes itself once with the library preloaded, before pytest-xdist
    starts its workers (they inherit the preload), with pytest's output capture suspended so the
    new process writes to the real stdout/stderr. KIMI_MALLOC=system runs on glibc's malloc."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    try:
        use_jemalloc(test_suite=True)  # returns unless it re-executes
    finally:
        if capman is not None:
            capman.resume_global_capture()


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (setup.cfg's addopts; the suite runs under pytest-xdist, one test
    file per worker at a time, `--dist loadfile`): one per CPU core, at most 4 and at most one per
    4 GiB of memory (each worker holds its own JAX process, session fixtures and compiled
    programs). `-n 0` runs everything in this process (for a debugger or `-x` on one file)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8.0
    return max(1, min(cores or 1, 4, int(mem_gib // 4)))


def pytest_collection_modifyitems(config, items):
    """Test files with a `slow` test run first. Under `--dist loadfile` each file is one unit of
    work, handed to the workers in this order (setup.cfg's `--no-loadscope-reorder`: without it
    pytest-xdist reorders the files by their number of tests, which put the demo's and the
    loop's files, 2-3 long tests each, last): long units start early, while short ones can still
    fill the other worker (a long file started last would run alone at the end). Order within a
    file is kept (a stable sort), so module fixtures are built once."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
    _deselect_reference_tests(config, items)


def _deselect_reference_tests(config, items):
    """Tests marked `hf_reference` compare with transformers' own classes (the `[hf]` reference
    venv: torch and transformers, a multi-GB install the suite does not make). Where
    transformers is not importable they are deselected (counted as "deselected", never as
    passed or skipped); the checked-in fixtures written from the same classes are compared by
    the rest of the suite either way."""
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        return
    dropped = [item for item in items if item.get_closest_marker("hf_reference")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not item.get_closest_marker("hf_reference")]


@pytest.fixture(scope="session")
def interpret() -> bool:
    """Pallas kernels run in interpret mode unless a GPU/TPU backend is present."""
    return jax.default_backend() == "cpu"


@pytest.fixture(scope="session")
def counting_model():
    """The 2-layer test model (indexer KL on) after 40 AdamW steps on counting sequences
    (token = 3 + (start + t) % 50), next-token + MTP loss: shared by the training test and the
    speculative-decoding tests (a trained MTP head drafts tokens worth accepting).
    Returns a namespace: model, variables, history (per-step metrics)."""
    import types

    from configs import models
    from model.config import ModelConfig
    from model.objectives import counting_tokens, fit_lm_on_batch
    from model.transformer import Model

    c = models.get_config("test")
    c.dsa.indexer_loss_weight = 0.1
    model = Model(ModelConfig.from_dict(c))
    variables, history = fit_lm_on_batch(model, model.init(jax.random.key(0)),
                                         counting_tokens(jax.random.key(5), 16, 32),
                                         steps=40, lr=3e-3)
    return types.SimpleNamespace(model=model, variables=variables, history=history)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """In a pytest-xdist worker: the last full garbage collection runs here, after the session's
    fixtures are torn down and before the worker reports itself finished (xdist sends that after
    every plain sessionfinish hook), and what survives it is frozen (gc.freeze). With the suite's
    compiled programs alive a full collection takes 1-3 s on a loaded 2-core host, and pytest's own
    collections at unconfigure came after the controller's shutdown request, when execnet gives a
    worker 5 s before it interrupts it with SIGINT: an "Exception ignored in _xla_gc_callback ...
    KeyboardInterrupt" traceback after the summary in some full runs (the results were in; the
    exit status was not affected)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.collect()
        gc.freeze()

