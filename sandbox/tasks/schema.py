"""The task record shared by all families, and its JSONL form.

One JSON object per line. Common fields:

  id           str, unique within a file (required)
  family       "python_tests" | "stdio" | "math" | "terminal" (required)
  prompt       str, what the model sees (default "")
  timeout_s    float, wall-clock limit per sandbox run (default 10)
  memory_mb    int, memory limit per sandbox run (default 512)
  scoring      "all" (1.0 only if every case passes, the default) | "fraction" (share of cases)
  meta         object, anything else (source, difficulty, split, ...), carried through untouched

Per family:

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
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("python_tests", "stdio", "math", "terminal")


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
    # terminal
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    setup: str = ""
    check: str = ""
    check_language: str = "bash"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        f = self.family
        if not isinstance(self.id, str) or not self.id:
            raise TaskFormatError("task id must be a non-empty string")
        if f not in FAMILIES:
            from ..verifiers import registered_families

            if f not in registered_families():
                raise TaskFormatError(f"task {self.id}: unknown family {f!r} (known: {FAMILIES})")
        if self.scoring not in ("all", "fraction"):
            raise TaskFormatError(f"task {self.id}: scoring must be 'all' or 'fraction'")
        if f == "python_tests":
            if not self.test:
                raise TaskFormatError(f"task {self.id}: python_tests needs 'test'")
            if "def check" in self.test and not self.entry_point:
                raise TaskFormatError(f"task {self.id}: python_tests with check() needs 'entry_point'")
        elif f == "stdio":
            if not self.cases or not all(isinstance(c, dict) and "input" in c and "output" in c
                                         for c in self.cases):
                raise TaskFormatError(f"task {self.id}: stdio needs cases [{{input, output}}, ...]")
            if self.compare not in ("lines", "tokens"):
                raise TaskFormatError(f"task {self.id}: compare must be 'lines' or 'tokens'")
            if self.language not in ("python", "bash"):
                raise TaskFormatError(f"task {self.id}: language must be python or bash")
        elif f == "math":
            if not str(self.answer).strip():
                raise TaskFormatError(f"task {self.id}: math needs 'answer'")
        elif f == "terminal":
            if not self.check:
                raise TaskFormatError(f"task {self.id}: terminal needs 'check'")
            if self.check_language not in ("bash", "python"):
                raise TaskFormatError(f"task {self.id}: check_language must be bash or python")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TaskFormatError(f"task {d.get('id')!r}: unknown fields {unknown} "
                                  "(put extra data under 'meta')")
        kw = dict(d)
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
