"""The python_tests protocol (sandbox/python_tests.py): correct solutions of tests that mutate
arguments, expect exceptions, feed results back as arguments, draw random inputs or compute
expected values in statements still pass (no false negatives); what cannot cross as plain data
fails with a message; static vs collected arguments; HumanEval canonical solutions on a fixed
spread (all 164 run in `python scripts/bench.py sandbox`)."""

import os

import pytest

from sandbox import Task, load_humaneval, python_tests
from sandbox.verifiers import Verifier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUMANEVAL = load_humaneval(os.path.join(ROOT, "sandbox", "tasks", "data", "HumanEval.jsonl.gz"))
DYNAMIC = {"HumanEval/32", "HumanEval/38", "HumanEval/44", "HumanEval/50", "HumanEval/53", "HumanEval/151"}


@pytest.fixture(scope="module")
def verifier(pool):
    return Verifier(pool)


def _task(test, entry="f", **kw):
    return Task(id="t", family="python_tests", test=test, entry_point=entry,
                meta={"prompt_is_text": True}, **kw)


def test_humaneval_canonical_spread_passes(verifier):
    """Every task whose arguments need a collect run, and every 12th of the rest."""
    spread = [t for i, t in enumerate(HUMANEVAL) if t.id in DYNAMIC or i % 12 == 0]
    assert len(spread) >= 18
    res = verifier.verify_batch(spread, [t.canonical_solution for t in spread])
    bad = [(t.id, d) for t, (s, d) in zip(spread, res) if s != 1.0]
    assert not bad, bad
    for _, d in res:
        assert d["status"] == "pass" and d["n_passed"] == d["n_cases"] > 0
        assert d["runs"][-2:] == ["solution", "verdict"], d["runs"]


def test_static_arguments_need_no_collect_run():
    assert sum(python_tests.static_calls(t.test, t.entry_point) is None for t in HUMANEVAL) == len(DYNAMIC)
    calls = python_tests.static_calls("def check(c):\n    assert c(3 * 19, k=-2) == 5, str(c(1))\n", "f")
    assert calls == [[[57], [["k", -2]]], [[1], []]]
    for dynamic in ("def check(c):\n    for x in [1]:\n        assert c(x)\n",
                    "def check(c):\n    y = 2\n    assert c(y)\n",
                    "def check(c):\n    assert c(c(1))\n",
                    "def check(c):\n    assert all(c(x) for x in (1, 2))\n",
                    "def check(c):\n    assert c(10 ** 10 ** 10)\n"):
        assert python_tests.static_calls(dynamic, "f") is None, dynamic


def test_mutation_exceptions_dependent_calls_and_random(verifier):
    in_place = _task("def check(candidate):\n    xs = [3, 1, 2]\n    candidate(xs)\n"
                     "    assert xs == [1, 2, 3]\n    d = {}\n    candidate(d)\n    assert d == {'k': 1}\n")
    sol = "def f(x):\n    if type(x) is list:\n        x.sort()\n    else:\n        x['k'] = 1\n"
    assert verifier.verify(in_place, sol)[0] == 1.0
    assert verifier.verify(in_place, "def f(x):\n    return sorted(x) if type(x) is list else {'k': 1}\n")[0] == 0.0

    raises = _task("def check(candidate):\n    try:\n        candidate(-1)\n        assert False\n"
                   "    except ValueError as e:\n        assert 'negative' in str(e)\n    assert candidate(4) == 2\n")
    good = "def f(x):\n    if x < 0:\n        raise ValueError('negative input')\n    return int(x ** 0.5)\n"
    assert verifier.verify(raises, good)[0] == 1.0
    s, d = verifier.verify(raises, "def f(x):\n    return int(abs(x) ** 0.5)\n")
    assert s == 0.0 and d["cases"][0]["passed"] is False

    chained = _task("def check(candidate):\n    assert candidate(candidate(1)) == 3\n"
                    "    y = candidate(5)\n    assert candidate(y + 1) == 8\n")
    s, d = verifier.verify(chained, "def f(x):\n    return x + 1\n")
    assert s == 1.0 and d["runs"].count("solution") >= 2, d["runs"]

    rnd = _task("def check(candidate):\n    import random\n    for _ in range(50):\n"
                "        a, b = random.randint(0, 99), random.randint(0, 99)\n"
                "        assert candidate(a, b) == a * b\n")
    # the solution's own use of random does not shift the test's inputs (another process)
    assert verifier.verify(rnd, "import random\nrandom.random()\ndef f(a, b):\n    random.random()\n"
                                "    return a * b\n")[0] == 1.0


def test_large_results_cross(verifier):
    t = _task("def check(candidate):\n    assert candidate(300000) == list(range(300000))\n")
    s, d = verifier.verify(t, "def f(n):\n    return list(range(n))\n")
    assert s == 1.0, d


def test_what_is_not_plain_data_fails_with_a_message(verifier):
    t = _task("def check(candidate):\n    assert list(candidate(3)) == [0, 1, 2]\n")
    s, d = verifier.verify(t, "def f(n):\n    return bytearray(n)\n")
    assert s == 0.0 and "not plain data" in d["cases"][0]["error"] and "bytearray" in d["cases"][0]["error"]
    assert verifier.verify(t, "def f(n):\n    return list(range(n))\n")[0] == 1.0
    fn_arg = _task("def check(candidate):\n    assert candidate(len) == 3\n")
    s, d = verifier.verify(fn_arg, "def f(g):\n    return g('abc')\n")
    assert s == 0.0 and "not plain data" in d["cases"][0]["error"]


def test_statuses_scoring_and_noise(verifier):
    t = _task("def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 4\n",
              timeout_s=2)
    # a solution that prints (even lines looking like the harness's) still passes
    noisy = "def f(x):\n    print('{\"event\": \"call\", \"i\": 0, \"result\": 9}')\n    return x * x\n"
    assert verifier.verify(t, noisy)[0] == 1.0
    s, d = verifier.verify(t, "def f(x):\n    while True:\n        pass\n")
    assert s == 0.0 and d["status"] == "timeout"
    s, d = verifier.verify(t, "def f(x:\n")
    assert d["error_kind"] == "solution_error" and "SyntaxError" in d["error"] and d["n_cases"] == 2
    frac = _task(t.test, scoring="fraction")
    assert verifier.verify(frac, "def f(x):\n    return 1\n")[0] == pytest.approx(0.5)
    s, d = verifier.verify(_task("def check(candidate):\n    pass\n"), "def f(x):\n    return 1\n")
    assert s == 0.0 and d["status"] == "invalid_task"


def test_forged_records_are_only_claims(verifier):
    """The solution shares its process with the harness, so it can find the nonce and print
    records of its own: deep or huge ones are dropped or bounded on the host (JSON parsing, not
    literal evaluation), and a forged record is only a claimed return value."""
    t = _task("def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n")
    forge = r'''
import sys
def _nonce():
    f = sys._getframe()
    while f is not None:
        if "nonce" in f.f_locals:
            return f.f_locals["nonce"]
        f = f.f_back
def f(x):
    n = _nonce()
    w = sys.stdout.write
    w("\n" + n + " " + "[" * 200000 + "]" * 200000 + "\n")                  # too deep
    w("\n" + n + ' {"event": "call", "i": 1, "result": [' + "0," * 1000000 + '0]}\n')  # huge
    w("\n" + n + ' {"event": "call", "i": 0, "result": 1e999}\n')           # not finite
    w("\n" + n + ' {"event": "call", "i": 0, "result": {"int": "zz"}}\n')  # not plain data
    sys.stdout.flush()
    return x * x if x == 2 else 0
'''
    s, d = verifier.verify(t, forge)
    assert s == 0.0 and d["status"] in ("fail", "output_limit") and d["check_status"] == "ok", d
    assert [c["passed"] for c in d["cases"]] == [False, False], d
    # forged records are claims like any other: the first record of a call counts, so this one
    # (which claims {"int": "zz"} for call 0 and a million zeros for call 1) fails both cases
    assert "bad hex int" in d["cases"][0]["error"], d
