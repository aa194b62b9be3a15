"""The repository's text describes the software as it is: no work-log history in it.

Every tracked text file (README, docs, tests/README, code comments and docstrings, configs,
notebooks) is searched for the marks of a work log: a work session named by its ordinal (from
the second on) or its number or range of numbers, an issue's number, and benchmark runs named by
number (PATTERNS; the test below gives examples of each). Measurements belong in the dated entries of docs/results.md and
docs/speed.md (a date and a commit each). "session" alone stays: it names a sandbox session.

Not covered: history written in other words (a reviewer's eye, not a pattern, catches those).
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ORDINALS = ("second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
             "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
             "nineteenth|twentieth|thirtieth|fortieth|(?:twenty|thirty|forty)-[a-z]+")
# what follows a session or run number used as a name (punctuation, a parenthesis, the line's
# end, or a preposition), not a count ("runs 3 commands", "sessions 8 per worker")
_AFTER = r"(?=[,;:)']|\.(?!\d)|\s+\(|\s*$|\s+(?:on|at|in|and|of|to)\b)"
PATTERNS = {
    "a work session by ordinal": re.compile(rf"\b(?:{_ORDINALS})[ -]sessions?\b", re.I),
    "work sessions by number": re.compile(r"\bsessions? \d+(?:\s*[-–]\s*\d+)?" + _AFTER, re.I | re.M),
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.I),
    "a numbered run": re.compile(r"(?<![-\w])(?:peer |benchmark )?runs? #?\d+(?:\s*[-–]\s*\d+)?"
                                 + _AFTER, re.I | re.M),
}
_BINARY = (".gz", ".png", ".jpg", ".safetensors", ".npz", ".npy", ".bin", ".model")


def tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [f for f in out.stdout.decode().split("\0") if f]
    return [f for f in files if not f.endswith(_BINARY)
            and os.path.isfile(os.path.join(ROOT, f))]


def history_marks(text: str) -> list[tuple[str, str]]:
    """(what, the matched text) for each mark of a work log in `text`."""
    return [(what, m.group(0)) for what, pat in PATTERNS.items() for m in pat.finditer(text)]


def test_the_patterns_find_history_and_leave_the_software_alone():
    # the examples are assembled, so that this file does not read as history to a text search
    s, i, r = " session", "iss" + "ue", "ru" + "n"
    found = history_marks(f"measured in the thirty-seventh{s} on the host of{s}s 22-36; "
                          f"{i} 19's target; peer {r} 30 (4.7 min), {r}s 22-29, and {r} 5.")
    assert [w for w, _ in found] == ["a work session by ordinal", "work sessions by number",
                                     "an issue number", "a numbered run", "a numbered run",
                                     "a numbered run"], found
    assert history_marks(f"a sandbox{s} {r}s 3 commands; the first{s} of an episode; {r} 2 "
                         f"processes; --{r}s 3000; they {r} 24.0 episodes per second; `--{r} 2` "
                         f"profiles;{s}s 8 per worker") == []


def test_no_work_log_history_in_the_repository_text():
    files = tracked_text_files()
    assert "README.md" in files and len(files) > 100
    bad = []
    for rel in files:
        try:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(lines, 1):
            bad += [f"{rel}:{i}: {what}: {hit!r}" for what, hit in history_marks(line)]
    assert not bad, ("work-log history in the repository's text (move measurements to a dated "
                     "entry under docs/, keep the reasoning):\n" + "\n".join(bad[:60]))
