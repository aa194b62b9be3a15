"""The task record shared by all domains and scoring methods, and its JSONL form.

One JSON object per line. Common fields (checked when a Task is built):

  id           str, unique within a file (required)
  family       str, the scoring method that judges the task (required): one registered in
               sandbox/verifiers.py, the one list of them ("python_tests", "stdio", "math",
               "terminal", "answer_check"). Which domain made a task is meta["domain"] (task
               files that name it meta["family_name"] load with it renamed).
  prompt       str, what the model sees (default "")
  timeout_s    float, wall-clock limit per sandbox run (default 10)
  memory_mb    int, memory limit per sandbox run (default 512)
  scoring      "all" (1.0 only if every case passes, the default) | "fraction" (share of cases)
  meta         object, anything else (source, difficulty, split, ...), carried through untouched

Fields per scoring method (the method checks them: sandbox.verifiers.check_task, called by every
loader and by Verifier.submit, raises TaskFormatError naming what is missing):

  python_tests   HumanEval/MBPP-style unit tests. The solution is prompt + completion (or the code
                 block of the completion); it runs in one sandbox on the test's arguments only,
                 and `test` runs in another against a replay of its results (plain data), with
                 the prompt's own definitions (sandbox/python_tests.py).
      test         str: Python defining `check(candidate)` (HumanEval), or plain top-level asserts
                   (MBPP style, which call the function by name). It may use the entry point,
                   the prompt's definitions and the standard library, and must pass plain data
                   (None, bool, int, float, complex, str, bytes, list, tuple, dict, set) to it.
      entry_point  str: the function under test (required when `test` defines check)
      canonical_solution  str, optional: a reference completion (tests use it)
  stdio          competitive-programming style: the program reads stdin, writes stdout.
      cases        [{"input": str, "output": str}, ...] (required, at least one)
      compare      "lines" (default) | "tokens"; see sandbox.verifiers.normalize_output
      float_tol    float, optional: with compare="tokens", numeric tokens may differ by this
                   (absolute or relative)
      language     "python" (default) | "bash": the language of the completion
  math           a final answer checked with math-verify.
      answer       str: the gold answer ("1/2", "\\frac{1}{2}", "\\boxed{x^2}", ...)
  terminal       shell tasks: files are set up, the model's commands run, a check script decides.
      files        {relative path: content} placed in the working directory first
      setup        str, optional: bash run before the model's commands (in its own sandbox)
      check        str: script run after the model's commands, in a fresh sandbox over the same
                   working directory, isolated (python -I, bash --norc with PATH=/usr/bin:/bin,
                   its own text on no path); exit code 0 means solved (required). Expected
                   outputs belong here, never in `files` (the model's commands can read those).
      check_language  "bash" (default) | "python"
  answer_check   the raw completion is written to answer.txt next to `files` and `check`
                 (`check_language`) judges it; exit 0 = solved.

This module knows no scoring method (so it imports nothing of sandbox/verifiers.py): a Task
built in code with an unknown method or missing fields is refused when it is loaded or verified.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class TaskFormatError(ValueError):
    pass


@dataclasses.dataclass
class Task:
    id: str
    family: str
    prompt: str = ""
    timeout_s: float = 10.0
    memory_mb: int = 512
    scoring: str = "all"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    # python_tests
    test: str = ""
    entry_point: str = ""
    canonical_solution: str = ""
    # stdio
    cases: list[dict[str, str]] = dataclasses.field(default_factory=list)
    compare: str = "lines"
    float_tol: float | None = None
    language: str = "python"
    # math
    answer: str = ""
    # terminal, answer_check
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    setup: str = ""
    check: str = ""
    check_language: str = "bash"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """The common fields; a scoring method's own fields: sandbox.verifiers.check_task."""
        if not isinstance(self.id, str) or not self.id:
            raise TaskFormatError("task id must be a non-empty string")
        if not isinstance(self.family, str) or not self.family:
            raise TaskFormatError(f"task {self.id}: family must name a scoring method "
                                  "(sandbox.verifiers.scoring_methods())")
        if self.scoring not in ("all", "fraction"):
            raise TaskFormatError(f"task {self.id}: scoring must be 'all' or 'fraction'")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TaskFormatError(f"task {d.get('id')!r}: unknown fields {unknown} "
                                  "(put extra data under 'meta')")
        kw = dict(d)
        meta = kw.get("meta")
        if isinstance(meta, dict) and "family_name" in meta and "domain" not in meta:
            meta = dict(meta)  # the key task files written before the rename carry
            meta["domain"] = meta.pop("family_name")
            kw["meta"] = meta
        if "id" in kw:
            kw["id"] = str(kw["id"])
        if "answer" in kw:
            kw["answer"] = str(kw["answer"])
        try:
            return cls(**kw)
        except TypeError as e:
            raise TaskFormatError(f"task {d.get('id')!r}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that differ from the defaults (compact JSONL)."""
        out: dict[str, Any] = {"id": self.id, "family": self.family}
        for f in dataclasses.fields(self):
            if f.name in out:
                continue
            v = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if v != default:
                out[f.name] = v
        return out
