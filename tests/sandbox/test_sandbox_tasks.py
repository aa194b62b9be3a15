"""Task files: the JSONL format of every family, HumanEval and MBPP loaders."""

import gzip
import json
import os

import pytest

from sandbox.tasks import (
    Task,
    TaskFormatError,
    load_humaneval,
    load_mbpp,
    load_tasks,
    mbpp_task,
    save_tasks,
)

DATA = os.path.join(os.path.dirname(__file__), "data", "humaneval_sample.jsonl.gz")


def test_humaneval_loader():
    tasks = load_humaneval(DATA)
    assert len(tasks) == 6 and tasks[0].id == "HumanEval/0"
    t = tasks[0]
    assert t.family == "python_tests" and t.entry_point == "has_close_elements"
    assert "def check(candidate)" in t.test and t.canonical_solution.startswith("    for idx")
    assert t.meta["source"] == "humaneval"


def test_jsonl_roundtrip_all_families(tmp_path):
    tasks = [
        Task(id="p", family="python_tests", prompt="def f():\n", test="def check(c):\n    assert c() == 1\n", entry_point="f"),
        Task(id="s", family="stdio", cases=[{"input": "1\n", "output": "1\n"}], compare="tokens", float_tol=1e-6),
        Task(id="m", family="math", prompt="1+1?", answer="2", meta={"split": "train"}),
        Task(id="t", family="terminal", files={"a.txt": "x"}, setup="true", check="test -f a.txt", timeout_s=5),
    ]
    for suffix in (".jsonl", ".jsonl.gz"):
        path = tmp_path / ("tasks" + suffix)
        save_tasks(tasks, path)
        assert load_tasks(path) == tasks
    line = json.loads((tmp_path / "tasks.jsonl").read_text().splitlines()[2])
    assert line == {"id": "m", "family": "math", "prompt": "1+1?", "meta": {"split": "train"}, "answer": "2"}


@pytest.mark.parametrize("obj,msg", [
    ({"id": "x", "family": "nope"}, "unknown family"),
    ({"id": "x", "family": "math"}, "answer"),
    ({"id": "x", "family": "stdio", "cases": [{"input": "1"}]}, "cases"),
    ({"id": "x", "family": "python_tests", "test": "def check(c): pass"}, "entry_point"),
    ({"id": "x", "family": "terminal"}, "check"),
    ({"id": "x", "family": "math", "answer": "1", "colour": "red"}, "unknown fields"),
    ({"id": "x", "family": "math", "answer": "1", "scoring": "best"}, "scoring"),
])
def test_invalid_tasks_are_rejected_with_line_numbers(tmp_path, obj, msg):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "ok", "family": "math", "answer": "1"}) + "\n\n" + json.dumps(obj) + "\n")
    with pytest.raises(TaskFormatError, match=msg) as ei:
        load_tasks(path)
    assert "bad.jsonl:3" in str(ei.value)


def test_duplicate_ids_and_bad_json(tmp_path):
    p = tmp_path / "dup.jsonl"
    p.write_text('{"id": "a", "family": "math", "answer": "1"}\n{"id": "a", "family": "math", "answer": "2"}\n')
    with pytest.raises(TaskFormatError, match="duplicate"):
        load_tasks(p)
    p.write_text("{not json\n")
    with pytest.raises(TaskFormatError, match="invalid JSON"):
        load_tasks(p)


def test_mbpp_loader(tmp_path):
    rec = {"task_id": 2, "text": "Write a function to find the shared elements.",
           "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
           "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))"],
           "test_setup_code": "", "challenge_test_list": []}
    p = tmp_path / "mbpp.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(rec) + "\n")
    (t,) = load_mbpp(p)
    assert t.id == "mbpp/2" and t.entry_point == "similar_elements" and t.meta["prompt_is_text"]
    assert "Your code should pass these tests" in t.prompt
    assert mbpp_task(rec).test.startswith("assert set(similar_elements")
