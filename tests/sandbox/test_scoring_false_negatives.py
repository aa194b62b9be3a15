"""Correct answers in every form a careful grader accepts score 1, and the forms that only look
right score 0: non-finite tokens under a float tolerance, fenced answers (the block that defines
the entry point, the prompt's helpers kept, tags normalised, ~~~ fences, trailing usage and output
blocks), results that `==` accepts but that are not exact builtins (Counter, OrderedDict,
namedtuple, generators, deep nesting), tests that loop on results, solutions whose threads write
to stdout. Each class sits next to the look-alikes that must still score 0.

About 20 s on 2 busy cores (two-worker pool; the checker-side timeout test is 7 s of it)."""

import os

import pytest

from sandbox import Task, load_humaneval
from sandbox.verifiers import Verifier, build_solution, extract_code, fence_tag, outputs_match

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HE = {t.id: t for t in load_humaneval(os.path.join(ROOT, "sandbox", "tasks", "data", "HumanEval.jsonl.gz"))}


@pytest.fixture(scope="module")
def verifier(pool):
    return Verifier(pool)


def _task(test, entry="f", **kw):
    return Task(id="t", family="python_tests", test=test, entry_point=entry,
                meta={"prompt_is_text": True}, **kw)


# ---- stdio tokens: non-finite values -----------------------------------------------------------

def test_non_finite_tokens_match_only_themselves(verifier):
    tok = dict(compare="tokens", float_tol=1e-6)
    for bad in ("inf", "-inf", "Infinity", "1e999", "-1e999", "nan", "NaN"):
        assert not outputs_match(bad, "3.5", **tok), bad
        assert not outputs_match("3.5", bad, **tok), bad
    assert not outputs_match("-inf", "inf", **tok)
    assert not outputs_match("1e308", "inf", **tok)
    assert not outputs_match("nan", "inf", **tok)
    assert outputs_match("Infinity", "inf", **tok) and outputs_match("1e999", "inf", **tok)
    assert outputs_match("nan", "nan", **tok)  # the same text
    assert outputs_match("3.5000001 2", "3.5 2.0", **tok)
    assert not outputs_match("1.7e308", "-1.7e308", **tok)  # the difference overflows
    t = Task(id="avg", family="stdio", cases=[{"input": "1 2 4\n", "output": "2.333333\n"},
                                              {"input": "5\n", "output": "5.0\n"}],
             compare="tokens", float_tol=1e-5, timeout_s=5)
    good = "xs = list(map(float, input().split()))\nprint(sum(xs) / len(xs))"
    assert verifier.verify(t, good)[0] == 1.0
    for hack in ("print(float('inf'))", "print('1e999')", "print('-inf')", "print(float('nan'))"):
        s, d = verifier.verify(t, hack)
        assert s == 0.0 and d["n_passed"] == 0, (hack, d)


# ---- fences --------------------------------------------------------------------------------------

def test_fence_rules():
    assert fence_tag("py3") == fence_tag("Python3") == fence_tag("{.python}") == "python"
    assert fence_tag('python title="a.py"') == fence_tag("py") == "python"
    assert fence_tag("sh") == fence_tag("console") == fence_tag("shell") == "bash"
    assert fence_tag("") == "" and fence_tag("output") == "output" and fence_tag("pyramid") == "pyramid"
    fn = "def f(x):\n    return x + 1\n"
    # the block that defines the entry point, whatever follows it
    assert extract_code(f"```py3\n{fn}```\nThis prose is not code.", "python", "f") == fn
    assert extract_code(f"~~~python\n{fn}~~~\n```python\nprint(f(2))\n```\n```\n3\n```",
                        "python", "f") == fn
    assert extract_code(f"```\n{fn}```\nOutput:\n```output\n3\n```", "python", "f") == fn
    assert extract_code(f"  ```python\n  {fn.replace(chr(10) + '    ', chr(10) + '      ')}  ```",
                        "python", "f") == fn  # an indented fence's indentation is removed
    assert extract_code(f"```python\r\n{fn}```\r\n", "python", "f") == fn
    assert extract_code(f"````python\n{fn}```\n````", "python", "f") == fn + "```\n"  # longer fence
    assert extract_code(f"Draft:\n```python\ndef f(x):\n    return 0\n```\nFixed:\n```python\n{fn}```",
                        "python", "f") == fn  # the last definition
    assert extract_code(f"```text\n{fn}```", "python", "f") == fn  # mislabelled, but it is the code
    assert extract_code("```python\n    return x + 1\n```\n```python\nprint(f(1))\n```",
                        "python", "f") == "    return x + 1\n"  # a fenced body: the first block
    assert extract_code(f"```python\n{fn}", "python", "f") == fn  # unterminated: to the end
    # stdio programs: the last python block; an output block never
    assert extract_code("```python\nprint(1)\n```\n```\n1\n```") == "print(1)\n"
    assert extract_code("x\n```python\nprint(1)\n```\n```py\nprint(2)\n```") == "print(2)\n"
    # bash: every bash block in order; output blocks never
    assert extract_code("```bash\ncd d\n```\nthen\n```sh\nls\n```\n```\nfile\n```", "bash") == "cd d\n\nls\n"
    assert extract_code("```\nls\n```\n```\nfile\n```", "bash") == "ls\n"
    assert extract_code("```output\nls\n```", "bash") == "ls\n"
    assert extract_code("no fences") == "no fences"


# HumanEval tasks whose canonical solution calls a helper the prompt defines
HELPER_TASKS = ("HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/50")


def restated(task, tag="python", fence="```"):
    """The canonical solution restated as the whole entry-point function (signature and
    docstring from the prompt), fenced."""
    head = task.prompt[task.prompt.index(f"def {task.entry_point}("):]
    return f"Here is the function.\n{fence}{tag}\n{head}{task.canonical_solution}{fence}\n"


def test_fenced_restatements_keep_the_prompts_helpers(verifier):
    usage = "\nUsage:\n```python\nprint({e}([1, 2]))\n```\nOutput:\n```\n[1, 2]\n```\n"
    tasks, comps = [], []
    for tid in HELPER_TASKS:
        t = HE[tid]
        for c in (restated(t), restated(t) + usage.format(e=t.entry_point),
                  restated(t, "py3") + "Hope this helps: it runs in linear time.\n",
                  restated(t, "", "~~~")):
            tasks.append(t)
            comps.append(c)
    res = verifier.verify_batch(tasks, comps)
    bad = [(t.id, c[-120:], d) for t, c, (s, d) in zip(tasks, comps, res) if s != 1.0]
    assert not bad, bad
    # a body closed by a stray fence, prose after it: the body is the answer
    t = HE["HumanEval/50"]
    s, d = verifier.verify(t, t.canonical_solution + "```\nThis shifts every letter back by 5.\n")
    assert s == 1.0, d
    # the program keeps the prompt's helper and runs the completion's definition last
    sol = build_solution(HE["HumanEval/38"], restated(HE["HumanEval/38"]))
    assert sol.index("def encode_cyclic(") < sol.rindex("def decode_cyclic(") and sol.count("def decode_cyclic(") == 2
    # a wrong restatement is still wrong
    wrong = restated(HE["HumanEval/50"]).replace("- 5", "+ 5")
    assert wrong != restated(HE["HumanEval/50"]) and verifier.verify(HE["HumanEval/50"], wrong)[0] == 0.0


def test_output_blocks_do_not_replace_bash_and_stdio_answers(verifier):
    term = Task(id="sort", family="terminal", files={"data.txt": "pear\napple\nfig\n"},
                check='test "$(cat sorted.txt)" = "$(printf "apple\\nfig\\npear")"', timeout_s=10)
    ans = "```bash\nsort data.txt > sorted.txt\ncat sorted.txt\n```\nOutput:\n```\napple\nfig\npear\n```"
    assert verifier.verify(term, ans)[0] == 1.0
    assert verifier.verify(term, ans.replace("```bash", "```console"))[0] == 1.0
    stdio = Task(id="add", family="stdio", cases=[{"input": "1 2\n", "output": "3\n"}], timeout_s=5)
    prog = "```python\na, b = map(int, input().split())\nprint(a + b)\n```\nFor `1 2`:\n```\n3\n```\n"
    assert verifier.verify(stdio, prog)[0] == 1.0
    assert verifier.verify(stdio, "```python\nprint(4)\n```\n```\n3\n```")[0] == 0.0


# ---- results that == accepts ----------------------------------------------------------------------

CONVERT = [
    ("assert candidate('abca') == {'a': 2, 'b': 1, 'c': 1}",
     "import collections\ndef f(s):\n    return collections.Counter(s)\n"),
    ("assert candidate('abca') == __import__('collections').Counter('aabc')",
     "import collections\ndef f(s):\n    return collections.Counter(s)\n"),
    ("assert tuple(candidate(3)) == (0, 1, 4)", "def f(n):\n    return (i * i for i in range(n))\n"),
    ("assert sorted(candidate(3)) == [0, 1, 4]", "def f(n):\n    return map(lambda i: i * i, range(n))\n"),
    ("assert candidate(2) == (2, 3)", "import collections\nP = collections.namedtuple('P', 'x y')\n"
                                      "def f(n):\n    return P(n, n + 1)\n"),
    ("assert candidate(2) == (2, 3)", "from typing import NamedTuple\nclass P(NamedTuple):\n    x: int\n"
                                      "    y: int\n    def total(self):\n        return self.x + self.y\n"
                                      "def f(n):\n    return P(n, n + 1)\n"),
    ("assert candidate(2) == {'k': [2]}", "import collections\ndef f(n):\n"
                                          "    d = collections.defaultdict(list)\n    d['k'].append(n)\n    return d\n"),
    ("from collections import OrderedDict\n    assert candidate(2) == OrderedDict([('b', 2), ('a', 1)])",
     "from collections import OrderedDict\ndef f(n):\n    d = OrderedDict([('a', 1), ('b', n)])\n"
     "    d.move_to_end('a')\n    return d\n"),
    ("assert candidate(250) == candidate(250) and len(str(candidate(250))) == 502",
     "def f(n):\n    x = []\n    for _ in range(n):\n        x = [x]\n    return x\n"),
    ("assert list(candidate(3)) == [0, 1, 2] and candidate(3) == range(3)",
     "def f(n):\n    return range(n)\n"),
    ("assert candidate(10**20)[-1] == 10**20 - 1 and len(candidate(5)) == 5",
     "def f(n):\n    return range(n)\n"),
    ("assert list(candidate(3)) == [2, 1, 0] and candidate(3) == __import__('collections').deque([2, 1, 0])",
     "import collections\ndef f(n):\n    d = collections.deque(maxlen=n)\n"
     "    for i in range(n):\n        d.appendleft(i)\n    return d\n"),
    ("assert candidate({'b': 1, 'a': 2}) == {'a', 'b'}", "def f(d):\n    return d.keys()\n"),
    ("assert sorted(candidate({'b': 1, 'a': 2})) == [1, 2]", "def f(d):\n    return d.values()\n"),
    ("assert candidate({'b': [1]}) == {'b': [1]}.items()", "def f(d):\n    return d.items()\n"),
    ("assert list(candidate(3)) == [0, 1, 2]",
     "import collections\ndef f(n):\n    return iter(collections.deque(range(n)))\n"),
]
REFUSED = [  # (test, completion): look-alikes that must still score 0
    ("assert candidate('ab') == {'a': 1, 'b': 1}",
     "class D(dict):\n    def __eq__(s, o):\n        return True\n    __hash__ = None\n"
     "def f(s):\n    return D(x=0)\n"),
    ("assert candidate('ab') == {'a': 1, 'b': 1}",
     "import collections\nclass C(collections.Counter):\n    def __eq__(s, o):\n        return True\n"
     "def f(s):\n    return C(s)\n"),
    ("assert candidate(2) == (2, 3)",
     "import collections\nclass P(collections.namedtuple('P', 'x y')):\n    def __eq__(s, o):\n"
     "        return True\n    __hash__ = tuple.__hash__\ndef f(n):\n    return P(0, 0)\n"),
    ("assert candidate(3) == [0, 1, 4]", "def f(n):\n    return (i * i for i in range(n))\n"),
    ("from collections import OrderedDict\n    assert candidate(2) == OrderedDict([('b', 2), ('a', 1)])",
     "from collections import OrderedDict\ndef f(n):\n    return OrderedDict([('a', 1), ('b', n)])\n"),
    ("assert list(candidate(3)) == [0, 1, 2]", "def f(n):\n    while True:\n        yield 0\n"),
    # a range is not a list, a deque is not a list, a values view equals nothing but itself
    ("assert candidate(3) == [0, 1, 2]", "def f(n):\n    return range(n)\n"),
    ("assert candidate(3) == [0, 1, 2]",
     "import collections\ndef f(n):\n    return collections.deque(range(n))\n"),
    ("assert candidate({'a': 1}) == [1]", "def f(d):\n    return d.values()\n"),
    ("assert candidate(3) == range(3)", "def f(n):\n    return range(1, n)\n"),
]


def test_results_python_accepts_score_1_and_look_alikes_0(verifier):
    tasks = [_task(f"def check(candidate):\n    {test}\n", timeout_s=10) for test, _ in CONVERT + REFUSED]
    comps = [c for _, c in CONVERT + REFUSED]
    res = verifier.verify_batch(tasks, comps)
    got = [s for s, _ in res]
    want = [1.0] * len(CONVERT) + [0.0] * len(REFUSED)
    assert got == want, [(c, d) for c, (s, d), w in zip(comps, res, want) if s != w]


# ---- tests that loop on results; stdout shared with the solution's threads -----------------------

def test_a_test_that_loops_on_results_is_judged(verifier):
    """`while n != 1: n = candidate(n)`: the collect run's placeholder never ends the loop, so
    the case is cut after its share of the timeout and the chain is followed run by run."""
    t = _task("def check(candidate):\n    n, steps = 8, 0\n    while n != 1:\n        n = candidate(n)\n"
              "        steps += 1\n    assert steps == 3\n    assert candidate(3) == 10\n", timeout_s=4)
    s, d = verifier.verify(t, "def f(n):\n    return n // 2 if n % 2 == 0 else 3 * n + 1\n")
    assert s == 1.0 and d["status"] == "pass", d
    s, d = verifier.verify(t, "def f(n):\n    return n - 1 if n % 2 == 0 else 3 * n + 1\n")
    assert s == 0.0 and d["status"] == "fail", d


def test_a_checker_side_timeout_is_no_verdict_and_never_reused(pool):
    """A test that hangs by itself: no verdict on the completion (sandbox_error, which RL
    drops), and an identical completion is scored again. A test that runs long only because of
    the completion's value is that completion's failure (it cannot escape its 0 that way)."""
    v = Verifier(pool, reuse=8)
    hangs = _task("while True:\n    pass\nassert candidate(1) == 1\n", timeout_s=1)
    for _ in range(2):
        s, d = v.verify(hangs, "def f(x):\n    return x\n")
        assert s == 0.0 and d["status"] == "sandbox_error" and d["error_kind"] == "checker_stopped", d
        assert d["check_status"] == "timeout" and "reused" not in d and "probe" in d["runs"], d
    assert v.reused == 0
    loops = _task("def check(candidate):\n    for _ in range(candidate(1)):\n        pass\n"
                  "    assert candidate(2) == 4\n", timeout_s=1)
    assert v.verify(loops, "def f(x):\n    return x * x\n")[0] == 1.0
    for _ in range(2):
        s, d = v.verify(loops, "def f(x):\n    return 10 ** 15\n")
        assert s == 0.0 and d["status"] == "fail" and d["check_status"] == "timeout", d
        assert "reused" not in d and d["runs"][-1] == "probe", d
    assert v.reused == 0


def test_solution_threads_writing_to_stdout_cannot_break_records(verifier):
    """A record larger than a pipe's atomic write (4096 bytes) written while a thread of the
    solution floods stdout used to be split by the thread's output and lost."""
    t = _task("def check(candidate):\n" + "".join(
        f"    assert candidate({n}) == list(range({n}))\n" for n in (20000, 20001, 20002)), timeout_s=10)
    chatty = ("import os, threading\n"
              "def _spam():\n    for _ in range(48):\n        os.write(1, b'x' * 60000)\n"
              "threading.Thread(target=_spam, daemon=True).start()\n"
              "def f(n):\n    return list(range(n))\n")
    for _ in range(2):
        s, d = verifier.verify(t, chatty)
        assert s == 1.0, d
