"""Verifiers: score a model completion for a task, in [0, 1], with details.

    from sandbox.verifiers import verify, verify_batch, Verifier
    score, details = verify(task, completion)                  # default pool + math workers
    scored = verify_batch(tasks, completions, executor=pool)   # all runs submitted at once

Scoring methods: this module is the one list of them (each is a `_start_<name>` function, an
optional field check, and one `register_scoring` line; a task names its method in `Task.family`,
fields in sandbox/tasks/schema.py; `check_task` refuses an unknown method or missing fields):

  python_tests  HumanEval/MBPP unit tests. The solution is prompt + completion (or the whole
                prompt, then the completion's code when that defines the entry point itself:
                build_solution; which fenced block is the code: extract_code). It runs in one sandbox
                on the arguments the test will call it with (no test code, no expected value
                there); its results cross as plain data (sandbox/plaindata.py) to a fresh,
                isolated sandbox where the ORIGINAL test runs against a replay of them, each
                top-level statement of `check` (or of the test file) that contains an assert being
                one case. See sandbox/python_tests.py for the protocol and why an always-equal
                object, patched builtins, frame/gc inspection, early exit or fake output earn 0.
  stdio         one sandbox run per case with the case's input on stdin; stdout is compared with
                the expected output after `normalize_output` (see its docstring for the rule).
  math          math-verify equivalence of the completion's final answer and the gold answer,
                in isolated worker processes with a timeout (sandbox.mathverify).
  terminal      a sandbox sequence over one working directory: [setup], the model's commands
                (bash), then the check script in a fresh sandbox started with `isolated=True`
                (python -I -S -B or bash --norc --noprofile, PATH=/usr/bin:/bin, HOME=/tmp,
                program text on no path), so nothing the commands wrote into /work reaches the
                interpreter, its search path or its environment; check exit code 0 = solved.
                Expected outputs belong in the check, never in `files` (which the model sees).
  answer_check  the raw completion is data: written to answer.txt next to `files`, judged by the
                task's `check` script in one isolated sandbox (exit 0 = solved).

details always has: family, score, status ("pass", "fail", or the sandbox status that prevented a
verdict such as "timeout"/"sandbox_error"), cases (list of per-case dicts with passed and
time_s where applicable) and wall_s (sum of sandbox run times). The executor can be a local
SandboxPool or a remote client (sandbox.client.SandboxClient); anything with `submit(code, **kw)`
and `submit_sequence(steps)` returning futures works.

Reused verdicts (`Verifier(reuse=N)`; RL and evaluation set N from `sandbox.reuse_verdicts`): a
completion identical to one already submitted for the same task (every field of the task and the
completion's exact text) gets that submission's score and a copy of its details with "reused": True
and wall_s 0.0, without a sandbox run, when that verdict was reached: status "pass" or "fail" with
no run of it stopped by a timeout, the memory limit or a sandbox error (`reusable`). Otherwise (a
timeout under load, a crashed worker) the copy is scored by its own runs, and its result is kept in
the first's place. Every scoring method here is a function of the task and the text, so the score
is the one a run would give: sampled groups repeat completions often (the demo's test samples: 1000
code completions of the RL checkpoint held 240 distinct texts). A program whose verdict is random
(it reads the clock or a random source) gets its first run's verdict for every copy, the same in
expectation. The last N (task, text) pairs used are kept; 0 turns it off.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from . import python_tests
from .backend import Executor
from .pyparse import parse as parse_python
from .result import ExecutionResult
from .tasks.schema import Task, TaskFormatError

# --------------------------------------------------------------------------------------------
# helpers

_FENCE_OPEN = re.compile(r"[ \t]*(`{3,}|~{3,})[ \t]*(.*?)[ \t]*\Z")
_PY_TAG = re.compile(r"(py|python|ipython)[0-9.]*\Z")
_SH_TAGS = {"bash", "sh", "shell", "console", "zsh", "ksh", "dash", "shell-session",
            "shellsession", "shellscript", "terminal"}


def fence_tag(info: str) -> str:
    """The language of a fence's info string: "python", "bash", "" (none) or the first word
    lowercased. `python3`, `py3`, `Py`, `{.python}`, `python title="x"` are all "python"."""
    word = re.split(r"[\s,{}]+", info.strip().lower().lstrip("{.").strip())[0] if info.strip() else ""
    word = word.lstrip(".")
    if _PY_TAG.match(word):
        return "python"
    if word in _SH_TAGS:
        return "bash"
    return word


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of every fenced block, in order (fence rules: extract_code)."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE_OPEN.match(lines[i].rstrip("\r"))
        if m is None or (m.group(1)[0] == "`" and "`" in m.group(2)):
            i += 1
            continue
        fence, body, j = m.group(1), [], i + 1
        indent = len(lines[i]) - len(lines[i].lstrip(" "))
        while j < len(lines):
            closing = lines[j].strip()
            if closing and set(closing) == {fence[0]} and len(closing) >= len(fence):
                break
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
            j += 1
        blocks.append((fence_tag(m.group(2)), "\n".join(body) + ("\n" if j < len(lines) else "")))
        i = j + 1
    return blocks


def defines(code: str, name: str) -> bool:
    """True if `code` defines `name` at top level (`def name(` or `async def name(`)."""
    return bool(name) and re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(",
                                    code, re.M) is not None


def extract_code(completion: str, language: str = "python", entry_point: str = "") -> str:
    """The code a completion gives, the way a careful grader reads it.

    Fences: a line that starts (after any indentation) with three or more backticks or tildes
    opens a block (its indentation is removed from the block's lines, as Markdown does); its
    info string's first word is the tag (fence_tag: `py`, `python3`, `py3`,
    `{.python}` are python; `sh`, `shell`, `console`, `zsh` are bash); the block ends at a line
    holding only the same character, at least as many times, or at the end of the text (an
    unterminated block runs to the end). Text outside blocks is never code when there is a block.

    Which block: the blocks tagged with `language` are the candidates; if none is, the untagged
    ones are (a block tagged with another language or `text`/`output` never is, unless below).
      python with an entry point: the last candidate that defines it at top level; else the last
        block of any tag that defines it; else the first candidate (a fenced function body);
      python without one (stdio programs): the last candidate (a trailing output or usage block
        is usually untagged or tagged otherwise; the final program wins over drafts);
      bash: every bash-tagged block, joined in order (steps given in several blocks); without
        one, the first untagged block (later ones are usually output).
    No candidate: the first block whatever its tag. No fence at all: the whole completion."""
    blocks = fenced_blocks(completion)
    if not blocks:
        return completion
    want = "python" if language == "python" else "bash"
    cands = [b for t, b in blocks if t == want] or [b for t, b in blocks if t == ""]
    if language == "python" and entry_point:
        hits = [b for b in cands if defines(b, entry_point)] or \
            [b for _, b in blocks if defines(b, entry_point)]
        if hits:
            return hits[-1]
        return cands[0] if cands else blocks[0][1]
    if not cands:
        return blocks[0][1]
    if language == "python":
        return cands[-1]
    tagged = [b for t, b in blocks if t == want]
    return "\n".join(tagged) if tagged else cands[0]


def normalize_output(text: str, compare: str = "lines") -> list[str]:
    """The normalisation applied to both the expected and the actual output of stdio tasks.

    "lines" (default): CRLF and CR become LF; trailing whitespace is removed from every line;
        trailing empty lines are dropped. Leading whitespace, inner spaces and empty lines between
        non-empty lines are significant. So "1 2 \\n3\\n\\n" == "1 2\\n3" but "1  2" != "1 2".
    "tokens": the output is split on any whitespace (lines and spaces are interchangeable).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if compare == "tokens":
        return text.split()
    lines = [ln.rstrip() for ln in text.split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _tokens_equal(a: list[str], b: list[str], tol: float | None) -> bool:
    """Token-wise equality; with `tol`, numeric tokens within an absolute or relative tolerance.
    A non-finite value (inf, -inf, nan, or a literal that overflows to inf such as 1e999) matches
    only an infinity of the same sign (inf == Infinity); NaN only its own text."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if tol is None:
            return False
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not (math.isfinite(fx) and math.isfinite(fy)):
            if math.isinf(fx) and fx == fy:
                continue
            return False
        d = abs(fx - fy)
        if not (d <= tol or d <= tol * max(abs(fx), abs(fy))):
            return False
    return True


def outputs_match(actual: str, expected: str, compare: str = "lines",
                  float_tol: float | None = None) -> bool:
    a, e = normalize_output(actual, compare), normalize_output(expected, compare)
    if compare == "tokens":
        return _tokens_equal(a, e, float_tol)
    return a == e


def _valid_text(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _short(s: str, n: int = 300) -> str:
    return s if len(s) <= n else s[:n] + f"... [{len(s) - n} more chars]"


class Pending:
    """A verification in flight: `result()` blocks until its sandbox runs are done. Built from a
    function computing (score, details) or from a Future of it."""

    def __init__(self, finish: Callable[[], tuple[float, dict]] | Future) -> None:
        self._finish = finish.result if isinstance(finish, Future) else finish
        self._value: tuple[float, dict] | None = None
        self._lock = threading.Lock()  # a kept verdict may be awaited from several threads

    def result(self) -> tuple[float, dict]:
        with self._lock:
            if self._value is None:
                self._value = self._finish()
                self._finish = None  # its runs' outputs can go (a kept verdict holds only this)
            return self._value


def _done(score: float, details: dict) -> Pending:
    p = Pending(lambda: (score, details))
    return p


# --------------------------------------------------------------------------------------------
# the registry of scoring methods


@dataclasses.dataclass(frozen=True)
class ScoringMethod:
    """start(task, completion, verifier) -> Pending submits the method's sandbox runs through
    `verifier.executor` (or `verifier.math`); check(task) raises TaskFormatError when the task
    lacks a field the method needs (None: the method has no required fields)."""
    start: Callable[[Task, str, Verifier], Pending]
    check: Callable[[Task], None] | None = None


_METHODS: dict[str, ScoringMethod] = {}


def register_scoring(name: str, start: Callable[[Task, str, Verifier], Pending],
                     check: Callable[[Task], None] | None = None) -> None:
    """Adds (or replaces) the scoring method `name` (see ScoringMethod)."""
    _METHODS[name] = ScoringMethod(start, check)


def scoring_methods() -> list[str]:
    """The registered scoring methods, sorted."""
    return sorted(_METHODS)


def check_task(task: Task) -> None:
    """Raises TaskFormatError when `task.family` is not a registered scoring method or the task
    lacks a field its method needs; the message says which."""
    method = _METHODS.get(task.family)
    if method is None:
        raise TaskFormatError(f"task {task.id}: unknown family {task.family!r} (known scoring "
                              f"methods: {scoring_methods()})")
    if method.check is not None:
        method.check(task)


# --------------------------------------------------------------------------------------------
# python unit tests

def build_solution(task: Task, completion: str) -> str:
    """The program a python_tests completion stands for: the code extract_code picks (the block
    that defines the entry point, see its rules) after the whole prompt when the prompt is code
    (its helpers, imports and constants stay; the prompt's own stub of the entry point is
    redefined by the completion's), or the prompt followed by the completion's body: the text
    before the first fence when the prompt continued by it parses (a body closed by a stray
    fence, prose or an example after it), else the block extract_code picks. A prompt that is
    prose (`meta.prompt_is_text`, or not parseable) is left out."""
    code = extract_code(completion, "python", task.entry_point)
    if not python_tests.prompt_is_code(task):
        return code
    if defines(code, task.entry_point):
        return task.prompt.rstrip("\n") + "\n\n\n" + code
    head = _before_first_fence(completion)
    if head.strip() and _parses(task.prompt + head):
        # the prompt continued, then a stray closing fence (and prose or an example after it)
        return task.prompt + head
    return task.prompt + code


def _before_first_fence(text: str) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if _FENCE_OPEN.match(line.rstrip("\r")):
            return "\n".join(lines[:i]) + "\n"
    return ""


def _parses(src: str) -> bool:
    try:
        parse_python(src)
        return True
    except (SyntaxError, ValueError):
        return False


def _start_python_tests(task: Task, completion: str, ctx: Verifier) -> Pending:
    """See sandbox/python_tests.py: the solution runs in one sandbox on the test's arguments only,
    the original test judges the returned plain data in another."""
    return Pending(python_tests.start(task, build_solution(task, completion), ctx.executor))


def _check_python_tests(task: Task) -> None:
    if not task.test:
        raise TaskFormatError(f"task {task.id}: python_tests needs 'test'")
    if "def check" in task.test and not task.entry_point:
        raise TaskFormatError(f"task {task.id}: python_tests with check() needs 'entry_point'")


register_scoring("python_tests", _start_python_tests, _check_python_tests)


# --------------------------------------------------------------------------------------------
# stdin / stdout


def _start_stdio(task: Task, completion: str, ctx: Verifier) -> Pending:
    code = extract_code(completion, task.language)
    futs = [ctx.executor.submit(code, language=task.language, stdin=c["input"],
                                timeout_s=task.timeout_s, memory_mb=task.memory_mb)
            for c in task.cases]

    def finish():
        cases, wall = [], 0.0
        statuses = []
        for c, f in zip(task.cases, futs):
            r: ExecutionResult = f.result()
            wall += r.wall_s
            ok = r.status == "ok" and outputs_match(r.stdout, c["output"], task.compare, task.float_tol)
            d = {"passed": ok, "status": r.status, "time_s": round(r.wall_s, 4)}
            if not ok:
                d["expected"] = _short(c["output"])
                d["actual"] = _short(r.stdout)
                if r.stderr:
                    d["stderr"] = _short(r.stderr)
            cases.append(d)
            statuses.append(r.status)
        passed = sum(c["passed"] for c in cases)
        n = len(cases)
        score = passed / n if task.scoring == "fraction" else float(passed == n)
        if passed == n:
            status = "pass"
        else:
            bad = [s for s in statuses if s not in ("ok", "error")]
            status = bad[0] if bad and len(set(bad)) == 1 and len(bad) == n - passed else "fail"
        return score, {"family": "stdio", "score": score, "status": status, "cases": cases,
                       "n_cases": n, "n_passed": passed, "wall_s": wall}

    return Pending(finish)


def _check_stdio(task: Task) -> None:
    if not task.cases or not all(isinstance(c, dict) and "input" in c and "output" in c
                                 for c in task.cases):
        raise TaskFormatError(f"task {task.id}: stdio needs cases [{{input, output}}, ...]")
    if task.compare not in ("lines", "tokens"):
        raise TaskFormatError(f"task {task.id}: compare must be 'lines' or 'tokens'")
    if task.language not in ("python", "bash"):
        raise TaskFormatError(f"task {task.id}: language must be python or bash")


register_scoring("stdio", _start_stdio, _check_stdio)


# --------------------------------------------------------------------------------------------
# math


def _start_math(task: Task, completion: str, ctx: Verifier) -> Pending:
    fut = ctx.math.submit(completion, task.answer, timeout_s=min(task.timeout_s, 30.0))

    def finish():
        ok, d = fut.result()
        score = 1.0 if ok else 0.0
        status = "pass" if ok else ("fail" if d.get("status") in ("ok", "no_answer") else d.get("status"))
        details = {"family": "math", "score": score, "status": status,
                   "cases": [{"passed": ok, "time_s": d.get("time_s")}], "answer": task.answer,
                   "parsed_pred": d.get("pred"), "parsed_gold": d.get("gold"), "wall_s": d.get("time_s", 0.0)}
        if d.get("error"):
            details["error"] = d["error"]
        return score, details

    return Pending(finish)


def _check_math(task: Task) -> None:
    if not str(task.answer).strip():
        raise TaskFormatError(f"task {task.id}: math needs 'answer'")


register_scoring("math", _start_math, _check_math)


# --------------------------------------------------------------------------------------------
# terminal


def _start_terminal(task: Task, completion: str, ctx: Verifier) -> Pending:
    commands = extract_code(completion, "bash")
    steps = []
    if task.setup:
        steps.append({"code": task.setup, "language": "bash", "files": task.files,
                      "timeout_s": task.timeout_s, "memory_mb": task.memory_mb})
    steps.append({"code": commands, "language": "bash",
                  "files": {} if task.setup else task.files,
                  "timeout_s": task.timeout_s, "memory_mb": task.memory_mb})
    steps.append({"code": task.check, "language": task.check_language, "isolated": True,
                  "timeout_s": task.timeout_s, "memory_mb": task.memory_mb})
    fut = ctx.executor.submit_sequence(steps)

    def finish():
        results: list[ExecutionResult] = fut.result()
        names = (["setup"] if task.setup else []) + ["commands", "check"]
        step_d = {n: {"status": r.status, "exit_code": r.exit_code, "time_s": round(r.wall_s, 4),
                      "stdout": _short(r.stdout), "stderr": _short(r.stderr)}
                  for n, r in zip(names, results)}
        setup_ok = not task.setup or results[0].status == "ok"
        check = results[-1]
        ok = setup_ok and check.status == "ok"
        score = 1.0 if ok else 0.0
        if ok:
            status = "pass"
        elif not setup_ok:
            status = "sandbox_error" if results[0].status == "sandbox_error" else "setup_failed"
        elif check.status in ("ok", "error"):
            status = "fail"
        else:
            status = check.status
        return score, {"family": "terminal", "score": score, "status": status,
                       "cases": [{"passed": ok, "time_s": round(check.wall_s, 4)}], "steps": step_d,
                       "wall_s": sum(r.wall_s for r in results)}

    return Pending(finish)


def _check_terminal(task: Task) -> None:
    if not task.check:
        raise TaskFormatError(f"task {task.id}: terminal needs 'check'")
    if task.check_language not in ("bash", "python"):
        raise TaskFormatError(f"task {task.id}: check_language must be bash or python")


register_scoring("terminal", _start_terminal, _check_terminal)


# --------------------------------------------------------------------------------------------
# entry points

_STOPPED = ("timeout", "memory", "sandbox_error")  # run statuses that leave no verdict to reuse


def reusable(details: dict) -> bool:
    """True when a scoring's details hold a verdict another submission of the same task and text
    may take (module docstring, "Reused verdicts"): status pass or fail, and no run of it was
    stopped by a timeout, the memory limit or a sandbox error (python_tests' solution and check
    runs, stdio's cases, terminal's steps)."""
    runs = [details.get("sandbox_status"), details.get("check_status")]
    runs += [c.get("status") for c in details.get("cases") or () if isinstance(c, dict)]
    runs += [s.get("status") for s in (details.get("steps") or {}).values() if isinstance(s, dict)]
    return details.get("status") in ("pass", "fail") and not any(r in _STOPPED for r in runs)


def task_digest(task: Task) -> str:
    """sha256 over every field of the task (its meta too: e.g. prompt_is_text changes the
    program), the key under which its verdicts are reused."""
    blob = json.dumps(task.to_dict(), sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()


class Verifier:
    """Scores completions through an executor (local pool or remote client) and math workers.

    reuse: keep the last `reuse` (task, completion) submissions and give an identical later one
    the earlier verdict without a sandbox run (module docstring, "Reused verdicts"); 0 (the
    default) runs every submission. `reused` counts the verdicts given that way."""

    def __init__(self, executor: Executor | None = None, math=None, reuse: int = 0) -> None:
        if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 0:
            raise ValueError(f"reuse must be an int >= 0 (submissions whose verdicts are kept; "
                             f"0 = score every submission), got {reuse!r}")
        self._executor = executor
        self._math = math
        self._reuse = reuse
        self._kept: collections.OrderedDict[tuple[str, str], Pending] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            from .pool import default_pool

            self._executor = default_pool()
        return self._executor

    @property
    def math(self):
        if self._math is None:
            from .mathverify import default_math_verifier

            self._math = default_math_verifier()
        return self._math

    def submit(self, task: Task | dict, completion: str) -> Pending:
        """Starts scoring `completion` (a str; text that is not valid UTF-8, such as lone
        surrogates, is replaced by U+FFFD first, so a completion can never make its own
        verification raise: only a bad task (TaskFormatError, from check_task) or a broken
        executor does)."""
        if isinstance(task, dict):
            task = Task.from_dict(task)
        check_task(task)
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        completion = _valid_text(completion)
        if not self._reuse:
            return self._start(task, completion)
        key = (task_digest(task), completion)
        with self._lock:
            first = self._kept.get(key)
            if first is not None:
                self._kept.move_to_end(key)
        if first is None:
            pending = self._start(task, completion)
            with self._lock:
                self._kept.setdefault(key, pending)
                while len(self._kept) > self._reuse:
                    self._kept.popitem(last=False)
            return pending

        def finish():
            try:
                score, details = first.result()
            except Exception:  # noqa: BLE001 - the first's own result() still raises it
                details = None
            if details is None or not reusable(details):
                # no verdict to share: this copy is scored on its own and kept in its place
                own = self._start(task, completion)
                with self._lock:
                    if self._kept.get(key) is first:
                        self._kept[key] = own
                return own.result()
            with self._lock:
                self.reused += 1
            return score, {**copy.deepcopy(details), "reused": True, "wall_s": 0.0}

        return Pending(finish)

    def _start(self, task: Task, completion: str) -> Pending:
        try:
            return _METHODS[task.family].start(task, completion, self)
        except Exception as e:  # noqa: BLE001 - surfaced by result(), never a silent 0
            err = e

            def reraise():
                raise err

            return Pending(reraise)

    def verify(self, task: Task | dict, completion: str) -> tuple[float, dict]:
        return self.submit(task, completion).result()

    def verify_batch(self, tasks: Iterable[Task | dict], completions: Iterable[str]) -> list[tuple[float, dict]]:
        """All sandbox runs are submitted before any is awaited; results in input order."""
        pend = [self.submit(t, c) for t, c in zip(tasks, completions, strict=True)]
        return [p.result() for p in pend]


def verify(task: Task | dict, completion: str, executor: Executor | None = None,
           math=None) -> tuple[float, dict]:
    """Score in [0, 1] and details for one completion (see the module docstring)."""
    return Verifier(executor, math).verify(task, completion)


def verify_batch(tasks: Iterable[Task | dict], completions: Iterable[str],
                 executor: Executor | None = None, math=None) -> list[tuple[float, dict]]:
    return Verifier(executor, math).verify_batch(tasks, completions)


# --------------------------------------------------------------------------------------------
# answer_check: the completion is an answer (data, not code), judged by a task-provided script


def _start_answer_check(task: Task, completion: str, ctx: Verifier) -> Pending:
    """answer_check: the raw completion is written to `answer.txt` in the working directory next
    to the task's `files`, then `check` (`check_language`, python or bash) runs in one sandbox;
    exit 0 = solved. For answers that a script must inspect as text (e.g. a Countdown expression
    whose numbers and operators are checked before it is evaluated)."""
    if not task.check or task.check_language not in ("bash", "python"):
        return _done(0.0, {"family": "answer_check", "score": 0.0, "status": "invalid_task",
                           "cases": [], "wall_s": 0.0})
    fut = ctx.executor.submit(task.check, language=task.check_language, isolated=True,
                              files={**task.files, "answer.txt": completion},
                              timeout_s=task.timeout_s, memory_mb=task.memory_mb)

    def finish():
        r: ExecutionResult = fut.result()
        ok = r.status == "ok"
        status = "pass" if ok else ("fail" if r.status == "error" else r.status)
        score = 1.0 if ok else 0.0
        details = {"family": "answer_check", "score": score, "status": status,
                   "cases": [{"passed": ok, "time_s": round(r.wall_s, 4)}],
                   "exit_code": r.exit_code, "wall_s": r.wall_s}
        if not ok and (r.stdout or r.stderr):
            details["output"] = _short(r.stdout + r.stderr)
        return score, details

    return Pending(finish)


register_scoring("answer_check", _start_answer_check)
