"""Arithmetic (Countdown): "Make 22 from 3 5 7 using + - * and parentheses" -> "3*5+7".

Scoring method `answer_check` (sandbox/verifiers.py): the completion is written to answer.txt and
a Python check in the sandbox parses it with `ast` (only integer literals, + - * and
parentheses), requires the multiset of literals to equal the given numbers (each used exactly
once) and the value to equal the target. Difficulty d uses d+1 numbers (2..4). Targets come from
a random expression over the numbers, so every task is solvable. With two numbers (level 1) the
operator is drawn first, a third each, and products go up to _PRODUCT_MAX (sums and differences
to 200): drawn as for more numbers, 58.5% of the level-1 test tasks were sums, so always adding
was paid more often than the demo's SFT model earned (47.5%); now each constant rule is paid on
about a third (_two_numbers).

Canonical key (the split, sandbox/tasks/splits.py): the sorted numbers and the target.
Corruptions: a wrong operator, a number off by one, swapped operands of a minus, or the
parentheses dropped, whichever makes the answer wrong (checked offline with `countdown_ok`).
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Sequence
from typing import Any

from ...pyparse import parse as parse_python
from ..schema import Task
from .base import MAX_COMPLETION_BYTES, OneShotDomain

# The checker runs inside the sandbox (scoring method answer_check); the same source is executed here
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
_PRODUCT_MAX = 999  # level 1 products (two numbers): distinct ones enough for a third of a split
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


def _two_numbers(rng: random.Random, lo: int, hi: int) -> Tree:
    """A two-number tree whose operator is drawn first (+, - or *, a third each), then numbers in
    [lo, hi] for which it gives a target in _ARITH_TARGET (a product: up to _PRODUCT_MAX).
    Drawing the numbers first and an operator at random (as for more numbers) kept the target
    in range mostly for +: 58.5% of the level-1 test tasks were solved by adding the two
    numbers, without reading the target, more than the demo's SFT checkpoint solved (47.5%). With products up to _PRODUCT_MAX (enough
    distinct ones for a third of a split; at 200 they were a sixth of the test split) each
    constant rule (add, subtract the smaller, multiply) solves 26-37% of the test and train
    splits (tests/sandbox/test_generators.py)."""
    op = rng.choice("+-*")
    while True:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        t = (op, max(a, b), min(a, b)) if op == "-" else (op, a, b)
        top = _PRODUCT_MAX if op == "*" else _ARITH_TARGET[1]
        if _ARITH_TARGET[0] <= _tree_value(t) <= top:
            return t


def _parse_tree(s: str) -> Tree | None:
    def conv(n):
        if isinstance(n, ast.BinOp) and type(n.op) in _AST_OPS:
            return (_AST_OPS[type(n.op)], conv(n.left), conv(n.right))
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        raise ValueError
    try:
        return conv(parse_python(s.strip(), mode="eval").body)
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


class ArithmeticDomain(OneShotDomain):
    name = "arithmetic"

    def _draw(self, rng, difficulty):
        count, lo, hi = _ARITH_RANGES[difficulty]
        if count == 2:  # the operator first, each a third of the tasks (_two_numbers)
            tree = _two_numbers(rng, lo, hi)
            nums = [tree[1], tree[2]]
        else:
            nums = [rng.randint(lo, hi) for _ in range(count)]
            tree = _random_tree(rng, nums)
        target = _tree_value(tree)
        if count != 2 and not _ARITH_TARGET[0] <= target <= _ARITH_TARGET[1]:
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


DOMAIN = ArithmeticDomain()
