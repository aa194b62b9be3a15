"""Code: a one-line Python function from a short spec and examples, e.g.
"def f(x): f(0)=1 f(1)=4 f(2)=7" -> "def f(x):\\n return 3*x+1".

Scoring method `python_tests` (sandbox/verifiers.py): a HumanEval-style `check(candidate)` with
6-9 hidden asserts that include the shown examples; meta["prompt_is_text"] (the prompt is a
spec, not code to prepend). Difficulty picks the template set (1: x+k, x*k, parity, max, upper,
reverse, ...; 2: linear from examples, clamp, mod, count a char, map, filter, slices; 3: signed
linear, a*x*x+c, count above k, sum of squares, spread).

Canonical key (the split, sandbox/tasks/splits.py): the template, its constants and the shown
example inputs. Corruptions: the template's wrong bodies (an off-by-one constant, a wrong
operator, ...), the first that differs from the right body on the hidden inputs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from ..schema import Task
from ..splits import task_hash
from .base import OneShotDomain


def _lit(v: Any) -> str:
    return repr(v).replace(", ", ",")


@dataclasses.dataclass(frozen=True)
class _CodeTemplate:
    name: str
    arg: str                                  # "x" (int), "s" (str) or "xs" (list of int)
    params: Callable[[random.Random], dict]   # constants (and derived strings) for the formats
    spec: str                                 # "" = examples only
    body: str
    wrong: tuple[str, ...]
    shown: tuple[Any, ...] = ()               # fixed example inputs (else one random input)
    extra: Callable[[dict], list] = lambda p: []  # inputs every hidden test includes


def _signed(v: int) -> str:
    return f"{v:+d}"


def _linear(rng, signed: bool) -> dict:
    if signed:
        a = rng.choice([a for a in range(-5, 10) if a not in (0, 1)])
        b = rng.choice([b for b in range(-9, 10) if b != 0])
    else:
        a, b = rng.randint(2, 9), rng.randint(1, 9)
    return {"a": a, "b": _signed(b), "b1": _signed(b + 1), "bm": _signed(b - 1), "a1": a + 1,
            "nb": _signed(-b), "bb": b}


def _k(lo, hi):
    return lambda rng: (lambda k: {"k": k, "k1": k + 1, "km": k - 1})(rng.randint(lo, hi))


def _clamp(rng):
    lo = rng.randint(0, 5)
    hi = lo + rng.randint(2, 9)
    return {"lo": lo, "hi": hi, "lo1": lo + 1, "hi1": hi - 1}


def _char(rng):
    c, c2 = rng.sample("abcde", 2)
    return {"c": c, "c2": c2}


def _quad(rng):
    a, c = rng.randint(1, 4), rng.randint(0, 9)
    return {"a": a, "c": c, "a1": a + 1, "c1": c + 1}


_NONE: Callable[[random.Random], dict] = lambda rng: {}

_CODE_TEMPLATES: dict[int, list[_CodeTemplate]] = {
    1: [
        _CodeTemplate("add", "x", _k(1, 9), "x plus {k}", "x+{k}", ("x+{k1}", "x-{k}", "x*{k}")),
        _CodeTemplate("sub", "x", _k(1, 9), "x minus {k}", "x-{k}", ("x-{k1}", "x+{k}", "{k}-x")),
        _CodeTemplate("mul", "x", _k(2, 9), "x times {k}", "x*{k}", ("x*{k1}", "x+{k}", "x*{km}")),
        _CodeTemplate("even", "x", _NONE, "True if x is even", "x%2==0", ("x%2==1", "x%2>0")),
        _CodeTemplate("odd", "x", _NONE, "True if x is odd", "x%2==1", ("x%2==0", "x%2<1")),
        _CodeTemplate("upper", "s", _NONE, "s in upper case", "s.upper()",
                      ("s.lower()", "s.title()", "s.capitalize()")),
        _CodeTemplate("reverse", "s", _NONE, "s reversed", "s[::-1]", ("s[1:]", "s[:-1]", "s[::2]")),
        _CodeTemplate("length", "s", _NONE, "length of s", "len(s)", ("len(s)+1", "len(s)-1")),
        _CodeTemplate("max", "xs", _NONE, "largest x in xs", "max(xs)",
                      ("min(xs)", "xs[0]", "xs[-1]", "sum(xs)")),
        _CodeTemplate("min", "xs", _NONE, "smallest x in xs", "min(xs)",
                      ("max(xs)", "xs[0]", "xs[-1]")),
        _CodeTemplate("sum", "xs", _NONE, "sum of xs", "sum(xs)", ("max(xs)", "len(xs)", "sum(xs)+1")),
    ],
    2: [
        _CodeTemplate("linear", "x", lambda rng: _linear(rng, False), "", "{a}*x{b}",
                      ("{a}*x{b1}", "{a}*x{bm}", "{a1}*x{b}", "{a}*x{nb}"), shown=(0, 1, 2)),
        _CodeTemplate("clamp", "x", _clamp, "x clamped to {lo}..{hi}", "min(max(x,{lo}),{hi})",
                      ("min(max(x,{lo}),{hi1})", "max(min(x,{lo}),{hi})", "min(max(x,{lo1}),{hi})",
                       "max(x,{lo})"),
                      extra=lambda p: [p["lo"] - 2, p["lo"], p["hi"], p["hi"] + 3]),
        _CodeTemplate("mod", "x", _k(2, 9), "x mod {k}", "x%{k}", ("x//{k}", "x%{k1}", "x%{km}")),
        _CodeTemplate("count", "s", _char, "number of '{c}' in s", "s.count('{c}')",
                      ("s.count('{c2}')", "len(s)", "s.count('{c}')+1")),
        _CodeTemplate("map", "xs", _k(1, 9), "add {k} to each x in xs", "[x+{k} for x in xs]",
                      ("[x+{k1} for x in xs]", "[x*{k} for x in xs]", "[x-{k} for x in xs]")),
        _CodeTemplate("filter", "xs", _k(1, 7), "the x in xs above {k}", "[x for x in xs if x>{k}]",
                      ("[x for x in xs if x>={k}]", "[x for x in xs if x<{k}]",
                       "[x for x in xs if x>{k1}]"),
                      extra=lambda p: [[p["k"], p["k"] + 1, p["k"] - 1]]),
        _CodeTemplate("repeat", "s", _k(2, 4), "s repeated {k} times", "s*{k}", ("s*{k1}", "s*{km}")),
        _CodeTemplate("prefix", "s", _k(1, 3), "first {k} chars of s", "s[:{k}]",
                      ("s[{k}:]", "s[:{k1}]", "s[-{k}:]")),
    ],
    3: [
        _CodeTemplate("linear_signed", "x", lambda rng: _linear(rng, True), "", "{a}*x{b}",
                      ("{a}*x{b1}", "{a}*x{bm}", "{a1}*x{b}", "{a}*x{nb}"), shown=(0, 1, 2)),
        _CodeTemplate("quadratic", "x", _quad, "", "{a}*x*x+{c}",
                      ("{a}*x+{c}", "{a}*x*x+{c1}", "{a1}*x*x+{c}"), shown=(0, 1, 2)),
        _CodeTemplate("count_above", "xs", _k(1, 7), "how many x in xs are above {k}",
                      "sum(x>{k} for x in xs)",
                      ("sum(x>={k} for x in xs)", "sum(x<{k} for x in xs)", "len(xs)"),
                      extra=lambda p: [[p["k"], p["k"] + 1, p["k"] - 1]]),
        _CodeTemplate("sum_squares", "xs", _NONE, "sum of squares of xs", "sum(x*x for x in xs)",
                      ("sum(x+x for x in xs)", "sum(xs)**2", "sum(x*2 for x in xs)")),
        _CodeTemplate("spread", "xs", _NONE, "max minus min of xs", "max(xs)-min(xs)",
                      ("max(xs)-xs[0]", "min(xs)-max(xs)", "max(xs)+min(xs)")),
        _CodeTemplate("distance", "x", _k(1, 9), "distance from x to {k}", "abs(x-{k})",
                      ("x-{k}", "abs(x+{k})", "abs(x-{k1})")),
    ],
}
_CODE_BY_NAME = {t.name: t for ts in _CODE_TEMPLATES.values() for t in ts}


def _code_input(rng: random.Random, arg: str) -> Any:
    if arg == "x":
        return rng.randint(-3, 12)
    if arg == "s":
        return "".join(rng.choice("abcde") for _ in range(rng.randint(2, 6)))
    return [rng.randint(0, 9) for _ in range(rng.randint(2, 4))]


def _code_fn(arg: str, body: str) -> Callable:
    return eval(f"lambda {arg}: {body}")  # noqa: S307 - bodies come from the templates above


def _outputs(fn: Callable, inputs: list) -> list:
    out = []
    for i in inputs:
        try:
            out.append(("ok", fn(i)))
        except Exception as e:  # noqa: BLE001 - a corrupted body may raise: that is a difference
            out.append(("error", type(e).__name__))
    return out


class CodeDomain(OneShotDomain):
    name = "code"

    def _draw(self, rng, difficulty):
        t = rng.choice(_CODE_TEMPLATES[difficulty])
        p = t.params(rng)
        shown = list(t.shown) if t.shown else [_code_input(rng, t.arg)]
        return self.build(t.name, p, shown, difficulty)

    def build(self, template: str, p: dict, shown: list, difficulty: int) -> tuple[Task, str]:
        t = _CODE_BY_NAME[template]
        body = t.body.format(**p)
        fn = _code_fn(t.arg, body)
        examples = " ".join(f"f({_lit(i)})={_lit(fn(i))}" for i in shown)
        spec = t.spec.format(**p)
        prompt = f"def f({t.arg}): " + (f"{spec}. {examples}" if spec else examples)
        demo = f"def f({t.arg}):\n return {body}"
        key = (template, p, shown)
        inputs = self._test_inputs(t, p, shown, key)
        asserts = "".join(f"    assert candidate({_lit(i)}) == {_lit(fn(i))}\n" for i in inputs)
        test = "def check(candidate):\n" + asserts
        task = self._task(difficulty, template, key, key, prompt, demo,
                          {"p": p, "shown": shown}, family="python_tests", test=test,
                          entry_point="f", canonical_solution=demo)
        task.meta["prompt_is_text"] = True  # the prompt is a spec, not code to prepend
        return task, demo

    @staticmethod
    def _test_inputs(t: _CodeTemplate, p: dict, shown: list, key: Any) -> list:
        r = random.Random(task_hash("code-tests", key))
        cands = list(shown) + t.extra(p) + [_code_input(r, t.arg) for _ in range(6)]
        seen, out = set(), []
        for c in cands:
            if _lit(c) not in seen:
                seen.add(_lit(c))
                out.append(c)
        return out

    def corrupt(self, rng, task, demo):
        t = _CODE_BY_NAME[task.meta["template"]]
        p, shown = task.meta["params"]["p"], task.meta["params"]["shown"]
        key = (t.name, p, shown)
        inputs = self._test_inputs(t, p, shown, key)
        want = _outputs(_code_fn(t.arg, t.body.format(**p)), inputs)
        wrong = [w.format(**p) for w in t.wrong]
        rng.shuffle(wrong)
        for body in wrong:
            if _outputs(_code_fn(t.arg, body), inputs) != want:
                return f"def f({t.arg}):\n return {body}"
        return f"def f({t.arg}):\n return None"  # no template variant differs on these inputs


DOMAIN = CodeDomain()
