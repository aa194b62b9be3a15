"""Verifiers: HumanEval-style unit tests, stdin/stdout cases, math-verify, terminal tasks."""

import dataclasses
import os

import pytest

from sandbox import Task, load_humaneval
from sandbox.mathverify import MathVerifier
from sandbox.verifiers import Verifier, extract_code, normalize_output, outputs_match

DATA = os.path.join(os.path.dirname(__file__), "data", "humaneval_sample.jsonl.gz")


@pytest.fixture(scope="module")
def math():
    with MathVerifier(workers=1) as mv:
        yield mv


@pytest.fixture(scope="module")
def verifier(pool, math):
    return Verifier(pool, math)


@pytest.fixture(scope="module")
def humaneval():
    return load_humaneval(DATA)


def test_humaneval_canonical_solutions_pass(verifier, humaneval):
    results = verifier.verify_batch(humaneval, [t.canonical_solution for t in humaneval])
    for t, (score, d) in zip(humaneval, results):
        assert score == 1.0, (t.id, d)
        assert d["status"] == "pass" and d["n_passed"] == d["n_cases"] > 0 and d["completed"]
        assert all(c["passed"] and c["time_s"] >= 0 for c in d["cases"])


def test_wrong_solutions_fail_with_case_details(verifier, humaneval):
    t = next(t for t in humaneval if t.entry_point == "greatest_common_divisor")
    score, d = verifier.verify(t, "    return 1\n")
    assert score == 0.0 and d["status"] == "fail"
    assert [c["passed"] for c in d["cases"]] == [True, False, False, False]
    assert "AssertionError" in d["cases"][1]["error"]
    frac = dataclasses.replace(t, scoring="fraction")
    score, d = verifier.verify(frac, "    return 1\n")
    assert score == pytest.approx(0.25)
    score, d = verifier.verify(t, "    return a +\n")  # syntax error
    assert score == 0.0 and d["error_kind"] == "solution_error" and "SyntaxError" in d["error"]


@pytest.mark.parametrize("hack", [
    "    return len(string)\nimport os\nos._exit(0)\n",
    "    return 0\nimport sys\nsys.exit(0)\n",
    "    return 0\nraise SystemExit(0)\n",
    "    return 0\nprint('\\n' + 'ab' * 16 + ' {\"event\": \"done\"}')\n",
    "    import os\n    os._exit(0)\n",
])
def test_early_exit_and_fake_results_do_not_pass(verifier, humaneval, hack):
    t = next(t for t in humaneval if t.entry_point == "strlen")
    score, d = verifier.verify(t, hack)
    assert score == 0.0, d


def test_timeouts_and_fenced_completions(verifier, humaneval):
    t = dataclasses.replace(next(t for t in humaneval if t.entry_point == "strlen"), timeout_s=1)
    score, d = verifier.verify(t, "    while True:\n        pass\n")
    assert score == 0.0 and d["status"] == "timeout"
    fenced = "Here you go:\n```python\ndef strlen(string):\n    return len(string)\n```\nDone."
    assert verifier.verify(t, fenced)[0] == 1.0
    t2 = next(t for t in humaneval if t.entry_point == "has_close_elements")
    fenced = ("```python\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
              "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")
    assert verifier.verify(t2, fenced)[0] == 1.0  # the prompt's imports are kept


def test_mbpp_style_asserts(verifier):
    t = Task(id="mbpp/1", family="python_tests", prompt="Write a function to add two numbers.",
             test="assert add(1, 2) == 3\nassert add(-1, 1) == 0\n", entry_point="add",
             meta={"prompt_is_text": True})
    assert verifier.verify(t, "def add(a, b):\n    return a + b\n")[0] == 1.0
    score, d = verifier.verify(t, "def add(a, b):\n    return 3\n")
    assert score == 0.0 and [c["passed"] for c in d["cases"]] == [True, False]


def test_output_normalisation_rule():
    assert normalize_output("1 2 \r\n3\t\n\n\n") == ["1 2", "3"]
    assert outputs_match("a\nb\n", "a\nb")
    assert outputs_match("a  \nb\n\n", "a\nb  ")
    assert not outputs_match("a\n\nb", "a\nb")  # inner blank lines count
    assert not outputs_match(" a", "a")  # leading whitespace counts
    assert not outputs_match("1  2", "1 2")  # inner spaces count in "lines" mode
    assert outputs_match("1  2\n3", "1 2 3", compare="tokens")
    assert outputs_match("0.3333333", "0.33333334", compare="tokens", float_tol=1e-6)
    assert not outputs_match("0.33", "0.34", compare="tokens", float_tol=1e-6)
    assert extract_code("x\n```python\nprint(1)\n```\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("no fences") == "no fences"


def test_stdio_cases(verifier):
    t = Task(id="sum", family="stdio", prompt="Read two ints, print their sum.",
             cases=[{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
                    {"input": "5 5", "output": "10\n\n"}], timeout_s=5)
    good = "a, b = map(int, input().split())\nprint(a + b, end='  \\r\\n\\n')"
    score, d = verifier.verify(t, good)
    assert score == 1.0 and d["n_passed"] == 3, d
    score, d = verifier.verify(t, "print(3)")
    assert score == 0.0 and [c["passed"] for c in d["cases"]] == [True, False, False]
    assert d["cases"][1]["expected"] == "6" and d["cases"][1]["actual"] == "3\n"
    assert verifier.verify(dataclasses.replace(t, scoring="fraction"), "print(3)")[0] == pytest.approx(1 / 3)
    score, d = verifier.verify(dataclasses.replace(t, timeout_s=1), "while True: pass")
    assert score == 0.0 and d["status"] == "timeout"
    bash = Task(id="sh", family="stdio", language="bash", cases=[{"input": "b\na\n", "output": "a\nb\n"}])
    assert verifier.verify(bash, "```bash\nsort\n```")[0] == 1.0


@pytest.mark.parametrize("completion,answer,ok", [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", True),
    (r"So we get $\boxed{0.5}$", r"\frac{1}{2}", True),
    ("The result is 1/2", r"\frac{1}{2}", True),
    (r"$\boxed{\dfrac{2}{4}}$", "1/2", True),
    (r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}", True),
    (r"$\boxed{x^2 + 2x + 1}$", "(x+1)^2", True),
    (r"$\boxed{\{1, 2\}}$", r"\{2, 1\}", True),
    (r"$\boxed{0.6}$", "1/2", False),
    ("I don't know.", "1/2", False),
])
def test_math_equivalences(verifier, completion, answer, ok):
    score, d = verifier.verify(Task(id="m", family="math", answer=answer), completion)
    assert score == (1.0 if ok else 0.0), d
    assert d["status"] == ("pass" if ok else "fail")


def test_math_worker_is_isolated_and_times_out(math):
    assert math.verify("1", "1")[0]
    rep = math.isolation_report()
    if os.geteuid() == 0:
        assert rep.get("netns") and rep.get("seccomp") and rep.get("uid", 0) != 0
    # math-verify's own timeout stops a slow comparison...
    ok, d = math.verify(r"$\boxed{9^{9^{9}}}$", "1", timeout_s=3)
    assert not ok
    # ...and past the wall-clock limit the worker is killed and replaced
    restarts = math.restarts
    ok, d = math.verify(r"$\boxed{9^{9^{9}}}$", "1", timeout_s=1, inner_timeout_s=60)
    assert not ok and d["status"] == "timeout"
    assert math.restarts == restarts + 1
    assert math.verify(r"$\boxed{2}$", "2")[0]


def test_terminal_tasks(verifier):
    t = Task(id="sort", family="terminal", prompt="Sort data.txt into sorted.txt",
             files={"data.txt": "pear\napple\nfig\n"},
             check='test "$(cat sorted.txt)" = "$(printf "apple\\nfig\\npear")"', timeout_s=10)
    score, d = verifier.verify(t, "```bash\nsort data.txt > sorted.txt\n```")
    assert score == 1.0 and d["status"] == "pass", d
    assert d["steps"]["commands"]["status"] == "ok" and d["steps"]["check"]["exit_code"] == 0
    score, d = verifier.verify(t, "cp data.txt sorted.txt")
    assert score == 0.0 and d["status"] == "fail"
    # the check runs in a fresh sandbox: a background process of the commands cannot fake it
    score, d = verifier.verify(t, "(sleep 2; sort data.txt > sorted.txt) & echo later")
    assert score == 0.0
    py_check = dataclasses.replace(t, check="import sys\nsys.exit(0 if open('sorted.txt').read().split() == ['apple', 'fig', 'pear'] else 1)",
                                   check_language="python", setup="echo extra >> data.txt")
    score, d = verifier.verify(py_check, "grep -v extra data.txt | sort > sorted.txt")
    assert score == 1.0, d
    assert set(d["steps"]) == {"setup", "commands", "check"}


def test_batch_mixes_families_in_order(verifier, humaneval):
    tasks = [humaneval[0], Task(id="m", family="math", answer="3"),
             Task(id="s", family="stdio", cases=[{"input": "", "output": "hi"}]),
             Task(id="t", family="terminal", check="test -f done")]
    comps = [humaneval[0].canonical_solution, r"$\boxed{3}$", "print('hi')", "touch done"]
    scores = [s for s, _ in verifier.verify_batch(tasks, comps)]
    assert scores == [1.0, 1.0, 1.0, 1.0]
    scores = [s for s, _ in verifier.verify_batch(tasks, ["    return None\n", "4", "print('ho')", "true"])]
    assert scores == [0.0, 0.0, 0.0, 0.0]
    assert verifier.verify({"id": "d", "family": "math", "answer": "2"}, "2")[0] == 1.0


def test_identical_completions_reuse_the_verdict_only_when_one_was_reached(pool, humaneval):
    """Verifier(reuse=N): a completion identical to one already scored for the same task takes its
    verdict without a sandbox run (pass and fail alike), the first keeps its own details; a
    timeout, another task with the same id, or an evicted entry are scored by their own runs."""
    v = Verifier(pool, reuse=2)
    t = next(t for t in humaneval if t.entry_point == "strlen")
    right, wrong = "    return len(string)\n", "    return len(string) + 1\n"
    res = v.verify_batch([t] * 5, [right, wrong, right, wrong, right])
    assert [s for s, _ in res] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [bool(d.get("reused")) for _, d in res] == [False, False, True, True, True]
    assert v.reused == 3 and res[0][1]["wall_s"] > 0 and res[2][1]["wall_s"] == 0.0
    for first, copy_ in ((0, 2), (1, 3)):  # the same verdict, cases and statuses as the run's
        keep = {k: x for k, x in res[copy_][1].items() if k not in ("reused", "wall_s")}
        assert keep == {k: x for k, x in res[first][1].items() if k != "wall_s"}
    # every field of the task is in the key: the same id with another test is scored anew, and
    # the text that passed above fails there
    other = dataclasses.replace(t, test=t.test.replace("candidate('')", "candidate('x')"))
    assert other.test != t.test
    score, d = v.verify(other, right)
    assert score == 0.0 and not d.get("reused")
    # reuse=2 keeps the two pairs used last (t's right, then other's): t's wrong runs again
    assert not v.verify(t, wrong)[1].get("reused") and v.verify(other, right)[1]["reused"]
    # no verdict to share: every copy of a timed-out completion runs
    slow = dataclasses.replace(t, timeout_s=1)
    res = v.verify_batch([slow] * 2, ["    while True:\n        pass\n"] * 2)
    assert [d["status"] for _, d in res] == ["timeout", "timeout"]
    assert not any(d.get("reused") for _, d in res)
    # a program whose verdict is a coin flip cannot flip it again by being sampled again: every
    # copy takes the first run's verdict
    coin = "    import os\n    return len(string) if os.urandom(1)[0] < 128 else -1\n"
    res = v.verify_batch([t] * 6, [coin] * 6)
    assert len({s for s, _ in res}) == 1 and sum(bool(d.get("reused")) for _, d in res) == 5
    # off by default, and a bad size is refused
    plain = Verifier(pool)
    assert not any(d.get("reused") for _, d in plain.verify_batch([t] * 2, [right] * 2))
    with pytest.raises(ValueError, match="reuse must be an int >= 0"):
        Verifier(pool, reuse=-1)


def test_a_copy_of_a_scoring_the_sandbox_failed_runs_and_takes_its_place(pool, humaneval):
    """The first submission's executor call fails (a crashed worker): its copy is scored by its
    own runs, and a later copy takes that verdict."""
    from concurrent.futures import Future

    class CrashOnce:  # the pool, but its first run fails as a broken worker's would
        def __init__(self):
            self.calls = 0

        def submit(self, *a, **kw):
            self.calls += 1
            if self.calls == 1:
                f = Future()
                f.set_exception(RuntimeError("worker crashed"))
                return f
            return pool.submit(*a, **kw)

        def submit_sequence(self, *a, **kw):
            return pool.submit_sequence(*a, **kw)

    v = Verifier(CrashOnce(), reuse=8)
    t = next(t for t in humaneval if t.entry_point == "strlen")
    first, copy_ = v.submit(t, "    return len(string)\n"), v.submit(t, "    return len(string)\n")
    try:
        status = first.result()[1]["status"]
    except RuntimeError:
        status = "raised"
    assert status in ("sandbox_error", "raised")
    score, d = copy_.result()
    assert score == 1.0 and not d.get("reused")
    score, d = v.verify(t, "    return len(string)\n")
    assert score == 1.0 and d["reused"] and v.reused == 1


def test_reuse_decision_reads_every_run_of_a_scoring():
    from sandbox.verifiers import reusable

    assert reusable({"status": "pass"}) and reusable({"status": "fail", "check_status": "error"})
    assert not reusable({"status": "timeout"}) and not reusable({"status": "sandbox_error"})
    assert not reusable({"status": "fail", "check_status": "timeout"})  # the check was cut off
    assert not reusable({"status": "fail", "cases": [{"status": "ok"}, {"status": "memory"}]})
    assert not reusable({"status": "fail", "steps": {"commands": {"status": "timeout"},
                                                     "check": {"status": "error"}}})
