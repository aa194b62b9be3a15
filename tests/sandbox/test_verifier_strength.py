"""Verifier strength through the public API (`sandbox.verify_batch(tasks, completions,
executor=pool)`): each attack next to the correct solution that must still pass.

Covered:
  timeouts are failures even after correct output: a stdio program that prints the right answer,
    flushes, then hangs past the timeout scores 0 (and 1/2 under scoring="fraction" when one of
    two cases does it); a terminal task whose check runs the model's script, which prints the
    right answer and then hangs, scores 0; a terminal completion that makes out.txt a FIFO (the
    check's open() blocks until the timeout) scores 0. The executor's own result shows the
    hanging program's partial output was captured (so the verifier saw matching output).
  float tolerance in token comparison is relative as well as absolute: with float_tol 1e-6,
    1e9 vs 1e9+1 and -2.5e12 vs -2.5000001e12 pass, 1e9 vs 1.1e9 and 0.33 vs 0.34 fail, and
    non-numeric tokens must match exactly.
Not covered here: python_tests and answer_check attacks (test_sandbox_adversarial.py,
test_sandbox_verifiers.py), isolation (test_sandbox_executor.py, test_sandbox_seccomp.py).
"""

import pytest

from sandbox import Task, verify_batch

T_OUT = 1.0  # seconds: every hanging program here runs into this

ADD = "a, b = map(int, input().split())\nprint(a + b, flush=True)\n"
HANG = "import time\ntime.sleep(60)\n"


def _stdio(cases, **kw):
    return Task(id="add", family="stdio", cases=cases, timeout_s=T_OUT, **kw)


def test_stdio_correct_output_then_hang_scores_zero(pool):
    one = _stdio([{"input": "2 3\n", "output": "5\n"}])
    two = _stdio([{"input": "2 3\n", "output": "5\n"}, {"input": "40 2\n", "output": "42\n"}],
                 scoring="fraction")
    hang_on_42 = ADD + "if a == 40:\n    import time\n    time.sleep(60)\n"
    (ok, _), (hung, d), (half, d2) = verify_batch(
        [one, one, two], [ADD, ADD + HANG, hang_on_42], executor=pool)
    assert ok == 1.0
    assert hung == 0.0 and d["status"] == "timeout" and not d["cases"][0]["passed"], d
    assert half == 0.5 and [c["passed"] for c in d2["cases"]] == [True, False], d2
    # the precondition that makes this an attack: the hanging run's output was captured
    r = pool.submit(ADD + HANG, stdin="2 3\n", timeout_s=T_OUT).result()
    assert r.status == "timeout" and r.stdout == "5\n", r


def _terminal(check, **kw):
    return Task(id="term", family="terminal", check=check, timeout_s=T_OUT, **kw)


# The check runs the model's solve.sh and compares its output.
RUNS_SCRIPT = _terminal('bash solve.sh > got.txt\ntest "$(cat got.txt)" = 42\n')
# The generators' style: a python check reads out.txt written by the model's commands.
READS_FILE = _terminal("import sys\nsys.exit(0 if open('out.txt').read().strip() == '42' else 1)\n",
                       check_language="python")


def test_terminal_check_that_times_out_scores_zero(pool):
    write = "cat > solve.sh <<'EOF'\necho 42\n{}EOF\n"
    tasks = [RUNS_SCRIPT, RUNS_SCRIPT, READS_FILE, READS_FILE]
    completions = [
        write.format(""),  # correct
        write.format("sleep 60\n"),  # right answer, then the check hangs
        "echo 42 > out.txt",  # correct
        "mkfifo out.txt",  # the check's open() blocks forever
    ]
    results = verify_batch(tasks, completions, executor=pool)
    assert [s for s, _ in results] == [1.0, 0.0, 1.0, 0.0], results
    for _, d in (results[1], results[3]):
        assert d["status"] == "timeout" and d["steps"]["check"]["status"] == "timeout", d


@pytest.mark.parametrize("printed,expected,passes", [
    ("1000000001 7", "1000000000.0 7", True),  # |diff| 1, relative 1e-9
    ("-2.5000001e12 x", "-2.5e12 x", True),  # relative 4e-8
    ("0.3333333 x", "0.33333334 x", True),  # absolute 4e-8
    ("1100000000 7", "1000000000 7", False),  # relative 0.1
    ("0.33 x", "0.34 x", False),
    ("1000000000 y", "1000000000 x", False),  # words compare exactly
    ("1000000000", "1000000000 0", False),  # token count
])
def test_float_tolerance_is_relative_at_large_magnitudes(pool, printed, expected, passes):
    task = _stdio([{"input": "", "output": expected + "\n"}], compare="tokens", float_tol=1e-6)
    ((score, d),) = verify_batch([task], [f"print({printed!r})"], executor=pool)
    assert score == (1.0 if passes else 0.0), d
