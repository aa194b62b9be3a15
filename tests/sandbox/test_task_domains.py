"""Task domains (sandbox/tasks/domains) and scoring methods (sandbox/verifiers.py) are two
registries: a domain is added with one file and one registry entry, a scoring method with one
function and one registration; tasks a domain draws are the same bytes for the same seeds;
a task that skips its method's field check is refused, never scored."""

import hashlib
import json
import random

import pytest

from sandbox.tasks import sft
from sandbox.tasks.domains import DOMAINS, generated_domains, get_domain, is_multi_turn
from sandbox.tasks.domains.base import Domain, draw_split
from sandbox.tasks.sampling import make_mixture, make_split
from sandbox.tasks.schema import Task, TaskFormatError
from sandbox.tasks.splits import split_of, task_hash
from sandbox.verifiers import (
    Pending,
    Verifier,
    _done,
    check_task,
    register_scoring,
    scoring_methods,
)

# sha256[:16] of [[task.to_dict(), demo], ...] for make_split(domain, "val", 6, seed=0), taken
# from the code before the domains were split into files: a change here changes every dataset.
# multistep re-pinned when its tasks got decoy files (multistep.DECOYS) and a wider count range:
# what the model sees (prompts, demonstration turns, splits) is pinned apart and did not change.
# arithmetic re-pinned when level 1 drew its operator first (arithmetic._two_numbers), and
# PINNED_SFT with it (its mixture holds level-1 arithmetic); terminal when its count templates'
# files got 4-40 lines (terminal._COUNT_LINES).
PINNED = {"arithmetic": "5e88246f1a349e9e", "code": "3f5a1b35c07eb9c2",
          "terminal": "4df38d3059cbeda8", "multistep": "7c5db6f64472e33a"}
PINNED_MULTISTEP_SEEN = "6fce16d96f18ba8c"  # [[prompt, demo_turns, split], ...] of the same tasks
PINNED_SFT = "a1212f7489f5558b"  # sft_examples(make_mixture(one-shot, "train", 4, 1), 0.5, 2)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _pinned_form(task) -> dict:
    """task.to_dict() with the domain under the meta key it had when the digests were pinned."""
    d = task.to_dict()
    d["meta"] = {("family_name" if k == "domain" else k): v for k, v in d["meta"].items()}
    return d


def test_generated_tasks_are_the_same_bytes_as_before():
    assert generated_domains() == sorted(PINNED)
    got = {f: _digest([[_pinned_form(t), d] for t, d in make_split(f, "val", 6, 0)])
           for f in PINNED}
    assert got == PINNED
    seen = [[t.prompt, t.meta["demo_turns"], t.meta["split"]]
            for t, _ in make_split("multistep", "val", 6, 0)]
    assert _digest(seen) == PINNED_MULTISTEP_SEEN
    one_shot = [f for f in generated_domains() if not is_multi_turn(f)]
    mix = make_mixture(one_shot, "train", 4, 1)
    rows = sft.sft_examples(mix, 0.5, 2)
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == PINNED_SFT


def test_every_domain_names_its_tasks_and_a_registered_scoring_method():
    methods = set(scoring_methods())
    assert {"python_tests", "stdio", "math", "terminal", "answer_check"} <= methods
    for name in generated_domains():
        for task, demo in make_split(name, "test", 3, seed=5):
            assert task.meta["domain"] == name and task.family in methods
            check_task(task)
            wrong = sft.corrupt(random.Random(0), task, demo)
            assert wrong != demo and type(wrong) is type(demo)
    assert is_multi_turn("multistep") and not is_multi_turn("code") and not is_multi_turn(None)
    with pytest.raises(ValueError, match="unknown task domain 'nope'.*arithmetic"):
        get_domain("nope")
    with pytest.raises(ValueError, match="loads its tasks"):
        make_split("gsm8k", "train", 1, 0)  # a loaded domain: corrupt only


class _SumDomain(Domain):
    """A toy domain in a few lines: "a+b" as a stdio program (what a new domain file holds)."""
    name = "toy_sum"

    def sample(self, rng, difficulty):
        a, b = rng.randint(0, 9 * difficulty), rng.randint(0, 9)
        key = [a, b]
        task = Task(id=f"toy_sum/{task_hash('toy_sum', key)[:12]}", family="stdio",
                    prompt=f"print {a}+{b}", cases=[{"input": "", "output": f"{a + b}\n"}],
                    meta={"split": split_of("toy_sum", key), "domain": self.name,
                          "difficulty": difficulty})
        return task, f"print({a}+{b})"

    def corrupt(self, rng, task, demo):
        return demo.replace("+", "-") + "+1"


def test_a_new_domain_is_one_class_and_one_registry_entry(monkeypatch, pool):
    monkeypatch.setitem(DOMAINS, "toy_sum", _SumDomain())
    assert "toy_sum" in generated_domains()
    pairs = make_split("toy_sum", "train", 4, seed=0)
    assert pairs == make_split("toy_sum", "train", 4, seed=0)
    assert all(t.meta["split"] == "train" for t, _ in pairs)
    rows = sft.sft_examples(pairs, 0.5, seed=0)
    assert sum(not ok for _, _, ok in rows) == 2
    v = Verifier(pool)
    scores = v.verify_batch([t for t, _ in pairs] * 2, [d for _, d in pairs] + [
        sft.corrupt(random.Random(1), t, d) for t, d in pairs])
    assert [s for s, _ in scores] == [1.0] * 4 + [0.0] * 4


def _start_exact(task, completion, ctx):
    ok = completion.strip() == task.answer
    return _done(float(ok), {"family": "toy_exact", "score": float(ok),
                             "status": "pass" if ok else "fail", "cases": [], "wall_s": 0.0})


def _check_exact(task):
    if not task.answer:
        raise TaskFormatError(f"task {task.id}: toy_exact needs 'answer'")


def test_a_new_scoring_method_is_one_function_and_one_registration(monkeypatch):
    import sandbox.verifiers as verifiers
    monkeypatch.setattr(verifiers, "_METHODS", dict(verifiers._METHODS))
    register_scoring("toy_exact", _start_exact, _check_exact)
    assert "toy_exact" in scoring_methods()
    v = Verifier(executor=object(), math=object())  # toy_exact runs nothing
    assert v.verify({"id": "x", "family": "toy_exact", "answer": "42"}, " 42\n")[0] == 1.0
    assert v.verify(Task(id="x", family="toy_exact", answer="42"), "41")[0] == 0.0
    assert isinstance(v.submit(Task(id="x", family="toy_exact", answer="1"), "1"), Pending)
    with pytest.raises(TaskFormatError, match="toy_exact needs 'answer'"):
        v.verify({"id": "y", "family": "toy_exact"}, "")


@pytest.mark.parametrize("task,msg", [
    (Task(id="t", family="terminal"), "terminal needs 'check'"),                # empty check = exit 0
    (Task(id="s", family="stdio"), "stdio needs cases"),                        # no case = all pass
    (Task(id="p", family="python_tests"), "python_tests needs 'test'"),
    (Task(id="m", family="math"), "math needs 'answer'"),
    (Task(id="n", family="nope", answer="1"), "unknown family 'nope'"),
])
def test_a_task_built_in_code_without_its_fields_is_refused_not_scored(task, msg):
    # Task() checks only the common fields; a task built (or mutated) in code without what its
    # scoring method needs would otherwise pass vacuously (an empty check script exits 0)
    v = Verifier(executor=object(), math=object())
    with pytest.raises(TaskFormatError, match=msg):
        v.submit(task, "true")
    with pytest.raises(TaskFormatError, match=msg):
        check_task(task)


def test_the_record_checks_its_common_fields():
    with pytest.raises(TaskFormatError, match="id"):
        Task(id="", family="math", answer="1")
    with pytest.raises(TaskFormatError, match="family must name a scoring method"):
        Task(id="x", family="")
    with pytest.raises(TaskFormatError, match="scoring"):
        Task(id="x", family="math", answer="1", scoring="best")


def test_draw_split_rejects_bad_arguments():
    d = get_domain("arithmetic")
    with pytest.raises(ValueError, match="split"):
        draw_split(d, "dev", 1, 0)
    with pytest.raises(ValueError, match="difficulty"):
        draw_split(d, "train", 1, 0, difficulty=4)
