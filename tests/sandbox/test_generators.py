"""Procedural task families (sandbox/tasks/domains/, drawn by sandbox/tasks/sampling.py):
demonstrations pass in the sandbox, corruptions fail, splits are disjoint and deterministic, byte
limits hold, difficulty matters."""

import ast
import json
import random
from collections import Counter

import pytest

from sandbox import Task
from sandbox.mathverify import MathVerifier
from sandbox.tasks.domains import DOMAINS, get_domain
from sandbox.tasks.domains.arithmetic import countdown_ok
from sandbox.tasks.domains.base import MAX_COMPLETION_BYTES, MAX_PROMPT_BYTES
from sandbox.tasks.domains.gsm8k import load_gsm8k
from sandbox.tasks.loaders import read_jsonl, write_jsonl
from sandbox.tasks.sampling import make_mixture, make_split
from sandbox.tasks.schema import TaskFormatError
from sandbox.tasks.sft import corrupt, sft_examples
from sandbox.tasks.splits import split_of
from sandbox.verifiers import Verifier

# the generated one-shot domains (multistep is multi-turn; gsm8k is loaded from a file)
FAMS = sorted(n for n, d in DOMAINS.items() if d.generated and not d.multi_turn)


@pytest.fixture(scope="module")
def verifier(pool):
    return Verifier(pool)


def _fits(prompt, completion):
    return len(prompt.encode()) <= MAX_PROMPT_BYTES and len(completion.encode()) <= MAX_COMPLETION_BYTES


@pytest.mark.parametrize("family", FAMS)
def test_demos_pass_and_corruptions_fail_in_sandbox(verifier, family):
    # 4 tasks per difficulty from train and 2 per difficulty from test
    pairs = [p for d in (1, 2, 3) for p in make_split(family, "train", 4, seed=7, difficulty=d)]
    pairs += [p for d in (1, 2, 3) for p in make_split(family, "test", 2, seed=7, difficulty=d)]
    rng = random.Random(0)
    wrongs = [get_domain(family).corrupt(rng, t, demo) for t, demo in pairs]
    pend = [(verifier.submit(t, demo), verifier.submit(t, w)) for (t, demo), w in zip(pairs, wrongs)]
    for (t, demo), w, (pd, pw) in zip(pairs, wrongs, pend):
        s_demo, d_demo = pd.result()
        s_wrong, d_wrong = pw.result()
        assert s_demo == 1.0, (t.prompt, demo, d_demo)
        assert s_wrong == 0.0 and d_wrong["status"] == "fail", (t.prompt, w, d_wrong)
        assert w != demo and _fits(t.prompt, w)
        if family == "arithmetic":
            ast.parse(w, mode="eval")  # well-formed: an expression
        elif family == "code":
            assert w.startswith("def f(") and ast.parse(w)
        else:
            assert w.endswith(" > out.txt")


def test_arithmetic_checks_numbers_operators_and_target(verifier):
    task, demo = get_domain("arithmetic").build([7, 3, 5], 22, "3*5+7")
    assert task.prompt == "Make 22 from 3 5 7 using + - * and parentheses"
    assert task.meta["difficulty"] == 2 and task.meta["split"] in ("train", "val", "test")
    with pytest.raises(ValueError):
        get_domain("arithmetic").build([3, 5, 7], 22, "4*5+2")
    good = ["3*5+7", "7+5*3", "(3*5)+7", " 3 * 5 + 7\n"]
    bad = ["22", "4*5+2",            # reaches 22 with other numbers
           "3*5+7+0", "3*5+7*1",     # an extra number
           "3*5*7", "3+5+7",         # wrong value
           "3*(5+7)", "21+1",
           "3**2+13", "15+7", "int(22)", "__import__('os').system('true') or 22",
           "3*5+7.0", "-3*5+37", "", "3*5+7\n3*5+7", "3*5+7 = 22"]
    for c in good + bad:  # the offline checker agrees with the sandbox below
        assert countdown_ok(c, [3, 5, 7], 22) == (c in good), c
    pend = [verifier.submit(task, c) for c in good + bad]
    scores = [p.result()[0] for p in pend]
    assert scores == [1.0] * len(good) + [0.0] * len(bad), list(zip(good + bad, scores))


def test_no_constant_arithmetic_rule_is_paid_often():
    """Level 1 (two numbers, the demo's arithmetic): adding, subtracting the smaller or
    multiplying without reading the target each solve at most 40% of the test and train tasks
    (one op is right for about a third; before the operator was drawn first, adding solved 58.5%
    of the test split), while every demonstration solves its task."""
    for split, n in (("test", 200), ("train", 1500)):
        tasks = make_split("arithmetic", split, n, 1234, difficulty=1)
        wins = Counter()
        for t, demo in tasks:
            nums, target = t.meta["params"]["numbers"], t.meta["params"]["target"]
            assert countdown_ok(demo, nums, target)
            a, b = nums
            for rule, text in (("add", f"{a}+{b}"), ("multiply", f"{a}*{b}"),
                               ("subtract", f"{max(a, b)}-{min(a, b)}")):
                wins[rule] += countdown_ok(text, nums, target)
        rates = {r: w / n for r, w in wins.items()}
        assert max(rates.values()) <= 0.40 and min(rates.values()) >= 0.2, (split, rates)


def test_no_constant_terminal_count_is_paid_often():
    """One-shot terminal tasks whose answer is a count (wc -l, grep -c, distinct lines): the
    most common answer of each template is right on at most 12% of its tasks (it was 21-24%
    when their files had 4-9 lines)."""
    from sandbox.tasks.domains import terminal

    answers, n = {}, Counter()
    for t, _ in make_split("terminal", "train", 1500, 1234):
        p, name = t.meta["params"], t.meta["template"]
        if name in ("count", "grep_c", "distinct"):
            n[name] += 1
            want = terminal._run_pipeline([tuple(o) for o in p["ops"]], t.files[p["file"]],
                                          p["file"])
            answers.setdefault(name, Counter())[tuple(want)] += 1
    assert set(n) == {"count", "grep_c", "distinct"} and min(n.values()) >= 60, n
    for name, c in answers.items():
        assert c.most_common(1)[0][1] / n[name] <= 0.12, (name, c.most_common(3), n[name])


def test_terminal_check_reads_the_produced_file(verifier):
    t, demo = make_split("terminal", "train", 1, seed=5, difficulty=1)[0]
    no_file = demo.removesuffix(" > out.txt")  # right output, but on stdout
    s1, _ = verifier.verify(t, no_file)
    s2, _ = verifier.verify(t, f"```bash\n{demo}\n```")
    assert (s1, s2) == (0.0, 1.0)


def test_splits_disjoint_deterministic_and_within_limits():
    for fam in FAMS:
        made = {(split, seed): make_split(fam, split, n, seed)
                for split, n in (("train", 240), ("val", 45), ("test", 45)) for seed in (0, 1)}
        for (split, _seed), pairs in made.items():
            assert len({t.id for t, _ in pairs}) == len(pairs)
            for t, demo in pairs:
                assert t.meta["split"] == split and t.meta["domain"] == fam
                assert t.meta["demo"] == demo and t.id.startswith(f"{fam}/{split}/")
                assert _fits(t.prompt, demo), (t.prompt, demo)
        prompts = {s: {t.prompt for seed in (0, 1) for t, _ in made[(s, seed)]}
                   for s in ("train", "val", "test")}
        assert not prompts["train"] & prompts["test"], fam
        assert not prompts["train"] & prompts["val"], fam
        assert not prompts["val"] & prompts["test"], fam
        # deterministic for a seed, different for another
        again = make_split(fam, "test", 45, 0)
        assert [(t.to_dict(), d) for t, d in again] == [(t.to_dict(), d) for t, d in made[("test", 0)]]
        assert [t.id for t, _ in made[("test", 1)]] != [t.id for t, _ in made[("test", 0)]]
        # difficulty None cycles the levels
        assert [t.meta["difficulty"] for t, _ in made[("val", 0)][:6]] == [1, 2, 3, 1, 2, 3]
    assert split_of("code", ["x"]) == split_of("code", ["x"])
    with pytest.raises(ValueError):
        make_split("arithmetic", "dev", 3, 0)
    with pytest.raises(ValueError):
        make_split("nope", "train", 3, 0)


def test_difficulty_changes_the_task():
    for fam in FAMS:
        by_d = {d: make_split(fam, "train", 40, seed=2, difficulty=d) for d in (1, 2, 3)}
        for d, pairs in by_d.items():
            assert all(t.meta["difficulty"] == d and t.id.startswith(f"{fam}/train/d{d}/")
                       for t, _ in pairs)
        templates = {d: {t.meta["template"] for t, _ in pairs} for d, pairs in by_d.items()}
        assert not templates[1] & templates[2] and not templates[2] & templates[3], templates
        if fam == "arithmetic":
            for d, pairs in by_d.items():
                assert all(len(t.meta["params"]["numbers"]) == d + 1 for t, _ in pairs)
                assert all(countdown_ok(demo, t.meta["params"]["numbers"], t.meta["params"]["target"])
                           for t, demo in pairs)
        mean_len = {d: sum(len(demo) for _, demo in pairs) / len(pairs) for d, pairs in by_d.items()}
        assert mean_len[1] < mean_len[3], (fam, mean_len)


def test_mixture_is_balanced_and_sft_fraction_is_exact():
    mix = make_mixture(FAMS, "train", 20, seed=4)
    assert len(mix) == 60
    assert [t.meta["domain"] for t, _ in mix[:6]] == FAMS * 2
    ex = sft_examples(mix, imperfect_frac=0.4, seed=9)
    assert ex == sft_examples(mix, imperfect_frac=0.4, seed=9)
    assert len(ex) == len(mix)
    for fam in FAMS:
        rows = [(e, p) for e, p in zip(ex, mix) if p[0].meta["domain"] == fam]
        assert sum(not ok for (_, _, ok), _ in rows) == 8
    for (prompt, completion, ok), (t, demo) in zip(ex, mix):
        assert prompt == t.prompt and (completion == demo) == ok
        assert _fits(prompt, completion)
    assert all(ok for _, _, ok in sft_examples(mix, 0.0, 1))
    assert not any(ok for _, _, ok in sft_examples(mix, 1.0, 1))


def test_jsonl_round_trip(tmp_path):
    mix = make_mixture(FAMS, "val", 3, seed=1)
    path = tmp_path / "tasks.jsonl"
    write_jsonl(mix, path)
    back = read_jsonl(path)
    assert [(t.to_dict(), d) for t, d in back] == [(t.to_dict(), d) for t, d in mix]
    assert {t.family for t, _ in back} == {"answer_check", "python_tests", "terminal"}
    write_jsonl([t for t, _ in mix], tmp_path / "t.jsonl.gz")
    assert [t.id for t, _ in read_jsonl(tmp_path / "t.jsonl.gz")] == [t.id for t, _ in mix]


def test_gsm8k_loader_scores_with_math_verify(tmp_path, pool):
    recs = [
        {"question": "Tom has 3 bags of 4 apples. He eats 2. How many are left?",
         "answer": "He had 3*4=<<3*4=12>>12 apples.\n12-2=<<12-2=10>>10\n#### 10"},
        {"question": "A car costs $1,200 and a bike $300. What do both cost?",
         "answer": "1200+300=<<1200+300=1500>>1500\n#### 1,500"},
    ]
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tasks = load_gsm8k(path, split="test")
    assert [t.answer for t in tasks] == ["10", "1500"]
    assert all(t.family == "math" and t.meta["split"] == "test" for t in tasks)
    assert "<<" not in tasks[0].meta["demo"] and tasks[0].meta["demo"].endswith("\\boxed{10}.")
    assert len(load_gsm8k(path, limit=1)) == 1
    rng = random.Random(0)
    wrong = [corrupt(rng, t, t.meta["demo"]) for t in tasks]
    with MathVerifier(workers=1) as mv:
        v = Verifier(pool, mv)
        assert [v.verify(t, t.meta["demo"])[0] for t in tasks] == [1.0, 1.0]
        assert [v.verify(t, w)[0] for t, w in zip(tasks, wrong)] == [0.0, 0.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    with pytest.raises(TaskFormatError):
        load_gsm8k(bad)


def test_tasks_validate_as_records():
    for fam in FAMS:
        t, _ = make_split(fam, "train", 1, seed=0)[0]
        assert Task.from_dict(json.loads(json.dumps(t.to_dict()))) == t
