"""The supervised worker-process pool (sandbox/workers.py) as the math verifier uses it.

Covered: a math-verify worker killed in the middle of a check answers "timeout" (a completion that
crashes the checker is scored 0, never turned into a sandbox_error that training would drop), is
replaced, and the next check is answered by the new worker; a verifier whose workers cannot start
answers sandbox_error at once instead of waiting for ever; a worker that exits before saying hello
raises WorkerDied. The sandbox pool's side (crash, hang, broken slot, down slots) is
test_pool_healing.py; timeouts past the wall clock are test_sandbox_verifiers.py.
"""

import os
import signal
import threading
import time

import pytest

from sandbox.mathverify import MathVerifier
from sandbox.workers import WorkerDied, WorkerProcess

SLOW = r"$\boxed{9^{9^{9}}}$"  # sympy works on this for far longer than the test waits


def test_math_worker_killed_mid_check_scores_timeout_and_is_replaced():
    with MathVerifier(workers=1) as mv:
        assert mv.verify(r"$\boxed{2}$", "2")[0]
        pid = mv._workers[0].pid
        fut = mv.submit(SLOW, "1", timeout_s=120, inner_timeout_s=120)
        time.sleep(0.5)  # the check is running in the worker
        os.kill(pid, signal.SIGKILL)
        ok, d = fut.result(timeout=60)
        assert not ok and d["status"] == "timeout" and "died" in d["error"], d
        assert mv.restarts == 1
        assert mv.verify(r"$\boxed{\frac{1}{2}}$", "0.5")[0]
        assert mv._workers[0].pid != pid


class _NoStart(MathVerifier):
    def _spawn(self, i, first):
        raise RuntimeError("math-verify is not installed (test)")


def test_verifier_without_a_worker_answers_sandbox_error_at_once():
    with _NoStart(workers=1) as mv:
        done = threading.Event()
        fut = mv.submit(r"$\boxed{2}$", "2")
        fut.add_done_callback(lambda _f: done.set())
        assert done.wait(30)
        ok, d = fut.result()
        assert not ok and d["status"] == "sandbox_error" and "not installed" in d["error"], d
        assert mv.spawn_failures >= 1


def test_worker_that_exits_before_hello_raises():
    with pytest.raises(WorkerDied) as e:
        WorkerProcess("sandbox.wire:read_msg", index=0, start_timeout_s=30)  # needs an fd: exits
    assert e.value.kind == "exited"
