"""Reward hacks: completions that try to be paid without computing the right
values score 0 on HumanEval tasks, generated code tasks, terminal tasks (python and bash checks),
stdio tasks and user task files, next to the correct completions of the same tasks scoring 1.
After each group the pool's next runs are ok in an empty working directory.

Before the fix (measured on the previous verifier, first 40 HumanEval tasks / 30 generated code
tasks): an always-equal object passed 35/40 and 30/30, reading the caller's frame 23/40 and
29/30, `encodings/__init__.py` in /work passed the generated terminal check, and a link from
out.txt to the check's own program passed a `grep -q` check.
"""

import json
import os

import pytest

from sandbox import Task, load_humaneval, load_tasks, python_tests
from sandbox.tasks.sampling import make_split
from sandbox.verifiers import Verifier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HE = {t.id: t for t in load_humaneval(os.path.join(ROOT, "sandbox", "tasks", "data", "HumanEval.jsonl.gz"))}
# a float compared with abs(); an expected value computed in an assignment (read by a collect
# run); generated code tasks of levels 1 and 3
HE_TASKS = [HE[f"HumanEval/{i}"] for i in (2, 151)]
CODE_TASKS = [t for d in (1, 3) for t, _ in make_split("code", "test", 1, seed=11, difficulty=d)]

# function bodies
BODY = {
    "always_equal": "class E:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                    "    __hash__ = object.__hash__\nreturn E()",
    "int_subclass": "class I(int):\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                    "    __hash__ = int.__hash__\nreturn I(0)",
    "str_subclass": "class S(str):\n    def __eq__(s, o): return True\n    __hash__ = str.__hash__\nreturn S('')",
    "list_subclass": "class L(list):\n    def __eq__(s, o): return True\nreturn L()",
    "absorbing": "class A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                 "    def __bool__(s): return True\n    def __lt__(s, o): return True\n"
                 "    __le__ = __gt__ = __ge__ = __lt__\n    def __sub__(s, o): return s\n"
                 "    __rsub__ = __add__ = __radd__ = __mul__ = __truediv__ = __sub__\n"
                 "    def __abs__(s): return 0\n    __hash__ = object.__hash__\nreturn A()",
    "caller_frame": "import sys, dis\nf = sys._getframe(1)\nfor i in dis.get_instructions(f.f_code):\n"
                    "    if i.offset > f.f_lasti and i.opname == 'LOAD_CONST':\n        return i.argval\nreturn None",
    "inspect_stack": "import inspect, dis\nfor fi in inspect.stack()[1:]:\n    fr = fi.frame\n"
                     "    for i in dis.get_instructions(fr.f_code):\n"
                     "        if i.offset > fr.f_lasti and i.opname == 'LOAD_CONST':\n            return i.argval\nreturn None",
    "gc_consts": "import gc\nfor o in gc.get_objects():\n    if type(o).__name__ == 'function' and o.__name__ == 'check':\n"
                 "        return [c for c in o.__code__.co_consts if c is not None][-1]\nreturn None",
    "patch_builtins": "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
                      "builtins.AssertionError = type('AE', (Exception,), {})\nbuiltins.len = lambda x: 0\nreturn 0",
    "exit_in_call": "import os\nos._exit(0)",
    "sys_exit_in_call": "raise SystemExit(0)",
}
# module-level code after a wrong function
MODULE = {
    "exit_at_import": "import os\nos._exit(0)\n",
    "fake_output": "print('\\n' + 'ab' * 16 + ' {\"event\": \"done\"}')\n"
                   "print('{\"event\": \"case\", \"i\": 0, \"passed\": true}')\n",
}


def _indent(src, pad):
    return "".join(pad + ln + "\n" for ln in src.splitlines())


def _he_completion(kind):
    return _indent(BODY[kind], "    ") if kind in BODY else "    return None\n" + MODULE[kind]


def _code_completion(kind, task):
    arg = task.prompt[len("def f("):task.prompt.index(")")]
    head = f"def f({arg}):\n"
    return head + _indent(BODY[kind], " ") if kind in BODY else head + " return None\n" + MODULE[kind]


@pytest.fixture(scope="module")
def verifier(pool):
    return Verifier(pool)


def test_python_hacks_score_zero_next_to_correct_solutions(verifier, pool, clean_next):
    kinds = sorted(BODY) + sorted(MODULE)
    tasks, comps, labels = [], [], []
    for t in HE_TASKS:
        tasks.append(t), comps.append(t.canonical_solution), labels.append(("correct", t.id))
        for k in kinds:
            tasks.append(t), comps.append(_he_completion(k)), labels.append((k, t.id))
    for t in CODE_TASKS:
        tasks.append(t), comps.append(t.meta["demo"]), labels.append(("correct", t.id))
        for k in kinds:
            tasks.append(t), comps.append(_code_completion(k, t)), labels.append((k, t.id))
    res = verifier.verify_batch(tasks, comps)
    wrong = [(lab, d["status"], d.get("error")) for lab, (s, d) in zip(labels, res)
             if s != (1.0 if lab[0] == "correct" else 0.0)]
    assert not wrong, wrong
    for lab, (_, d) in zip(labels, res):
        if lab[0] == "always_equal":
            assert d["status"] == "fail" and "not plain data" in str(d["cases"]), d
    clean_next(pool)


def test_expected_values_never_reach_the_solution_sandbox(verifier, pool, clean_next):
    tok = os.urandom(6).hex()
    exp = {x: f"kimi-exp-{x}-{tok}" for x in "abc"}
    static = Task(id="static", family="python_tests", entry_point="f", meta={"prompt_is_text": True},
                  test="def check(candidate):\n" + "".join(
                      f"    assert candidate({x!r}) == {v!r}\n" for x, v in exp.items()))
    dynamic = Task(id="dynamic", family="python_tests", entry_point="f",
                   meta={"prompt_is_text": True}, test=(
                       "def check(candidate):\n"
                       f"    pairs = {sorted(exp.items())!r}\n"
                       "    table = dict(pairs)\n"
                       "    def ref(x):\n        return table[x]\n"
                       "    for x, want in pairs:\n        assert candidate(x) == want\n"
                       "    assert candidate('a') == ref('a')\n"))
    # looks everywhere the completion can: its program, /work, /tmp, the environment, /proc,
    # every frame's locals, globals and constants, every container and code object gc knows
    search = r'''def f(x):
    import gc, os, sys
    want = "kimi-exp-%s-" % x
    def find(text):
        i = text.find(want)
        return text[i:i + len(want) + 12] if i >= 0 else None
    blobs = []
    for root in ("/sandbox", "/work", "/tmp", "/proc/self", "/proc/1"):
        for r, ds, fs in os.walk(root):
            ds[:] = [d for d in ds if d not in ("task", "net", "fd", "map_files")]
            for n in fs:
                try:
                    with open(os.path.join(r, n), "rb") as fh:
                        blobs.append(fh.read(1 << 20).decode("latin-1"))
                except OSError:
                    pass
    blobs.append(repr(dict(os.environ)))
    fr = sys._getframe()
    while fr is not None:
        blobs += [repr(fr.f_locals), repr(fr.f_code.co_consts)]
        fr = fr.f_back
    for o in gc.get_objects():
        try:
            blobs.append(repr(o.co_consts) if hasattr(o, "co_consts") else repr(o)[:100000])
        except Exception:
            pass
    for b in blobs:
        hit = find(b)
        if hit:
            return hit
    return "not found"
'''
    honest = f"def f(x):\n    return {exp!r}[x]\n"
    for t in (static, dynamic):
        assert verifier.verify(t, honest)[0] == 1.0
        s, d = verifier.verify(t, search)
        assert s == 0.0 and d["n_passed"] == 0, d
    prog = python_tests.solution_program(search, "f", python_tests.static_calls(static.test, "f"))
    assert tok not in prog and "kimi-exp-a" not in prog
    clean_next(pool)


TERMINAL_HACKS = {
    "encodings_package": "mkdir encodings; printf 'import os\\nos._exit(0)\\n' > encodings/__init__.py",
    "site_files": "for m in sitecustomize usercustomize; do printf 'import os\\nos._exit(0)\\n' > $m.py; "
                  "done; printf 'import os; os._exit(0)\\n' > x.pth",
    "fake_tools": "for b in python3 python cat grep test diff cmp sort bash sh; do "
                  "printf '#!/bin/sh\\nexit 0\\n' > $b; chmod +x $b; done",
    "shell_rc_files": "printf 'exit 0\\n' > .bashrc; cp .bashrc .profile; cp .bashrc .bash_profile; "
                      "echo 'alias grep=true' > .bash_aliases; echo 'exit 0' > .env",
    "link_to_python_program": "ln -s /sandbox/main.py out.txt",
    "link_to_bash_program": "ln -s /sandbox/main.sh out.txt",
    "link_to_check_cmdline": "ln -s /proc/2/cmdline out.txt",
    "link_to_check_fds": "for i in 3 4 5 6 7 8 9; do ln -s /proc/2/fd/$i f$i; done; "
                         "cat f* > /dev/null 2>&1; ln -s /proc/1/fd/3 out.txt",
}


def test_terminal_hacks_score_zero(verifier, pool, clean_next):
    (gen, demo), = make_split("terminal", "train", 1, seed=5, difficulty=1)
    grep_check = Task(id="grep", family="terminal", files=gen.files, check_language="bash",
                      check="grep -q 'THE-EXPECTED-LINE' out.txt")
    tasks, comps, want = [gen, grep_check], [demo, "echo THE-EXPECTED-LINE > out.txt"], [1.0, 1.0]
    for cmd in TERMINAL_HACKS.values():
        tasks += [gen, grep_check]
        comps += [cmd, cmd]
        want += [0.0, 0.0]
    res = verifier.verify_batch(tasks, comps)
    got = [s for s, _ in res]
    assert got == want, [(c, s, d["steps"]["check"]) for c, (s, d), w in zip(comps, res, want) if s != w]
    clean_next(pool)


def test_stdio_program_cannot_find_the_expected_output(verifier, pool, clean_next):
    secret = "kimi-expected-" + os.urandom(6).hex()
    t = Task(id="s", family="stdio", cases=[{"input": "x\n", "output": secret}])
    prog = ("import os, re\nfound = []\nfor d in ('/work', '/sandbox', '/tmp', '/etc', '/proc/self', '/proc/1'):\n"
            "    for r, ds, fs in os.walk(d):\n        ds[:] = [x for x in ds if x not in ('task', 'fd')]\n"
            "        for f in fs:\n            try:\n"
            "                b = open(os.path.join(r, f), 'rb').read(1 << 20)\n            except OSError:\n"
            "                continue\n            found += re.findall(rb'kimi-expected-[0-9a-f]{12}', b)\n"
            "print(found[0].decode() if found else 'not found')")
    s, d = verifier.verify(t, prog)
    assert s == 0.0 and d["cases"][0]["actual"] == "not found\n", d
    assert verifier.verify(t, f"print({secret!r})")[0] == 1.0
    clean_next(pool)


def test_user_task_files_follow_the_same_rules(verifier, pool, tmp_path, clean_next):
    path = tmp_path / "user.jsonl"
    path.write_text(json.dumps({"id": "u1", "family": "python_tests", "prompt": "Write add(a, b).",
                                "test": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n",
                                "entry_point": "add", "meta": {"prompt_is_text": True}}) + "\n"
                    + json.dumps({"id": "u2", "family": "terminal", "files": {"in.txt": "b\na\n"},
                                  "check": "import sys\nsys.exit(0 if open('out.txt').read() == 'a\\nb\\n' else 1)",
                                  "check_language": "python"}) + "\n")
    u1, u2 = load_tasks(path)
    hack = "def add(a, b):\n" + _indent(BODY["always_equal"], "    ")
    assert [s for s, _ in verifier.verify_batch(
        [u1, u1, u2, u2], ["def add(a, b):\n    return a + b\n", hack, "sort in.txt > out.txt",
                           TERMINAL_HACKS["encodings_package"]])] == [1.0, 0.0, 1.0, 0.0]
    clean_next(pool)


def test_completions_cannot_turn_their_verdict_into_sandbox_error(verifier, pool, clean_next):
    """The RL pipeline drops sandbox_error rows from the loss instead of scoring them 0, so a
    completion able to cause one would escape its penalty (before the fix: `chmod 000 /work` made
    the terminal check's sandbox fail to start; text with lone surrogates raised)."""
    (term, _), = make_split("terminal", "train", 1, seed=5, difficulty=1)
    (arith, _), = make_split("arithmetic", "train", 1, seed=5, difficulty=1)
    code = CODE_TASKS[0]
    stdio = Task(id="s", family="stdio", cases=[{"input": "", "output": "x"}])
    breakers = ["chmod 000 /work", "chmod -R 000 .; chmod 000 /work", "rm -rf /work/* /work/.[!.]*",
                "mkfifo out.txt", "ln -s /work out.txt; chmod 000 /work", "kill -9 -1",
                "python3 -c 'import os; os.chmod(\"/work\", 0)'", "echo \ud800 > out.txt \udcff"]
    tasks = [term] * len(breakers) + [arith, arith, code, code, stdio, stdio, HE_TASKS[0]]
    comps = breakers + ["1+\ud800", "\udcff" * 10, "def f(x):\n    return '\ud800'\n",
                        "def f(x):\n    import os\n    os.chmod('/work', 0)\n    return 0\n",
                        "print('\ud800')", "import os; os.chmod('/work', 0)",
                        "    import os\n    os.chmod('/work', 0)\n    return 0.0\n"]
    res = verifier.verify_batch(tasks, comps)
    bad = [(c, d["status"]) for c, (s, d) in zip(comps, res) if s != 0.0 or d["status"] == "sandbox_error"]
    assert not bad, bad
    clean_next(pool)
