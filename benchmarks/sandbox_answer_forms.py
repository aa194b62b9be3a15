"""Correct answers in the forms a model writes them must all score 1 (no false negatives):

    python -m benchmarks.sandbox_answer_forms [--workers 2] [--quick]

  humaneval  the 164 HumanEval canonical solutions (quick: 40) through the python_tests verifier
             in three forms: the bare body (the prompt continued), the whole function restated in
             a fenced block (signature and docstring from the prompt, helpers not repeated), and
             that block followed by a usage block calling the function and an output block
  generated  every demonstration of the generated one-shot families (arithmetic, code, terminal;
             200 train + 50 test tasks each: 750; quick: 90) as written, and fenced

Prints one JSON object: passed/total per form, the ids that failed (at most 10) and the wall time.
Exit status 1 when any correct answer scored below 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def fenced_function(task) -> str:
    """The canonical solution as the whole entry-point function in a ```python block."""
    head = task.prompt[task.prompt.index(f"def {task.entry_point}("):]
    return f"Here is the function:\n```python\n{head}{task.canonical_solution}```\n"


def usage_block(task) -> str:
    """A usage block calling the function on the test's first arguments, and an output block."""
    from sandbox import plaindata
    from sandbox.python_tests import static_calls

    calls = static_calls(task.test, task.entry_point) or []
    call = task.entry_point
    if calls:
        args, kwargs = plaindata.decode_call(calls[0])
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        call = f"{task.entry_point}({', '.join(parts)})"
    return f"\nExample:\n```python\nprint({call})\n```\nOutput:\n```\n(the result)\n```\n"


def _score(verifier, tasks, comps) -> dict:
    t0 = time.perf_counter()
    res = verifier.verify_batch(tasks, comps)
    return {"passed": int(sum(s for s, _ in res)), "total": len(tasks),
            "failed": [t.id for t, (s, _) in zip(tasks, res) if s != 1.0][:10],
            "s": round(time.perf_counter() - t0, 1)}


def run(workers: int = 2, quick: bool = False) -> dict:
    import sandbox.tasks
    from sandbox import SandboxPool
    from sandbox.tasks.domains import DOMAINS
    from sandbox.tasks.loaders import load_humaneval
    from sandbox.tasks.sampling import make_split
    from sandbox.verifiers import Verifier

    he = load_humaneval(os.path.join(os.path.dirname(sandbox.tasks.__file__), "data", "HumanEval.jsonl.gz"))
    if quick:
        he = he[:40]
    out: dict = {"humaneval": {}, "generated": {}}
    with SandboxPool(workers=workers) as pool:
        v = Verifier(pool)
        forms = {"bare_body": lambda t: t.canonical_solution, "fenced_function": fenced_function,
                 "fenced_with_usage": lambda t: fenced_function(t) + usage_block(t)}
        for name, make in forms.items():
            out["humaneval"][name] = _score(v, he, [make(t) for t in he])
        n = 30 if quick else 200
        for fam in sorted(f for f, d in DOMAINS.items() if d.generated and not d.multi_turn):
            pairs = make_split(fam, "train", n, seed=0) + make_split(fam, "test", n // 4, seed=0)
            tasks = [p[0] for p in pairs]
            out["generated"][fam] = _score(v, tasks, [p[1] for p in pairs])
            lang = "bash" if fam == "terminal" else ("python" if fam == "code" else "")
            if lang:
                out["generated"][fam + "_fenced"] = _score(
                    v, tasks, [f"```{lang}\n{p[1]}\n```\n" for p in pairs])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    out = run(a.workers, a.quick)
    print(json.dumps(out, indent=1))
    allpass = all(r["passed"] == r["total"] for g in out.values() for r in g.values())
    return 0 if allpass else 1


if __name__ == "__main__":
    sys.exit(main())
