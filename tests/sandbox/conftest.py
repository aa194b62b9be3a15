"""Shared fixtures for the sandbox tests: one 2-worker pool for the session, and a check that no
process of a pool's sandbox uids is left."""

import os
import time

import pytest

from sandbox import SandboxPool
from sandbox.host import pids_of_uid


@pytest.fixture(scope="session")
def pool():
    with SandboxPool(workers=2) as p:
        yield p


def leftover_processes(pool) -> dict[int, list[int]]:
    """uid -> pids of processes still running as one of the pool's sandbox uids."""
    return {u: pids for u in pool.worker_uids() if u is not None and (pids := pids_of_uid(u))}


def assert_no_leftovers(pool, grace_s: float = 5.0):
    """No process of the pool's sandbox uids is left, allowing grace_s for ones already being
    torn down: a run's result can arrive while its sandbox's last processes still exit (seen on
    a loaded 2-core host: 3 pids of the slot's uid right after the result, in a run of the full
    suite). The attacks the tests leave behind sleep 30-1000 s, so a leak still fails."""
    left = {}

    def clean():  # keeps the last look, for the message
        nonlocal left
        left = leftover_processes(pool)
        return not left

    wait_for(clean, timeout_s=grace_s)
    assert not left, f"sandbox processes survived the run: {left}"


def wait_for(pred, timeout_s=30.0, interval_s=0.02):
    """Polls pred() until true (a liveness wait, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval_s)
    return pred()


@pytest.fixture
def no_leftovers():
    """assert_no_leftovers(pool) as a fixture (test modules cannot import conftest)."""
    return assert_no_leftovers


@pytest.fixture
def secret_token():
    return "kimi-secret-" + os.urandom(8).hex()


def assert_clean_next(pool, probes_per_slot: int = 2):
    """After an adversarial program: the pool's next runs (several per slot, so every slot is
    probed) are ok in an empty working directory, and every slot is up."""
    rs = pool.map(["import os; print(sorted(os.listdir('.')))"] * (probes_per_slot * pool.n))
    bad = [r for r in rs if r.status != "ok" or r.stdout != "[]\n"]
    assert not bad, bad[:2]
    h = pool.health()
    assert h["up"] == h["workers"], h


@pytest.fixture
def clean_next():
    """assert_clean_next(pool) as a fixture."""
    return assert_clean_next
