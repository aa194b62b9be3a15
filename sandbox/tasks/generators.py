"""Procedurally generated task families for a tiny byte-level model, and a GSM8K-style loader.

Every task is short (prompt <= MAX_PROMPT_BYTES = 64 bytes, demonstration completion <=
MAX_COMPLETION_BYTES = 48 bytes, both UTF-8) and is scored only by running things in the sandbox
through a verifier family (sandbox/verifiers.py):

  arithmetic  Countdown-style. "Make 22 from 3 5 7 using + - * and parentheses" -> "3*5+7".
              Family `answer_check`: the completion is written to answer.txt and a Python check
              in the sandbox parses it with `ast` (only integer literals, + - * and parentheses),
              requires the multiset of literals to equal the given numbers (each used exactly
              once) and the value to equal the target. Difficulty d uses d+1 numbers (2..4).
              Targets come from a random expression over the numbers, so every task is solvable.
  code        a one-line Python function from a short spec and examples, e.g.
              "def f(x): f(0)=1 f(1)=4 f(2)=7" -> "def f(x):\\n return 3*x+1". Family
              `python_tests` (HumanEval-style `check(candidate)`, 6-9 hidden asserts that include
              the shown examples). Difficulty picks the template set (1: x+k, x*k, parity, max,
              upper, reverse, ...; 2: linear from examples, clamp, mod, count a char, map,
              filter, slices; 3: signed linear, a*x*x+c, count above k, sum of squares, spread).
  terminal    a shell command over files in the working directory whose result goes to
              out.txt, e.g. "Write line 3 of log.txt to out.txt" -> "sed -n 3p log.txt >
              out.txt". Family `terminal` (the check, in a fresh sandbox, compares out.txt with
              the expected lines after stripping trailing whitespace and trailing empty lines).
              Difficulty 1: wc -l, sed -n Np, head, tail; 2: sort (-n/-r), grep (-c), cut;
              3: pipelines (grep | cut, cut | sort -n, sort -u | wc -l, sort -n | head, awk sum).

API

  FAMILIES: {"arithmetic", "code", "terminal"} -> generator with
      sample(rng, difficulty) -> (Task, demo)         rng: random.Random, difficulty in 1..3
      corrupt(rng, task, demo) -> wrong completion    well-formed but scores 0 (off-by-one
                                                      constant, wrong operator, wrong column,
                                                      wrong flag, ...), checked offline
  make_split(family, split, n, seed, difficulty=None) -> [(Task, demo)]
      deterministic for (family, split, n, seed, difficulty); n distinct tasks (by task id);
      difficulty None cycles 1, 2, 3 so the levels are balanced.
  make_mixture(families, split, n_per_family, seed) -> [(Task, demo)]
      n_per_family from each family, interleaved round-robin (every prefix is balanced).
  sft_examples(pairs, imperfect_frac, seed) -> [(prompt, completion, is_correct)]
      same order as pairs; exactly round(imperfect_frac * count) examples of each family get a
      corrupted completion (DESIGN section 7: about 40% imperfect leaves room for RL).
  corrupt(rng, task, demo) -> wrong completion, dispatching on task.meta["family_name"]
      (also handles "gsm8k" tasks).
  write_jsonl(items, path) / read_jsonl(path): tasks or (task, demo) pairs through
      loaders.save_tasks / load_tasks; the demo travels in meta["demo"].
  load_gsm8k(path, split=None, limit=None) -> [Task]: GSM8K-format JSONL (question, answer
      ending in "#### 42") as math-family tasks (math-verify); meta["demo"] is the reasoning
      without the <<...>> calculator notes followed by "The answer is \\boxed{42}.".

Task meta: split, difficulty, family_name, template, params (what corrupt() needs), demo.
Task ids: "<family>/<split>/d<difficulty>/<12 hex digits of a hash of the full task>".

Split rule (disjointness): every task has a canonical key made of everything that determines its
prompt (arithmetic: sorted numbers and target; code: template, constants and shown example
inputs; terminal: template, file name and visible parameters, not the hidden file contents).
bucket = int(sha256(family + key)[:8], 16) % 100; train: bucket < 80, val: 80..89, test: 90..99.
The split is a property of the task, independent of the seed, so no prompt of any test split
ever appears in any train split, whatever seeds are used. make_split samples with a seeded
random.Random and keeps the tasks whose bucket matches.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .loaders import iter_jsonl, load_tasks, save_tasks
from .schema import Task, TaskFormatError

MAX_PROMPT_BYTES = 64
MAX_COMPLETION_BYTES = 48
SPLITS = ("train", "val", "test")
DIFFICULTIES = (1, 2, 3)
_TIMEOUT_S = 5.0
_MEMORY_MB = 256


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def split_of(family: str, key: Any) -> str:
    """The split ("train" | "val" | "test") of a task with canonical key `key` (see docstring)."""
    b = int(_hash(family, key)[:8], 16) % 100
    return "train" if b < 80 else ("val" if b < 90 else "test")


def _fits(prompt: str, completion: str) -> bool:
    return (len(prompt.encode()) <= MAX_PROMPT_BYTES
            and len(completion.encode()) <= MAX_COMPLETION_BYTES)


class Generator:
    """Base class: subclasses implement `_draw(rng, difficulty) -> (Task, demo) | None` (None
    when a draw exceeds the byte limits or is degenerate) and `corrupt`."""

    name = ""

    def sample(self, rng: random.Random, difficulty: int) -> tuple[Task, str]:
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        for _ in range(1000):
            out = self._draw(rng, difficulty)
            if out is not None and _fits(out[0].prompt, out[1]):
                return out
        raise RuntimeError(f"{self.name}: could not draw a task within the byte limits")

    def _draw(self, rng: random.Random, difficulty: int) -> tuple[Task, str] | None:
        raise NotImplementedError

    def corrupt(self, rng: random.Random, task: Task, demo: str) -> str:
        raise NotImplementedError

    def _task(self, difficulty: int, template: str, key: Any, uniq: Any, prompt: str, demo: str,
              params: dict, **fields: Any) -> Task:
        split = split_of(self.name, key)
        tid = f"{self.name}/{split}/d{difficulty}/{_hash(self.name, key, uniq)[:12]}"
        meta = {"split": split, "difficulty": difficulty, "family_name": self.name,
                "template": template, "params": params, "demo": demo}
        return Task(id=tid, prompt=prompt, timeout_s=_TIMEOUT_S, memory_mb=_MEMORY_MB, meta=meta,
                    **fields)


# ============================================================================================
# arithmetic (Countdown)

# The checker runs inside the sandbox (family answer_check); the same source is executed here
# to validate demonstrations and corruptions offline.
_COUNTDOWN_SRC = r'''
import ast

def countdown_ok(text, numbers, target):
    """True iff text is one expression of integer literals, + - * and parentheses that uses the
    multiset `numbers` exactly and evaluates to `target`."""
    s = text.strip()
    if not s or len(s) > 200:
        return False
    used = []

    def ev(node):
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        raise ValueError("not allowed: " + type(node).__name__)

    try:
        value = ev(ast.parse(s, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return sorted(used) == sorted(numbers) and value == target
'''
_ns: dict[str, Any] = {}
exec(compile(_COUNTDOWN_SRC, "<countdown>", "exec"), _ns)  # noqa: S102 - our own constant source
countdown_ok: Callable[[str, Sequence[int], int], bool] = _ns["countdown_ok"]

# difficulty -> (count, lo, hi). Level 1 (two numbers up to 70: ~5300 distinct tasks) is wide
# enough for a 3000-task train split; it is what a byte-level model of ~1M params partly learns.
_ARITH_RANGES = {1: (2, 1, 70), 2: (3, 1, 12), 3: (4, 1, 9)}
_ARITH_TARGET = (1, 200)
_PREC = {"+": 1, "-": 1, "*": 2}
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}

Tree = Any  # int | (op, Tree, Tree)


def _tree_value(t: Tree) -> int:
    if isinstance(t, int):
        return t
    op, a, b = t
    x, y = _tree_value(a), _tree_value(b)
    return x + y if op == "+" else (x - y if op == "-" else x * y)


def _render(t: Tree, parens: bool = True) -> str:
    """Infix with the fewest parentheses (or none at all: a plausible mistake)."""
    if isinstance(t, int):
        return str(t)
    op, a, b = t
    ls, rs = _render(a, parens), _render(b, parens)
    if parens and not isinstance(a, int) and _PREC[a[0]] < _PREC[op]:
        ls = f"({ls})"
    if parens and not isinstance(b, int) and (_PREC[b[0]] < _PREC[op]
                                              or (_PREC[b[0]] == _PREC[op] and op == "-")):
        rs = f"({rs})"
    return ls + op + rs


def _random_tree(rng: random.Random, nums: list[int]) -> Tree:
    if len(nums) == 1:
        return nums[0]
    i = rng.randrange(1, len(nums))
    return (rng.choice("+-*"), _random_tree(rng, nums[:i]), _random_tree(rng, nums[i:]))


def _parse_tree(s: str) -> Tree | None:
    def conv(n):
        if isinstance(n, ast.BinOp) and type(n.op) in _AST_OPS:
            return (_AST_OPS[type(n.op)], conv(n.left), conv(n.right))
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        raise ValueError
    try:
        return conv(ast.parse(s.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _tree_edits(t: Tree) -> dict[str, list[Tree]]:
    """Single edits of a tree by kind: a wrong operator, a number off by one, swapped operands."""
    out: dict[str, list[Tree]] = {"op": [], "number": [], "swap": []}
    if isinstance(t, int):
        out["number"] += [t + 1] + ([t - 1] if t > 1 else [])
        return out
    op, a, b = t
    out["op"] += [(o, a, b) for o in "+-*" if o != op]
    if op == "-":
        out["swap"].append((op, b, a))
    for kind, subs in _tree_edits(a).items():
        out[kind] += [(op, s, b) for s in subs]
    for kind, subs in _tree_edits(b).items():
        out[kind] += [(op, a, s) for s in subs]
    return out


class ArithmeticGenerator(Generator):
    name = "arithmetic"

    def _draw(self, rng, difficulty):
        count, lo, hi = _ARITH_RANGES[difficulty]
        nums = [rng.randint(lo, hi) for _ in range(count)]
        tree = _random_tree(rng, nums)
        target = _tree_value(tree)
        if not _ARITH_TARGET[0] <= target <= _ARITH_TARGET[1]:
            return None
        return self.build(nums, target, _render(tree), difficulty)

    def build(self, numbers: Sequence[int], target: int, demo: str,
              difficulty: int | None = None) -> tuple[Task, str]:
        """The task "make `target` from `numbers`" with demonstration `demo` (must solve it)."""
        shown = sorted(numbers)
        difficulty = difficulty if difficulty is not None else max(1, min(3, len(shown) - 1))
        count = len(shown)
        prompt = f"Make {target} from {' '.join(map(str, shown))} using + - * and parentheses"
        if not countdown_ok(demo, shown, target):
            raise ValueError(f"{demo!r} does not make {target} from {shown}")
        check = (_COUNTDOWN_SRC + "\nimport sys\nwith open('answer.txt', encoding='utf-8', "
                 "errors='replace') as _f:\n    _text = _f.read()\n"
                 f"sys.exit(0 if countdown_ok(_text, {shown!r}, {target!r}) else 1)\n")
        key = (shown, target)
        task = self._task(difficulty, f"countdown{count}", key, key, prompt, demo,
                          {"numbers": shown, "target": target}, family="answer_check",
                          check=check, check_language="python")
        return task, demo

    def corrupt(self, rng, task, demo):
        nums, target = task.meta["params"]["numbers"], task.meta["params"]["target"]
        tree = _parse_tree(demo)
        if tree is None:
            tree = _parse_tree(task.meta["demo"])
        edits = _tree_edits(tree)
        flat = _render(tree, parens=False)
        if flat != _render(tree):
            edits["parens"] = [flat]
        kinds = [k for k in sorted(edits) if edits[k]]
        rng.shuffle(kinds)
        for k in kinds:  # a random kind first, then any other that yields a wrong answer
            cands = [c if isinstance(c, str) else _render(c) for c in edits[k]]
            rng.shuffle(cands)
            for c in cands:
                if not countdown_ok(c, nums, target) and len(c.encode()) <= MAX_COMPLETION_BYTES:
                    return c
        return _render(tree) + "+1"  # unreachable for trees of >= 2 numbers; still wrong


# ============================================================================================
# code


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


class CodeGenerator(Generator):
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
        r = random.Random(_hash("code-tests", key))
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


# ============================================================================================
# terminal

_WORDS = ("cat", "dog", "owl", "fox", "bee", "ant", "elk", "yak", "emu", "ape", "bat", "cow",
          "pig", "ram", "hen", "eel")
_TXT = ("a.txt", "b.txt", "c.txt", "x.txt", "y.txt", "in.txt", "log.txt", "data.txt", "list.txt",
        "notes.txt", "words.txt", "items.txt")
_CSV = ("a.csv", "b.csv", "f.csv", "t.csv", "data.csv", "pets.csv", "rows.csv", "zoo.csv")


def _op_render(op: tuple, first: bool, fname: str) -> str:
    name, *a = op
    cmd = {
        "wc-l": "wc -l", "wc-w": "wc -w", "wc-c": "wc -c", "sort": "sort", "sort-r": "sort -r",
        "sort-n": "sort -n", "sort-rn": "sort -rn", "sort-u": "sort -u",
    }.get(name)
    if cmd is None:
        cmd = {"wc-l-arg": lambda: "wc -l", "sed": lambda: f"sed -n {a[0]}p",
               "head": lambda: f"head -n {a[0]}", "tail": lambda: f"tail -n {a[0]}",
               "grep": lambda: f"grep {a[0]}", "grep-c": lambda: f"grep -c {a[0]}",
               "grep-v": lambda: f"grep -v {a[0]}", "cut": lambda: f"cut -d, -f{a[0]}",
               "sum": lambda: f"awk -F, '{{s+=${a[0]}}}END{{print s}}'"}[name]()
    if not first:
        return cmd
    return f"{cmd} < {fname}" if name in ("wc-l", "wc-w", "wc-c") else f"{cmd} {fname}"


def _op_apply(op: tuple, lines: list[str], fname: str) -> list[str]:
    name, *a = op
    if name == "wc-l":
        return [str(len(lines))]
    if name == "wc-l-arg":
        return [f"{len(lines)} {fname}"]
    if name == "wc-w":
        return [str(sum(len(ln.split()) for ln in lines))]
    if name == "wc-c":
        return [str(sum(len(ln.encode()) + 1 for ln in lines))]
    if name == "sed":
        return lines[a[0] - 1:a[0]]
    if name == "head":
        return lines[:a[0]]
    if name == "tail":
        return lines[-a[0]:]
    if name == "sort":
        return sorted(lines)
    if name == "sort-r":
        return sorted(lines, reverse=True)
    if name == "sort-n":
        return sorted(lines, key=lambda s: (int(s), s))
    if name == "sort-rn":
        return sorted(lines, key=lambda s: (int(s), s), reverse=True)
    if name == "sort-u":
        return sorted(set(lines))
    if name == "grep":
        return [ln for ln in lines if a[0] in ln]
    if name == "grep-v":
        return [ln for ln in lines if a[0] not in ln]
    if name == "grep-c":
        return [str(sum(a[0] in ln for ln in lines))]
    if name == "cut":
        return [ln.split(",")[a[0] - 1] if a[0] <= ln.count(",") + 1 else "" for ln in lines]
    if name == "sum":
        return [str(sum(int(ln.split(",")[a[0] - 1]) for ln in lines))] if lines else [""]
    raise ValueError(name)


def _pipeline(ops: list[tuple], fname: str) -> str:
    return " | ".join(_op_render(op, i == 0, fname) for i, op in enumerate(ops)) + " > out.txt"


def _run_pipeline(ops: list[tuple], content: str, fname: str) -> list[str]:
    lines = content.split("\n")[:-1]
    for op in ops:
        lines = _op_apply(op, lines, fname)
    lines = [ln.rstrip() for ln in lines]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def _words_file(rng: random.Random, must: str | None = None, dups: bool = False) -> str:
    n = rng.randint(4, 9)
    pool = [w for w in _WORDS if w != must]
    lines = [" ".join(rng.choice(pool) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    if must is not None:  # `must` appears in some but not all lines
        for i in rng.sample(range(n), rng.randint(1, n - 1)):
            ws = lines[i].split()
            ws[rng.randrange(len(ws))] = must
            lines[i] = " ".join(ws)
    if dups:
        lines[rng.randrange(n)] = lines[rng.randrange(n)]
    return "\n".join(lines) + "\n"


def _nums_file(rng: random.Random) -> str:
    vals = rng.sample(range(0, 150), rng.randint(4, 8))
    return "\n".join(map(str, vals)) + "\n"


def _csv_file(rng: random.Random, must: str | None = None) -> str:
    n = rng.randint(4, 7)
    pool = [w for w in _WORDS if w != must]
    names = [rng.choice(pool) for _ in range(n)]
    if must is not None:
        for i in rng.sample(range(n), rng.randint(1, n - 1)):
            names[i] = must
    rows = [f"{w},{rng.randint(0, 120)},{rng.randint(0, 120)}" for w in names]
    return "\n".join(rows) + "\n"


def _lines(k: int) -> str:
    return "line" if k == 1 else f"{k} lines"


# Each template draws (visible params, file name, content maker, prompt, ops, wrong op lists).
def _tt_count(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r), f"Write the number of lines in {f} to out.txt",
            [("wc-l",)], [[("wc-w",)], [("wc-l-arg",)], [("wc-c",)]])


def _tt_line(rng):
    f, n = rng.choice(_TXT), rng.randint(1, 9)
    return ((n,), f, lambda r: _words_file(r), f"Write line {n} of {f} to out.txt",
            [("sed", n)], [[("sed", n + 1)], [("sed", n - 1)], [("head", n)]])


def _tt_head(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 4)
    return ((k,), f, lambda r: _words_file(r), f"Write the first {_lines(k)} of {f} to out.txt",
            [("head", k)], [[("head", k + 1)], [("tail", k)], [("head", k - 1)]])


def _tt_tail(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 4)
    return ((k,), f, lambda r: _words_file(r), f"Write the last {_lines(k)} of {f} to out.txt",
            [("tail", k)], [[("tail", k + 1)], [("head", k)], [("tail", k - 1)]])


def _tt_sort(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r), f"Write {f} sorted to out.txt",
            [("sort",)], [[("sort-r",)], [("sort-u",)], [("head", 8)]])


def _tt_sort_n(rng):
    f = rng.choice(_TXT)
    return ((), f, _nums_file, f"Write {f} sorted numerically to out.txt",
            [("sort-n",)], [[("sort",)], [("sort-rn",)]])


def _tt_sort_rn(rng):
    f = rng.choice(_TXT)
    return ((), f, _nums_file, f"Write {f} sorted numerically, largest first, to out.txt",
            [("sort-rn",)], [[("sort-n",)], [("sort-r",)]])


def _tt_grep_c(rng):
    f, w = rng.choice(_TXT), rng.choice(_WORDS)
    w2 = rng.choice([x for x in _WORDS if x != w])
    return ((w,), f, lambda r: _words_file(r, must=w),
            f"Write how many lines of {f} contain {w} to out.txt",
            [("grep-c", w)], [[("grep-c", w2)], [("wc-l",)], [("grep", w)]])


def _tt_grep(rng):
    f, w = rng.choice(_TXT), rng.choice(_WORDS)
    w2 = rng.choice([x for x in _WORDS if x != w])
    return ((w,), f, lambda r: _words_file(r, must=w),
            f"Write the lines of {f} containing {w} to out.txt",
            [("grep", w)], [[("grep-v", w)], [("grep", w2)], [("grep-c", w)]])


def _tt_cut(rng):
    f, k = rng.choice(_CSV), rng.randint(1, 3)
    return ((k,), f, lambda r: _csv_file(r), f"Write column {k} of {f} to out.txt",
            [("cut", k)], [[("cut", k % 3 + 1)], [("cut", (k + 1) % 3 + 1)]])


def _tt_grep_cut(rng):
    f, k, w = rng.choice(_CSV), rng.randint(2, 3), rng.choice(_WORDS)
    return ((k, w), f, lambda r: _csv_file(r, must=w),
            f"Write column {k} of the {f} rows with {w} to out.txt",
            [("grep", w), ("cut", k)],
            [[("grep", w), ("cut", 5 - k)], [("cut", k)], [("grep-v", w), ("cut", k)]])


def _tt_cut_sort(rng):
    f, k = rng.choice(_CSV), rng.randint(2, 3)
    return ((k,), f, lambda r: _csv_file(r),
            f"Write column {k} of {f} sorted numerically to out.txt",
            [("cut", k), ("sort-n",)],
            [[("cut", k), ("sort",)], [("cut", 5 - k), ("sort-n",)], [("cut", k), ("sort-rn",)]])


def _tt_distinct(rng):
    f = rng.choice(_TXT)
    return ((), f, lambda r: _words_file(r, dups=True),
            f"Write the number of distinct lines in {f} to out.txt",
            [("sort-u",), ("wc-l",)], [[("wc-l",)], [("sort-u",), ("wc-w",)]])


def _tt_sum(rng):
    f, k = rng.choice(_CSV), rng.randint(2, 3)
    return ((k,), f, lambda r: _csv_file(r), f"Write the sum of column {k} of {f} to out.txt",
            [("sum", k)], [[("sum", 5 - k)], [("cut", k)]])


def _tt_smallest(rng):
    f, k = rng.choice(_TXT), rng.randint(1, 3)
    return ((k,), f, _nums_file, f"Write the {k} smallest number{'s' if k > 1 else ''} of {f} to out.txt",
            [("sort-n",), ("head", k)],
            [[("sort",), ("head", k)], [("sort-n",), ("tail", k)], [("head", k)]])


_TERM_TEMPLATES: dict[int, list[Callable]] = {
    1: [_tt_count, _tt_line, _tt_head, _tt_tail],
    2: [_tt_sort, _tt_sort_n, _tt_sort_rn, _tt_grep_c, _tt_grep, _tt_cut],
    3: [_tt_grep_cut, _tt_cut_sort, _tt_distinct, _tt_sum, _tt_smallest],
}

def lines_check(path: str, want: list[str]) -> str:
    """A python check: exit 0 iff the file at `path` holds the lines `want`, compared after the
    stdio rule (CRLF -> LF, trailing whitespace and trailing empty lines dropped)."""
    return _LINES_CHECK.format(path=path, want=want)


_LINES_CHECK = '''import sys
WANT = {want!r}
try:
    with open({path!r}, encoding="utf-8", errors="replace") as f:
        got = f.read()
except OSError:
    sys.exit(1)
lines = [ln.rstrip() for ln in got.replace("\\r\\n", "\\n").split("\\n")]
while lines and lines[-1] == "":
    lines.pop()
sys.exit(0 if lines == WANT else 1)
'''


class TerminalGenerator(Generator):
    name = "terminal"

    def _draw(self, rng, difficulty):
        tt = rng.choice(_TERM_TEMPLATES[difficulty])
        visible, fname, make, prompt, ops, _wrong = tt(rng)
        content = make(rng)
        want = _run_pipeline(ops, content, fname)
        if not want or want == [""]:
            return None
        demo = _pipeline(ops, fname)
        name = tt.__name__[4:]
        key = (name, fname, list(visible))
        task = self._task(difficulty, name, key, content, prompt, demo,
                          {"ops": [list(o) for o in ops], "file": fname,
                           "wrong": [[list(o) for o in w] for w in _wrong]},
                          family="terminal", files={fname: content},
                          check=lines_check("out.txt", want), check_language="python")
        return task, demo

    def corrupt(self, rng, task, demo):
        p = task.meta["params"]
        fname = p["file"]
        content = task.files[fname]
        want = _run_pipeline([tuple(o) for o in p["ops"]], content, fname)
        wrong = [[tuple(o) for o in w] for w in p["wrong"]]
        rng.shuffle(wrong)
        for ops in wrong:
            if any(o[0] in ("sed", "head", "tail") and o[1] < 1 for o in ops):
                continue
            c = _pipeline(ops, fname)
            if _run_pipeline(ops, content, fname) != want and len(c.encode()) <= MAX_COMPLETION_BYTES:
                return c
        return f"wc -c < {fname} > out.txt" if want != _run_pipeline([("wc-c",)], content, fname) \
            else f"head -n 0 {fname} > out.txt"


# ============================================================================================
# registry, splits, mixtures, SFT examples

FAMILIES: dict[str, Generator] = {
    "arithmetic": ArithmeticGenerator(),
    "code": CodeGenerator(),
    "terminal": TerminalGenerator(),
}


def make_split(family: str, split: str, n: int, seed: int,
               difficulty: int | None = None) -> list[tuple[Task, str]]:
    """n distinct tasks of `family` in `split` (deterministic; see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {sorted(FAMILIES)})")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} or None")
    gen = FAMILIES[family]
    rng = random.Random(f"generators|{family}|{split}|{seed}|{difficulty}")
    out: list[tuple[Task, str]] = []
    seen: set[str] = set()
    budget = 500 * n + 5000
    while len(out) < n:
        d = difficulty if difficulty is not None else DIFFICULTIES[len(out) % len(DIFFICULTIES)]
        for _ in range(budget):
            task, demo = gen.sample(rng, d)
            if task.meta["split"] == split and task.id not in seen:
                break
        else:
            raise ValueError(f"{family}/{split}/difficulty {d}: fewer than {n} distinct tasks found")
        seen.add(task.id)
        out.append((task, demo))
    return out


def make_mixture(families: Iterable[str], split: str, n_per_family: int,
                 seed: int) -> list[tuple[Task, str]]:
    """n_per_family tasks of each family, interleaved round-robin."""
    per = [make_split(f, split, n_per_family, seed) for f in families]
    return [p[i] for i in range(n_per_family) for p in per]


def _corrupt_gsm8k(rng: random.Random, task: Task, demo: str) -> str:
    try:
        v = int(task.answer)
        wrong = str(v + rng.choice([-1, 1]) * rng.choice([1, 1, 2, 10]))
    except ValueError:
        wrong = task.answer + "1"
    return re.sub(r"\\boxed\{[^{}]*\}(?!.*\\boxed)", lambda m: "\\boxed{" + wrong + "}", demo,
                  flags=re.S) if "\\boxed{" in demo else demo + f"\nThe answer is \\boxed{{{wrong}}}."


def corrupt(rng: random.Random, task: Task, demo: str) -> str:
    """A well-formed wrong completion for any task made here (or loaded by load_gsm8k)."""
    fam = task.meta.get("family_name")
    if fam == "gsm8k":
        return _corrupt_gsm8k(rng, task, demo)
    if fam not in FAMILIES:
        raise ValueError(f"task {task.id}: no generator for family_name {fam!r}")
    return FAMILIES[fam].corrupt(rng, task, demo)


def sft_examples(pairs: Sequence[tuple[Task, str]], imperfect_frac: float,
                 seed: int) -> list[tuple[str, str, bool]]:
    """(prompt, completion, is_correct) in the order of `pairs`; within each family exactly
    round(imperfect_frac * count) completions are corrupted (chosen with `seed`)."""
    if not 0.0 <= imperfect_frac <= 1.0:
        raise ValueError("imperfect_frac must be in [0, 1]")
    rng = random.Random(f"sft|{seed}")
    by_fam: dict[str, list[int]] = {}
    for i, (t, _) in enumerate(pairs):
        by_fam.setdefault(t.meta.get("family_name", t.family), []).append(i)
    bad: set[int] = set()
    for fam in sorted(by_fam):
        idx = by_fam[fam]
        bad.update(rng.sample(idx, round(imperfect_frac * len(idx))))
    out = []
    for i, (t, demo) in enumerate(pairs):
        if i in bad:
            out.append((t.prompt, corrupt(rng, t, demo), False))
        else:
            out.append((t.prompt, demo, True))
    return out


# ============================================================================================
# files


def write_jsonl(items: Iterable[Task | tuple[Task, str]], path: str | os.PathLike) -> None:
    """Tasks, or (task, demo) pairs (the demo is stored in meta["demo"]), via save_tasks."""
    tasks = []
    for it in items:
        if isinstance(it, Task):
            tasks.append(it)
        else:
            t, demo = it
            tasks.append(dataclasses.replace(t, meta={**t.meta, "demo": demo}))
    save_tasks(tasks, path)


def read_jsonl(path: str | os.PathLike) -> list[tuple[Task, str]]:
    """(task, meta["demo"]) pairs from a file written by write_jsonl."""
    return [(t, t.meta.get("demo", "")) for t in load_tasks(path)]


_CALC_RE = re.compile(r"<<[^<>]*>>")


def load_gsm8k(path: str | os.PathLike, *, split: str | None = None,
               limit: int | None = None) -> list[Task]:
    """GSM8K-format JSONL (`question`, `answer` = reasoning + "#### 42") as math-family tasks.

    answer: the text after the last "####", thousands separators removed. meta: source "gsm8k",
    family_name "gsm8k", split (if given), solution (the original reasoning), demo (the reasoning
    without <<...>> calculator notes, then "The answer is \\boxed{42}.")."""
    out = []
    for lineno, obj in iter_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        q, a = obj.get("question"), obj.get("answer")
        if not isinstance(q, str) or not isinstance(a, str) or "####" not in a:
            raise TaskFormatError(f"{path}:{lineno}: GSM8K record needs question and answer "
                                  "with '#### <final answer>'")
        reasoning, final = a.rsplit("####", 1)
        final = final.strip().replace(",", "")
        if not final:
            raise TaskFormatError(f"{path}:{lineno}: empty final answer")
        demo = _CALC_RE.sub("", reasoning).strip() + f"\nThe answer is \\boxed{{{final}}}."
        meta = {"source": "gsm8k", "family_name": "gsm8k", "solution": reasoning.strip(),
                "demo": demo, "line": lineno}
        if split is not None:
            meta["split"] = split
        tid = f"gsm8k/{split + '/' if split else ''}{len(out)}"
        out.append(Task(id=tid, family="math", prompt=q, answer=final, meta=meta))
    return out
