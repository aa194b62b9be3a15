"""The python_tests family (HumanEval / MBPP unit tests), judged where the completion never ran.

Runs of one verification (each a fresh sandbox through the executor):

  solution  the solution (prompt + completion, see verifiers.build_solution) is executed and its
            entry point called on a list of argument tuples. It sees only those arguments: no
            test code and no expected value is in its program, files or environment. Each call's
            result comes back as plain data (sandbox/plaindata.py encode_result: exact builtin
            types, or an exact conversion of a namedtuple, Counter, OrderedDict, defaultdict or
            builtin iterator; no method of a returned object of any other type is called),
            tagged with a nonce the harness reads from a file and deletes before the solution
            runs.
  verdict   the task's ORIGINAL test runs in a fresh sandbox (isolated interpreter `python3 -I -S
            -B`, program not readable by path, empty working directory), after the prompt's own
            definitions when the test uses any (checker_prompt), with the entry point
            (`candidate`, or the function's own name for MBPP-style asserts) replaced by a
            replayer: arguments are encoded, looked up among the solution's recorded calls, and
            the recorded result is decoded into fresh builtin values (or the recorded builtin
            exception is raised). Every `==`, `abs`, `isinstance`, ... of the test therefore runs
            on builtin values in a process no completion code ever touched.
  collect   (only when the arguments cannot be read off the test statically) the test runs in a
            checker sandbox with asserts reduced to evaluating their expressions and every call
            answered by a placeholder, to list the arguments the verdict will ask for. Each
            top-level statement is cut after collect_case_s (a loop on placeholder results never
            ends by itself). Its result depends on the task only and is cached (COLLECT_CACHE).

Records travel as lines on stdout, each written by one write of at most 4000 bytes (a pipe
write under PIPE_BUF is atomic; larger records go in numbered parts joined by parse_events), so
whatever the solution prints meanwhile, from any thread, lands between records, never inside.

A run of the test itself stopped by a timeout, the memory limit, the output limit or a sandbox
error gives no verdict on the completion when the completion had no part in it: a collect run
(it never sees the completion), or a verdict whose probe, the same verdict run again without any
of the completion's results, is stopped too (the test hangs by itself). Then the status is
"sandbox_error" with error_kind "checker_stopped" (RL drops such samples; `reusable` refuses
them). A verdict stopped only with the completion's values (a wrong answer can make a test loop
long: `for _ in range(candidate(n))`) counts against the completion ("fail", never reused), so a
completion cannot turn its 0 into a dropped sample. A solution run
that did not end "ok" or "error" fails even when its records were all written (a run that timed
out after its last record is not a pass).

Arguments are read statically when every call of the entry point is a direct sub-expression of a
top-level assert of `check` (or of the test module, or of an assert's message) with constant
arguments (literals and arithmetic on them): all generated code tasks and 158 of the 164
HumanEval tasks. A verdict that meets a call it has no result for (arguments depending on
earlier results, control flow on results, in-place mutation changing later arguments) lists it,
and the solution runs again for the missing calls: at most MAX_SOLUTION_RUNS solution runs per
verification.

`random` is seeded (SEED) before the test runs in every checker whose prompt or test mentions
it, so tests that draw unseeded random inputs (HumanEval/53) ask for the same arguments in the
collect and verdict runs.

Why a completion cannot be paid without computing the right values: the verdict's comparisons run
in a process that executed only the task's prompt and test; the only thing that crosses from the
solution's sandbox is JSON text decoded strictly into builtin values, so an object with an
always-true `__eq__`, a str/int/list subclass, `__bool__` tricks or patched builtins do not exist
there; the expected values were never in the solution's sandbox, so frames, gc, the program file,
/work and the environment hold nothing to copy; exiting early or printing fake records only means
results are missing, and a missing result fails its case. Forging the records is possible (the
solution's process can print anything) but a forged record is just a claimed return value: it
passes only if it is the right value.

Not covered: a test that passes non-plain-data arguments (functions, user objects) to the entry
point, looks at the entry point other than by calling it (its name, signature, source), uses
names the solution defines other than the entry point (the prompt's own definitions are executed
in the checker), draws arguments from a source other than `random` (time, os entropy) or depends
on str hash order: such cases fail (a false negative, never a false pass).

Cost: two sandbox runs per verification (three when a collect run is needed and not cached);
the harnesses import nothing but os and time, so each run costs about what a plain run of the
solution does. HumanEval's 164 canonical solutions: 334 runs instead of 164, 1.6-1.9x the wall
time of the previous single-run harness (2 cores shared with other jobs, load 3 and 6, the two
harnesses alternated).
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import json
import math
import operator
import secrets
import threading
from concurrent.futures import Future
from typing import Any

from . import plaindata
from .plaindata import key_of
from .pyparse import parse as parse_python
from .result import ExecutionResult
from .tasks.schema import Task

SEED = 0
MAX_SOLUTION_RUNS = 3
SOLUTION_OUTPUT_LIMIT = 4 << 20  # what the host parses per solution run (json.loads)
CHECK_OUTPUT_LIMIT = 8 << 20
_HARNESS_VERSION = 2

with open(plaindata.__file__, encoding="utf-8") as _f:
    _PLAIN_SRC = _f.read()

# Both harnesses import nothing beyond the interpreter's start-up modules (os, time, builtins):
# data comes in as Python literals and goes out as JSON written by plaindata.to_json, and the
# test is rewritten on the host (transform_test), so neither json nor ast is imported in the
# sandbox. The host reads the output with json.loads (never ast.literal_eval: on a program's
# output that would cost 0.5 GB and 6 s per MiB).
# Records are lines on stdout, which the solution's own output (threads included) shares. A
# write of at most PIPE_BUF (4096) bytes to a pipe is atomic, so every record goes out as lines
# of at most 4000 bytes, each starting and ending with a newline: a small record as
# "<nonce> <json>", a larger one as parts "<nonce>~<seq>~<k>~<n> <part of the json>" that the
# host joins (parse_events). Output written at the same time lands between lines, never inside.
_EMIT = r'''
def _kimi_emitter(nonce):
    _write, _json, seq = _ko.write, to_json, [0]

    def write_all(data):
        while data:
            data = data[_write(1, data):]

    def emit(obj):
        text = _json(obj)
        if len(text) <= _KIMI_PART:
            write_all(("\n" + nonce + " " + text + "\n").encode())
            return
        seq[0] += 1
        n = (len(text) + _KIMI_PART - 1) // _KIMI_PART
        for k in range(n):
            write_all(("\n%s~%d~%d~%d %s\n" % (nonce, seq[0], k, n,
                       text[k * _KIMI_PART:(k + 1) * _KIMI_PART])).encode())
    return emit
'''
_PART = 3900  # json characters (ASCII) per record line: with the tag, under PIPE_BUF

_SOLUTION_HARNESS = r'''
import os as _ko, time as _kt

def _kimi_solution(SOLUTION, ENTRY, CALLS):
    _perf, _round = _kt.perf_counter, round
    with open(".kimi_nonce") as f:
        nonce = f.read().strip()
    _ko.unlink(".kimi_nonce")
    emit = _kimi_emitter(nonce)

    def err(e):
        name = _type_name(type(e))
        try:
            return (name + ": " + str(e))[:500]
        except BaseException:
            return name

    g = {"__name__": "__solution__", "__builtins__": __builtins__}
    try:
        exec(compile(SOLUTION, "solution.py", "exec"), g)
    except BaseException as e:
        emit({"event": "solution_error", "error": err(e)})
        return
    f = g.get(ENTRY)
    if f is None:
        emit({"event": "solution_error", "error": "entry point %r is not defined" % ENTRY})
        return
    emit({"event": "ready"})
    for i, payload in enumerate(CALLS):
        args, kwargs = decode_call(payload)
        t0 = _perf()
        try:
            r = f(*args, **kwargs)
        except BaseException as e:
            emit({"event": "call", "i": i, "raised": _type_name(type(e)), "msg": err(e),
                  "time_s": _round(_perf() - t0, 6)})
            continue
        rec = {"event": "call", "i": i, "time_s": _round(_perf() - t0, 6)}
        try:
            rec["result"] = encode_result(r)
        except Exception as e:
            rec["bad"] = err(e)
        try:
            after = encode_call(args, kwargs)
            if key_of(after) != key_of(payload):
                rec["after"] = after
        except Exception:
            pass
        emit(rec)
    emit({"event": "done"})
'''

_CHECK_HARNESS = r'''
import builtins as _kb, os as _ko, time as _kt, _signal as _ks

MAX_COLLECTED = 100000

class _KimiMissing(BaseException):
    """A call the solution run has no result for (the verdict asks for another round)."""

def _kimi_pending_type():
    def same(self, *a, **k):
        return self
    ns = {"__getattr__": same, "__call__": same, "__getitem__": same,
          "__bool__": lambda self: True, "__len__": lambda self: 0,
          "__iter__": lambda self: iter(()), "__contains__": lambda self, x: False,
          "__float__": lambda self: 0.0, "__int__": lambda self: 0, "__index__": lambda self: 0,
          "__complex__": lambda self: 0j, "__hash__": lambda self: 0,
          "__repr__": lambda self: "<pending>", "__str__": lambda self: "<pending>",
          "__format__": lambda self, spec: "<pending>"}
    for op in ("add sub mul truediv floordiv mod pow and or xor lshift rshift matmul divmod"
               .split()):
        ns["__%s__" % op] = ns["__r%s__" % op] = same
    for op in "eq ne lt le gt ge neg pos abs invert round trunc floor ceil".split():
        ns["__%s__" % op] = same
    return type("Pending", (), ns)

class _KimiStop(BaseException):
    """collect mode: a case ran past CASE_S or listed more than MAX_COLLECTED calls."""

def _kimi_check(PROMPT, TEST, ENTRY, KNOWN, MODE, NONCE, N_CASES, HAS_CHECK, SEED_RANDOM, CASE_S):
    _perf = _kt.perf_counter
    emit = _kimi_emitter(NONCE)

    def err(e):
        return (type(e).__name__ + ": " + str(e))[:500]

    table = {}
    for key, rec in KNOWN:
        table.setdefault(key, []).append(rec)
    used, needed, st = {}, [], {"missing": False, "time": 0.0}
    PENDING = _kimi_pending_type()()
    collecting = MODE == "collect"

    def apply_after(args, kwargs, after):
        try:
            a2, k2 = decode_call(after)
        except PlainDataError:
            return
        old = list(args) + [kwargs[n] for n in sorted(kwargs)]
        new = list(a2) + [k2[n] for n in sorted(k2)]
        if len(old) != len(new):
            return
        for o, n in zip(old, new):
            if type(o) is list and type(n) is list:
                o[:] = n
            elif (type(o) is dict and type(n) is dict) or (type(o) is set and type(n) is set):
                o.clear()
                o.update(n)

    def replay(rec, args, kwargs):
        st["time"] += rec.get("time_s", 0.0)
        if "raised" in rec:
            cls = getattr(_kb, rec["raised"], None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    exc = cls(rec["msg"])
                except Exception:
                    exc = cls.__new__(cls)
                    exc.args = (rec["msg"],)
                raise exc
            raise RuntimeError("the solution raised %s" % rec["msg"])
        if "bad" in rec:
            raise TypeError("the solution returned a value that is not plain data: " + rec["bad"])
        value = decode(rec["result"])
        if "after" in rec:
            apply_after(args, kwargs, rec["after"])
        return value

    def candidate(*args, **kwargs):
        try:
            payload = encode_call(args, kwargs)
        except PlainDataError as e:
            if collecting:
                return PENDING
            raise TypeError("the test passed arguments that are not plain data (%s); only plain "
                            "data crosses to the solution" % e) from None
        key = key_of(payload)
        n, recs = used.get(key, 0), table.get(key, ())
        if n < len(recs):
            used[key] = n + 1
            return replay(recs[n], args, kwargs)
        needed.append(payload)
        if collecting:
            if len(needed) > MAX_COLLECTED:
                raise _KimiStop()
            return PENDING
        st["missing"] = True
        raise _KimiMissing()

    def _start(i):
        st["missing"], st["time"] = False, 0.0
        if collecting:
            # a statement that loops on placeholder results (`while n != 1: n = candidate(n)`)
            # is cut after CASE_S; the calls it listed so far stay listed
            _ks.setitimer(_ks.ITIMER_REAL, CASE_S)

    def _case(i, ok, e):
        incomplete = st["missing"]
        emit({"event": "case", "i": i, "passed": bool(ok) and not incomplete,
              "incomplete": incomplete,
              "error": None if ok and not incomplete else (
                  "no recorded result for a call of this case" if incomplete else err(e)),
              "time_s": round(st["time"], 6)})

    def _alarm(signum, frame):
        raise _KimiStop()

    g = {"__name__": "__check__", "__builtins__": _kb}
    if collecting:
        _ks.signal(_ks.SIGALRM, _alarm)
    else:
        emit({"event": "cases", "n": N_CASES})
    try:
        if PROMPT:
            exec(compile(PROMPT, "prompt.py", "exec"), g)
        g["__kimi_start"], g["__kimi_case"], g["__kimi_Stop"] = _start, _case, _KimiStop
        g[ENTRY] = candidate
        if SEED_RANDOM:
            import random
            random.seed(SEED)
        exec(compile(TEST, "test.py", "exec"), g)
        if HAS_CHECK:
            g["check"](candidate)
    except BaseException as e:
        if not collecting:
            emit({"event": "check_error", "error": err(e)})
    if collecting:
        _ks.setitimer(_ks.ITIMER_REAL, 0)
    emit({"event": "needed", "calls": needed})
    emit({"event": "done"})
'''


# --------------------------------------------------------------------------------------------
# programs


def _is_case(stmt: ast.stmt) -> bool:
    return not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
        any(isinstance(n, ast.Assert) for n in ast.walk(stmt))


class _Strip(ast.NodeTransformer):
    """collect mode: every assert becomes `try: <test>; <msg> except Exception: pass`."""

    def visit_Assert(self, node):
        body = [ast.Expr(node.test)] + ([ast.Expr(node.msg)] if node.msg is not None else [])
        handler = ast.ExceptHandler(ast.Name("Exception", ast.Load()), None, [ast.Pass()])
        return ast.Try(body=body, handlers=[handler], orelse=[], finalbody=[])


def _call_stmt(name: str, args: list) -> ast.stmt:
    return ast.Expr(ast.Call(ast.Name(name, ast.Load()), args, []))


@functools.lru_cache(maxsize=4096)
def transform_test(test: str, mode: str) -> tuple[str, int, bool]:
    """The test rewritten for the checker (host side: parsing only). Each case (a top-level
    statement of `check`, or of the module, that contains an assert) is wrapped to report itself
    (mode "verdict"), or has its asserts reduced to evaluating their expressions with errors
    swallowed (mode "collect", where every top-level statement is also cut after its share of
    the timeout: the placeholder results can make a loop endless). Returns (source, number of cases, whether it defines check).
    Raises SyntaxError or ValueError if the test does not parse."""
    tree = parse_python(test)
    check, host = _check_and_host(tree)
    new, n = [], 0
    any_exc = ast.Name("BaseException", ast.Load())
    for stmt in host:
        if not _is_case(stmt):
            if mode == "collect":  # timed too: `while n != 1: n = candidate(n)` holds no assert
                stop = ast.Name("__kimi_Stop", ast.Load())
                stmt = ast.Try(body=[_call_stmt("__kimi_start", [ast.Constant(-1)]), stmt],
                               handlers=[ast.ExceptHandler(stop, None, [ast.Pass()])],
                               orelse=[], finalbody=[])
            new.append(stmt)
            continue
        if mode == "collect":
            new.append(ast.Try(body=[_call_stmt("__kimi_start", [ast.Constant(n)]),
                                     _Strip().visit(stmt)],
                               handlers=[ast.ExceptHandler(any_exc, None, [ast.Pass()])],
                               orelse=[], finalbody=[]))
        else:
            c = ast.Constant
            report = _call_stmt("__kimi_case", [c(n), c(False), ast.Name("__kimi_e", ast.Load())])
            new.append(ast.Try(
                body=[_call_stmt("__kimi_start", [c(n)]), stmt,
                      _call_stmt("__kimi_case", [c(n), c(True), c(None)])],
                handlers=[ast.ExceptHandler(any_exc, "__kimi_e", [report])],
                orelse=[], finalbody=[]))
        n += 1
    host[:] = new
    ast.fix_missing_locations(tree)
    return ast.unparse(tree), n, check is not None


_LITERAL_MAX = 64 << 10


def _data_expr(obj: Any) -> str:
    """Source text of a JSON-like value for a harness: a Python literal when small; else one
    string literal parsed by json at run time (compiling a large literal takes hundreds of MB)."""
    text = ascii(obj)
    if len(text) <= _LITERAL_MAX and _depth(obj) < 150:  # the parser nests at most 200 brackets
        return text
    return f"__import__('json').loads({plaindata.to_json(obj)!r})"


def _depth(obj: Any) -> int:
    """How deeply lists and dicts nest in a JSON-like value (without recursion)."""
    best, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if type(o) is list:
            best = max(best, d)
            stack.extend((v, d + 1) for v in o)
        elif type(o) is dict:
            best = max(best, d)
            stack.extend((v, d + 1) for v in o.values())
    return best


def solution_program(solution: str, entry: str, calls: list) -> str:
    """The program run where the completion runs: the solution, then its entry point on `calls`
    (encoded with plaindata.encode_call); no test code, no expected value."""
    return (_PLAIN_SRC + _SOLUTION_HARNESS + _EMIT + f"_KIMI_PART = {_PART}\n" +
            f"\n_kimi_solution({solution!r}, {entry!r}, {_data_expr(calls)})\n")


def collect_case_s(timeout_s: float, n_statements: int) -> float:
    """How long one top-level statement of a collect run may take: half the run's timeout shared
    by the statements, at least 0.2 s (a statement that loops on placeholders is cut there,
    never the whole run)."""
    return max(0.2, timeout_s / (2 * max(1, n_statements)))


def check_program(prompt: str, test: str, entry: str, known: list, mode: str, nonce: str,
                  timeout_s: float = 10.0) -> str:
    """The checker: the task's prompt definitions and test (rewritten by transform_test) with the
    entry point replaced by a replayer of `known` ([key, record] pairs); mode "collect" or
    "verdict" (collect: each top-level statement cut after collect_case_s). Raises
    SyntaxError or ValueError if the test does not parse."""
    src, n, has_check = transform_test(test, mode)
    n_statements = len(_check_and_host(parse_python(test))[1]) if mode == "collect" else 1
    seed_random = "random" in prompt or "random" in test
    return (_PLAIN_SRC + _CHECK_HARNESS + _EMIT + f"_KIMI_PART = {_PART}\nSEED = {SEED}\n" +
            f"_kimi_check({prompt!r}, {src!r}, {entry!r}, {_data_expr(known)}, {mode!r}, {nonce!r}, "
            f"{n}, {has_check}, {seed_random}, {collect_case_s(timeout_s, n_statements)!r})\n")


def _no_constant(name: str):
    raise ValueError(f"JSON constant {name}")


def parse_events(stdout: str, nonce: str) -> list[dict]:
    """The nonce-tagged JSON records of a harness's stdout (a record in parts is joined when its
    last part arrives, see _EMIT). Lines the program forged or broke
    (not JSON, NaN/Infinity, non-finite numbers, nesting deeper than plaindata allows) are
    dropped, never raised."""
    out, tag, ptag = [], nonce + " ", nonce + "~"
    parts: dict[int, tuple[int, dict[int, str]]] = {}
    for line in stdout.splitlines():
        if line.startswith(tag):
            text = line[len(tag):]
        elif line.startswith(ptag):
            head, _, part = line.partition(" ")
            fields = head[len(ptag):].split("~")
            if len(fields) != 3 or not all(f.isdigit() and len(f) < 10 for f in fields):
                continue
            seq, k, n = (int(f) for f in fields)
            have = parts.setdefault(seq, (n, {}))
            if have[0] != n or not 0 <= k < n or k in have[1]:
                continue  # the first of a part counts, as the first record of a call does
            have[1][k] = part
            if len(have[1]) < n:
                continue
            text = "".join(have[1][i] for i in range(n))
            parts[seq] = (n, {})  # joined once; a later copy of the same seq starts afresh
        else:
            continue
        try:
            ev = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            continue
        if isinstance(ev, dict) and _jsonish(ev, plaindata.MAX_DEPTH + 8):
            out.append(ev)
    return out


def _jsonish(obj: Any, limit: int) -> bool:
    """True if `obj` is made of dict (str keys), list, str, int, bool, None and finite floats,
    nested at most `limit` deep (checked without recursion)."""
    stack = [(obj, 0)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return False
        t = type(o)
        if t is list:
            stack.extend((v, d + 1) for v in o)
        elif t is dict:
            if any(type(k) is not str for k in o):
                return False
            stack.extend((v, d + 1) for v in o.values())
        elif t is float:
            if not math.isfinite(o):
                return False
        elif not (o is None or t in (str, int, bool)):
            return False
    return True


# --------------------------------------------------------------------------------------------
# static reading of the test (host side: parsing only, nothing of the task is executed here)

_CONST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.Div: operator.truediv}


class _NotConst(Exception):
    pass


def _small(v: Any) -> Any:
    if isinstance(v, (str, bytes, tuple, list)) and len(v) > 100_000:
        raise _NotConst
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 4096:
        raise _NotConst
    return v


def const_value(node: ast.AST) -> Any:
    """The value of a constant expression (literals, containers of them, + - * / // % ** and
    unary +/- on them, with size guards); raises _NotConst for anything else."""
    try:
        return _small(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp) and type(node.op) in _CONST_OPS:
        a, b = const_value(node.left), const_value(node.right)
        if isinstance(node.op, ast.Pow) and not (isinstance(b, (int, float)) and abs(b) <= 64
                                                 and isinstance(a, (int, float)) and abs(a) <= 1 << 20):
            raise _NotConst
        if isinstance(node.op, ast.Mult) and (isinstance(a, (str, list, tuple, bytes))
                                              or isinstance(b, (str, list, tuple, bytes))):
            n = b if isinstance(a, (str, list, tuple, bytes)) else a
            if not isinstance(n, int) or n > 100_000:
                raise _NotConst
        try:
            return _small(_CONST_OPS[type(node.op)](a, b))
        except (ArithmeticError, TypeError, ValueError):
            raise _NotConst from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = const_value(node.operand)
        if not isinstance(v, (int, float, complex)) or isinstance(v, bool):
            raise _NotConst
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        vals = [const_value(e) for e in node.elts]
        return list(vals) if isinstance(node, ast.List) else (
            tuple(vals) if isinstance(node, ast.Tuple) else set(vals))
    raise _NotConst


def _check_and_host(tree: ast.Module) -> tuple[ast.FunctionDef | None, list[ast.stmt]]:
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    return check, (check.body if check is not None else tree.body)


def case_count(test: str) -> int:
    """Top-level statements of `check` (or of the test module) that contain an assert: the cases
    (the same rule as the checker harness)."""
    try:
        tree = parse_python(test)
    except (SyntaxError, ValueError):
        return 0
    _, host = _check_and_host(tree)
    return sum(1 for s in host if _is_case(s))


def static_calls(test: str, entry: str) -> list | None:
    """The encoded calls of the entry point, in source order, when they can be read off the test
    without running it (see the module docstring); None otherwise."""
    try:
        tree = parse_python(test)
    except (SyntaxError, ValueError):
        return None
    check, host = _check_and_host(tree)
    names = {entry} if entry else set()
    if check is not None:
        if check.args.args:
            names.add(check.args.args[0].arg)
        outside = [n for n in tree.body if n is not check]
        if any(isinstance(x, ast.Name) and x.id in names for s in outside for x in ast.walk(s)):
            return None
    if not names:
        return None
    calls: list = []
    for stmt in host:
        if isinstance(stmt, (ast.Pass, ast.Import, ast.ImportFrom)) or (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Constant, ast.Name))
                and not (isinstance(stmt.value, ast.Name) and stmt.value.id in names)):
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            if any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(stmt)):
                return None
            continue
        if not isinstance(stmt, ast.Assert):
            return None
        # the message is evaluated only when the assert fails, and may call the function again
        # (HumanEval/77: "... " + str(candidate(1))): its calls are read too
        for part in (stmt.test, stmt.msg):
            found = _calls_in(part, names) if part is not None else []
            if found is None:
                return None
            calls += found
    return calls


def _calls_in(expr: ast.expr, names: set[str]) -> list | None:
    """Encoded constant-argument calls of `names` in evaluation order, or None if a name is used
    any other way (or with non-constant arguments)."""
    out: list = []
    ok = [True]

    class V(ast.NodeVisitor):
        def visit_Call(self, node):
            if isinstance(node.func, ast.Name) and node.func.id in names:
                try:
                    args = tuple(const_value(a) for a in node.args)
                    if any(isinstance(a, ast.Starred) for a in node.args) or \
                            any(k.arg is None for k in node.keywords):
                        raise _NotConst
                    kwargs = {k.arg: const_value(k.value) for k in node.keywords}
                    out.append(plaindata.encode_call(args, kwargs))
                except (_NotConst, plaindata.PlainDataError):
                    ok[0] = False
                return
            self.generic_visit(node)

        def visit_Name(self, node):
            if node.id in names:
                ok[0] = False

        def visit_Lambda(self, node):
            ok[0] = False

        def _comp(self, node):
            if any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(node)):
                ok[0] = False

        visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comp

    V().visit(expr)
    return out if ok[0] else None


# --------------------------------------------------------------------------------------------
# host side: one verification as a chain of sandbox runs


class _LRU:
    def __init__(self, size: int) -> None:
        self.size, self.d, self.lock = size, collections.OrderedDict(), threading.Lock()

    def get(self, k):
        with self.lock:
            if k in self.d:
                self.d.move_to_end(k)
                return self.d[k]
            return None

    def put(self, k, v) -> None:
        with self.lock:
            self.d[k] = v
            self.d.move_to_end(k)
            while len(self.d) > self.size:
                self.d.popitem(last=False)

    def clear(self) -> None:
        with self.lock:
            self.d.clear()


COLLECT_CACHE = _LRU(4096)
_STOPPED = ("timeout", "memory", "output_limit")  # checker run statuses that leave no verdict

_REC_KEYS = {"result", "after", "time_s", "raised", "msg", "bad"}


def _clean_record(ev: dict) -> dict | None:
    """A solution-run call record reduced to its known fields with their types checked; None if
    malformed (the call then counts as missing). Values stay JSON: the checker decodes them."""
    rec = {}
    t = ev.get("time_s", 0.0)
    rec["time_s"] = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) \
        and math.isfinite(t) and t >= 0 else 0.0
    if "raised" in ev:
        if not isinstance(ev["raised"], str) or not isinstance(ev.get("msg", ""), str):
            return None
        rec["raised"], rec["msg"] = ev["raised"][:200], ev.get("msg", "")[:500]
    elif "bad" in ev:
        rec["bad"] = str(ev["bad"])[:500]
    elif "result" in ev:
        rec["result"] = ev["result"]
        if "after" in ev:
            rec["after"] = ev["after"]
    else:
        return None
    return rec


@functools.lru_cache(maxsize=4096)
def checker_prompt(prompt: str, test: str, entry: str) -> str:
    """The prompt's code as the checker needs it: all of it when the test uses a name the prompt
    binds at top level other than the entry point (HumanEval/32's `poly`, /38's
    `encode_cyclic`), else nothing (saves importing e.g. `typing` in every checker)."""
    if not prompt:
        return ""
    try:
        bound = set()
        for node in parse_python(prompt).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            else:
                bound |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                          and isinstance(n.ctx, ast.Store)}
        used = {n.id for n in ast.walk(parse_python(test)) if isinstance(n, ast.Name)}
    except (SyntaxError, ValueError):
        return prompt
    return prompt if (bound - {entry}) & used else ""


def prompt_is_code(task: Task) -> bool:
    if task.meta.get("prompt_is_text") or not task.prompt.strip():
        return False
    try:
        parse_python(task.prompt)
        return True
    except (SyntaxError, ValueError):
        return False


class Job:
    """One python_tests verification: collect (if needed) -> solution -> verdict [-> solution
    -> verdict]..., each step submitted from the previous step's completion callback, so many
    verifications pipeline through the executor. `future` gets (score, details)."""

    def __init__(self, task: Task, solution: str, executor) -> None:
        self.task, self.solution, self.ex = task, solution, executor
        self.prompt = checker_prompt(task.prompt, task.test, task.entry_point) \
            if prompt_is_code(task) else ""
        self.future: Future = Future()
        self.known: list = []
        self.have: collections.Counter = collections.Counter()
        self.tried: collections.Counter = collections.Counter()
        self.runs: list[tuple[str, ExecutionResult]] = []
        self.solution_runs = 0
        self.load_error: str | None = None
        self._cache_key = hashlib.sha256(json.dumps(
            [_HARNESS_VERSION, SEED, self.prompt, task.test, task.entry_point]).encode()).hexdigest()

    # ---- plumbing ---------------------------------------------------------------------------
    def _then(self, fut, fn, *args) -> None:
        def cb(f):
            try:
                fn(f.result(), *args)
            except BaseException as e:  # noqa: BLE001 - surfaced by Pending.result()
                if not self.future.done():
                    self.future.set_exception(e)
        fut.add_done_callback(cb)

    def start(self) -> Future:
        try:
            calls = static_calls(self.task.test, self.task.entry_point)
            if calls is None:
                calls = COLLECT_CACHE.get(self._cache_key)
            if calls is None:
                nonce = secrets.token_hex(16)
                prog = check_program(self.prompt, self.task.test, self.task.entry_point, [],
                                     "collect", nonce, self.task.timeout_s)
                self._then(self._submit_check(prog), self._on_collect, nonce)
            else:
                self._solve(calls)
        except BaseException as e:  # noqa: BLE001
            self.future.set_exception(e)
        return self.future

    def _submit_check(self, prog: str):
        return self.ex.submit(prog, timeout_s=self.task.timeout_s, memory_mb=self.task.memory_mb,
                              output_limit_bytes=CHECK_OUTPUT_LIMIT, isolated=True)

    # ---- steps ------------------------------------------------------------------------------
    def _on_collect(self, r: ExecutionResult, nonce: str) -> None:
        self.runs.append(("collect", r))
        events = parse_events(r.stdout, nonce)
        needed = next((e.get("calls") for e in events if e.get("event") == "needed"), None)
        if not isinstance(needed, list) or not any(e.get("event") == "done" for e in events):
            err = next((e.get("error") for e in events if e.get("event") == "check_error"), None)
            return self._finish(None, None, problem=("check_error", err or
                                f"the test's collect run ended with {r.status}: "
                                f"{(r.stderr or r.message)[-300:]}"))
        COLLECT_CACHE.put(self._cache_key, needed)
        self._solve(needed)

    def _solve(self, calls: list) -> None:
        self.solution_runs += 1
        for p in calls:
            self.tried[key_of(p)] += 1
        nonce = secrets.token_hex(16)
        fut = self.ex.submit(solution_program(self.solution, self.task.entry_point, calls),
                             files={".kimi_nonce": nonce}, timeout_s=self.task.timeout_s,
                             memory_mb=self.task.memory_mb, output_limit_bytes=SOLUTION_OUTPUT_LIMIT)
        self._then(fut, self._on_solution, calls, nonce)

    def _on_solution(self, r: ExecutionResult, calls: list, nonce: str) -> None:
        self.runs.append(("solution", r))
        events = parse_events(r.stdout, nonce)
        if self.solution_runs == 1:
            bad = next((e for e in events if e.get("event") == "solution_error"), None)
            if bad is not None or not any(e.get("event") == "ready" for e in events):
                self.load_error = str(bad.get("error")) if bad else None
                return self._finish(None, None, problem=("solution_error", self.load_error),
                                    stderr=None if bad else r.stderr)
        seen: set[int] = set()
        for e in events:
            i = e.get("i")
            if e.get("event") != "call" or type(i) is not int or not 0 <= i < len(calls) \
                    or i in seen:
                continue
            seen.add(i)
            rec = _clean_record(e)
            if rec is not None:
                k = key_of(calls[i])
                self.known.append([k, rec])
                self.have[k] += 1
        nonce = secrets.token_hex(16)
        prog = check_program(self.prompt, self.task.test, self.task.entry_point, self.known,
                             "verdict", nonce)
        self._then(self._submit_check(prog), self._on_verdict, nonce)

    def _on_verdict(self, r: ExecutionResult, nonce: str) -> None:
        self.runs.append(("verdict", r))
        events = parse_events(r.stdout, nonce)
        needed = next((e.get("calls") for e in events if e.get("event") == "needed"), None) or []
        new = self._schedule(needed if isinstance(needed, list) else [])
        if new and self.solution_runs < MAX_SOLUTION_RUNS:
            return self._solve(new)
        if r.status in _STOPPED and not any(kind == "probe" for kind, _ in self.runs):
            # stopped: by the test alone, or by what the completion's values made it do? The same
            # verdict without any result (every call missing, so no value of the completion
            # is used) tells: if it is stopped too, the test is at fault
            nonce = secrets.token_hex(16)
            prog = check_program(self.prompt, self.task.test, self.task.entry_point, [],
                                 "verdict", nonce)
            self._then(self._submit_check(prog), self._on_probe, events, r)
            return
        self._finish(events, r)

    def _on_probe(self, probe: ExecutionResult, events: list, verdict: ExecutionResult) -> None:
        self.runs.append(("probe", probe))
        self._finish(events, verdict)

    def _schedule(self, needed: list) -> list:
        """Calls the verdict missed that no solution run has tried yet (a tried call that left no
        record is not retried: the run died or timed out there)."""
        want: collections.Counter = collections.Counter()
        first: dict = {}
        for p in needed:
            try:
                k = key_of(p)
            except (TypeError, ValueError):
                continue
            want[k] += 1
            first.setdefault(k, p)
        new = []
        for k, n in want.items():
            extra = self.have[k] + n - self.tried[k]
            new += [first[k]] * max(0, extra)
        return new

    # ---- the verdict ------------------------------------------------------------------------
    def _finish(self, events: list | None, verdict: ExecutionResult | None,
                problem: tuple[str, str | None] | None = None, stderr: str | None = None) -> None:
        task = self.task
        events = events or []
        n = next((e.get("n") for e in events if e.get("event") == "cases"), None)
        if not isinstance(n, int):
            n = case_count(task.test)
        cases = [{"passed": e.get("passed") is True, "error": e.get("error"),
                  "time_s": e.get("time_s")}
                 for e in events if e.get("event") == "case"][:n]
        done = verdict is not None and any(e.get("event") == "done" for e in events)
        if problem is None:
            ce = next((e for e in events if e.get("event") == "check_error"), None)
            if ce is not None:
                problem = ("check_error", ce.get("error"))
        sol = [r for kind, r in self.runs if kind == "solution"]
        checkers = [(kind, r) for kind, r in self.runs if kind in ("collect", "verdict")]
        # a stopped collect run never saw the completion; a stopped verdict is the test's fault
        # only when its probe (the verdict without any of the completion's values) stopped too
        probe_stopped = any(kind == "probe" and r.status in _STOPPED for kind, r in self.runs)
        checker_stopped = next(((kind, r.status) for kind, r in checkers
                                if r.status == "sandbox_error" or (r.status in _STOPPED and (
                                    kind == "collect" or probe_stopped))), None)
        sol_bad = next((r.status for r in sol if r.status != "ok"), None)
        passed = sum(c["passed"] for c in cases)
        all_ok = (done and problem is None and n > 0 and passed == n and sol_bad is None
                  and verdict.status == "ok")
        score = (passed / n if n else 0.0) if task.scoring == "fraction" else float(all_ok)
        if all_ok:
            status = "pass"
        elif n == 0 and problem is None:
            status = "invalid_task"
        elif sol_bad is not None and sol_bad not in ("ok", "error"):
            status = sol_bad
        elif checker_stopped is not None:
            # the test's own run (collect or verdict) was stopped: no verdict on the completion,
            # so it is not its failure (RL drops sandbox_error samples) and never reused
            status = "sandbox_error"
            if problem is None or problem[0] != "checker_stopped":
                problem = ("checker_stopped", f"the test's {checker_stopped[0]} run ended with "
                           f"{checker_stopped[1]}" + (f" ({problem[1]})" if problem else ""))
        else:
            status = "fail"
        last = sol[-1] if sol else None
        details = {"family": "python_tests", "score": score, "status": status, "cases": cases,
                   "n_cases": n, "n_passed": passed, "completed": done,
                   "sandbox_status": last.status if last else None,
                   "exit_code": last.exit_code if last else None,
                   "check_status": (verdict.status if verdict is not None else
                                    checkers[-1][1].status if checkers else None),
                   "runs": [kind for kind, _ in self.runs],
                   "wall_s": sum(r.wall_s for _, r in self.runs)}
        if problem is not None:
            details["error_kind"], details["error"] = problem
        if stderr:
            details["stderr"] = stderr[-1000:]
        self.future.set_result((score, details))


def start(task: Task, solution: str, executor) -> Future:
    """Submits the runs verifying `solution` (the full program text) against `task`; a Future of
    (score, details)."""
    return Job(task, solution, executor).start()

