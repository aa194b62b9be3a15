"""The executor interface (sandbox/backend.py): a third backend is two methods; requests are checked
before anything is submitted, the same for the local pool and the HTTP client.

Covered: a Slot run in the caller's thread as a backend (run, map, run_batch, run_sequence, the
isolation it keeps); a batch or sequence with one bad request submits nothing (pool, client and
the third backend); the client refuses an empty sequence instead of answering []. Not covered:
the pool's and the client's own transports (test_sandbox_pool.py, test_sandbox_server.py).
"""

from concurrent.futures import Future

import pytest

from sandbox import Executor, InvalidRequest, SandboxClient
from sandbox.executor import Slot


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class InlineExecutor(Executor):
    """One Slot, run in the caller's thread: the whole backend is the two primitives."""

    def __init__(self) -> None:
        self.slot = Slot()
        self.submitted = 0

    def _submit_request(self, req):
        self.submitted += 1
        return _done(self.slot.run(req))

    def _submit_steps(self, reqs):
        self.submitted += 1
        return _done(self.slot.run_sequence(reqs))

    def close(self) -> None:
        self.slot.close()


@pytest.fixture(scope="module")
def inline():
    with InlineExecutor() as ex:
        yield ex


def test_a_third_backend_gets_the_whole_interface(inline):
    assert [r.stdout for r in inline.map(["print(1)", "print(2)"])] == ["1\n", "2\n"]
    rs = inline.run_batch([{"code": "echo b", "language": "bash"}, {"code": "import os; print(os.getuid())"}])
    assert [r.status for r in rs] == ["ok", "ok"] and rs[0].stdout == "b\n"
    assert int(rs[1].stdout) == inline.slot.uid != 0  # isolated as the slot's uid, not ours
    rs = inline.run_sequence([{"code": "echo kept > f", "language": "bash"},
                              {"code": "print(open('f').read().strip())"}])
    assert [r.stdout for r in rs] == ["", "kept\n"]
    assert inline.run("print(open('f').read())").status == "error"  # /work reset after the sequence
    assert inline.run("import time; time.sleep(5)", timeout_s=0.5).status == "timeout"
    with pytest.raises(NotImplementedError, match="no sessions"):
        inline.session()


def test_a_bad_request_in_a_batch_or_sequence_submits_nothing(inline, pool):
    before = inline.submitted
    for ex in (inline, pool):
        with pytest.raises(InvalidRequest):
            ex.run_batch([{"code": "print(1)"}, {"code": "print(2)", "language": "cobol"}])
        with pytest.raises(InvalidRequest):
            ex.run_sequence([{"code": "print(1)"}, {"language": "bash"}])
        with pytest.raises(InvalidRequest):
            ex.submit_sequence([])
    assert inline.submitted == before
    with pytest.raises(InvalidRequest, match="at most 64"):
        pool.submit_sequence([{"code": "pass"}] * 65)


def test_client_checks_requests_before_sending():
    # nothing listens there: a request that were sent would come back as a sandbox_error result
    with SandboxClient("http://127.0.0.1:9", retries=0) as c:
        with pytest.raises(InvalidRequest):
            c.submit_sequence([])  # was sent, and answered [] (no steps, no results)
        with pytest.raises(InvalidRequest):
            c.run_batch([{"code": "print(1)"}, {"files": {"a": "b"}}])
        with pytest.raises(InvalidRequest):
            c.submit("print(1)", files={"../x": "y"})
        assert c.stats()["requests"] == 0
        r = c.run("print(1)")  # a valid one is sent, and the dead URL is a sandbox_error
        assert r.status == "sandbox_error" and c.stats()["requests"] == 1
