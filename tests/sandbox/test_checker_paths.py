"""The code checker's reward paths that a policy could find, each pinned by an adversarial
completion that must score 0 (or a pair that must compare equal): a solution that timed out
after its records were written, a result that is not plain data replayed where None is
expected, a duplicated call record forged from inside the solution, a terminal task whose setup
failed, and set arguments whose iteration order differs between processes.

The mutations of scripts/mutate.py named `checker.*` break each path the way described and
these tests catch them. About 5 s on 2 busy cores (two-worker pool)."""

import pytest

from sandbox import Task
from sandbox import plaindata as pd
from sandbox.verifiers import Verifier


@pytest.fixture(scope="module")
def verifier(pool):
    return Verifier(pool)


def _task(test, entry="f", **kw):
    return Task(id="t", family="python_tests", test=test, entry_point=entry,
                meta={"prompt_is_text": True}, **kw)


def test_a_solution_that_times_out_after_its_records_scores_0(verifier):
    """Every record (right values) and the harness's `done` are written, then a non-daemon
    thread keeps the process alive past the timeout: the verdict's cases pass, the run did not."""
    t = _task("def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n", timeout_s=2)
    hang = ("import threading, time\n_n = [0]\ndef f(x):\n    _n[0] += 1\n    if _n[0] == 2:\n"
            "        threading.Thread(target=time.sleep, args=(60,)).start()\n    return x * x\n")
    s, d = verifier.verify(t, hang)
    assert s == 0.0 and d["status"] == "timeout" and d["sandbox_status"] == "timeout", d
    assert [c["passed"] for c in d["cases"]] == [True, True], d  # only the run's status says no
    assert verifier.verify(t, "def f(x):\n    return x * x\n")[0] == 1.0


def test_a_result_that_is_not_plain_data_is_never_replayed_as_a_value(verifier):
    """Where the expected value is None, an object that cannot cross must fail its case, not be
    replayed as None (or anything else)."""
    t = _task("def check(candidate):\n    assert candidate([]) is None\n    assert candidate([2, 1]) == 2\n")
    assert verifier.verify(t, "def f(xs):\n    return max(xs) if xs else None\n")[0] == 1.0
    for bad in ("class Nothing:\n    pass\ndef f(xs):\n    return max(xs) if xs else Nothing()\n",
                "def f(xs):\n    return max(xs) if xs else print\n",
                "class N(dict):\n    def __eq__(s, o):\n        return o is None\n"
                "def f(xs):\n    return max(xs) if xs else N()\n"):
        s, d = verifier.verify(t, bad)
        assert s == 0.0 and [c["passed"] for c in d["cases"]] == [False, True], d
        assert "not plain data" in d["cases"][0]["error"], d


FORGE_DUPLICATE = r'''
import sys
_n = [0]
def _emit():
    f = sys._getframe()
    while f is not None:
        if "emit" in f.f_locals and "nonce" in f.f_locals:
            return f.f_locals["emit"]
        f = f.f_back
def f(x):
    _n[0] += 1
    if _n[0] == 1:
        return x * x
    # the second call: claim the first call's value again for call 0, then return garbage
    _emit()({"event": "call", "i": 0, "result": x * x, "time_s": 0.0})
    return -1
'''


def test_a_forged_duplicate_record_does_not_stand_in_for_another_call(verifier):
    """The same call twice: the solution answers it once, then forges a second record of call 0
    (through the harness's own emit, found on the stack) and returns garbage for call 1. One
    record per call index counts, so the second case gets the garbage."""
    t = _task("def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(3) == 9\n")
    s, d = verifier.verify(t, FORGE_DUPLICATE)
    assert s == 0.0 and [c["passed"] for c in d["cases"]] == [True, False], d
    # the forger reaches the channel: the same code answering correctly the second time passes
    honest = FORGE_DUPLICATE.replace("    return -1\n", "    return x * x\n")
    assert verifier.verify(t, honest)[0] == 1.0


def test_a_task_whose_setup_failed_is_not_scored(verifier):
    """The commands can make the check pass, but the task's setup failed: no verdict."""
    t = Task(id="s", family="terminal", setup="echo partial > data.txt\nexit 3", files={},
             check="test -f done", timeout_s=5)
    s, d = verifier.verify(t, "touch done")
    assert s == 0.0 and d["status"] == "setup_failed", d
    assert d["steps"]["check"]["exit_code"] == 0, d  # the check alone would have passed
    ok = Task(id="s", family="terminal", setup="echo partial > data.txt", check="test -f done", timeout_s=5)
    assert verifier.verify(ok, "touch done")[0] == 1.0


def test_set_elements_cross_in_one_canonical_order(verifier):
    """Equal sets encode equally whatever their iteration order (1 and 9 collide in a small
    table, so insertion order decides it; strings iterate by the process's hash seed, which
    differs between the host that reads the test and the checker that runs it)."""
    a, b = {1, 9}, set()
    b.add(9)
    b.add(1)
    assert list(a) != list(b)  # the same set, iterated differently
    assert pd.encode(a) == pd.encode(b) and pd.dumps(frozenset(a)) == pd.dumps(frozenset(b))
    assert pd.key_of(pd.encode_call((a,), {})) == pd.key_of(pd.encode_call((b,), {}))
    words = [f"w{i}" for i in range(12)]
    t = _task("def check(candidate):\n" + "".join(
        f"    assert candidate({set(words[k:k + 6])!r}) == {sorted(words[k:k + 6])!r}\n"
        for k in range(0, 7, 2)))
    s, d = verifier.verify(t, "def f(s):\n    return sorted(s)\n")
    assert s == 1.0 and d["runs"] == ["solution", "verdict"], d
