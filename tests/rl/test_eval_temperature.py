"""Best-temperature evaluation (rl/pipeline.py: temperature_sweep, best_temperatures,
evaluate_at_temperatures; scripts/demo.py compares checkpoints this way): the choice rule, and
sweeps and per-domain temperatures through a real rollout worker, model and sandbox. A random
tiny model answers; a task passes when its answer holds a digit (judged in the sandbox)."""

import dataclasses

import jax
import pytest

from configs import models
from model.config import ModelConfig
from model.tokenizer import ByteTokenizer
from model.transformer import Model
from rl.pipeline import (
    RolloutWorker,
    best_temperatures,
    evaluate,
    evaluate_at_best_temperatures,
    evaluate_at_temperatures,
    temperature_sweep,
    template_breakdown,
)
from rl.sampler import SamplingConfig
from sandbox import SandboxPool
from sandbox.tasks.schema import Task
from sandbox.verifiers import Verifier

DIGIT_CHECK = "import re, sys\nsys.exit(0 if re.search('[0-9]', open('answer.txt').read()) else 1)\n"


def _res(**per_domain):
    return {d: {"tasks": 8, **v} for d, v in per_domain.items()} | {"_sandbox_failed": 0}


def test_best_temperature_rule():
    sweep = {0.0: _res(a={"pass@1": 0.50}, b={"pass@1": 0.2}),
             0.5: _res(a={"pass@1": 0.50, "pass@4": 0.7}, b={"pass@1": 0.3, "pass@4": 0.6}),
             1.0: _res(a={"pass@1": 0.25, "pass@4": 0.9}, b={"pass@1": 0.1, "pass@4": 0.6})}
    # the highest value per domain, ties to the lower temperature
    assert best_temperatures(sweep) == {"a": 0.0, "b": 0.5}
    # pass@k is measured at the sampled temperatures only (greedy has one sample per task)
    assert best_temperatures(sweep, "pass@4") == {"a": 1.0, "b": 0.5}
    with pytest.raises(ValueError, match="no temperature of the sweep measured pass@8 on a"):
        best_temperatures(sweep, "pass@8")


@pytest.fixture(scope="module")
def digit_eval():
    model = Model(ModelConfig.from_dict(models.get_config("test")))
    variables = model.init(jax.random.key(0))
    tasks = [Task(id=f"{dom}{i}", family="answer_check", prompt=f"{dom} {i}: say a digit",
                  check=DIGIT_CHECK, check_language="python", timeout_s=5,
                  meta={"domain": dom})  # the domain evaluate() groups by
             for dom in ("left", "right") for i in range(4)]
    with SandboxPool(workers=2) as pool:
        base = SamplingConfig(max_new_tokens=6, temperature=0.0)
        workers = {}

        def worker_at(t):
            workers.setdefault(t, RolloutWorker(
                model, ByteTokenizer(), dataclasses.replace(base, temperature=t),
                Verifier(executor=pool), group_size=1, max_prompt_len=32))
            return workers[t]

        yield variables, tasks, worker_at


def test_sweep_and_per_domain_temperatures(digit_eval):
    variables, tasks, worker_at = digit_eval
    sweep = temperature_sweep(worker_at, variables, tasks, jax.random.key(1),
                              temperatures=(0.0, 2.0), n_samples=4, ks=(1, 4), batch_prompts=8)
    assert list(sweep) == [0.0, 2.0]
    for d in ("left", "right"):
        assert "pass@4" not in sweep[0.0][d] and "pass@4" in sweep[2.0][d]
        assert sweep[2.0][d]["pass@4"] >= sweep[2.0][d]["pass@1"]
    # each domain at its own temperature: the greedy one equals a greedy evaluation of its
    # tasks alone (and every pass@k is its pass@1); the sampled one has 4 samples per task
    res = evaluate_at_temperatures(worker_at, variables, tasks, jax.random.key(2),
                                   temperature_of={"left": 0.0, "right": 2.0}, n_samples=4,
                                   ks=(1, 4), batch_prompts=8)
    greedy = evaluate(worker_at(0.0), variables, tasks[:4], jax.random.key(9), batch_prompts=8)
    assert res["left"]["pass@1"] == greedy["left"]["pass@1"]
    assert res["left"]["pass@4"] == res["left"]["pass@1"]
    assert (res["left"]["temperature"], res["left"]["samples"]) == (0.0, 1)
    assert (res["right"]["temperature"], res["right"]["samples"]) == (2.0, 4)
    assert res["right"]["pass@4_lo"] <= res["right"]["pass@4"] <= res["right"]["pass@4_hi"]
    with pytest.raises(ValueError, match=r"no temperature for domain\(s\) \['right'\]"):
        evaluate_at_temperatures(worker_at, variables, tasks, jax.random.key(2),
                                 temperature_of={"left": 0.0}, n_samples=4, batch_prompts=8)


def test_evaluate_at_best_temperatures(digit_eval):
    variables, tasks, worker_at = digit_eval
    val, test = tasks[::2], tasks[1::2]
    res = evaluate_at_best_temperatures(worker_at, variables, val, test, jax.random.key(3),
                                        temperatures=(0.0, 2.0), n_samples=4, ks=(1, 4),
                                        batch_prompts=8)
    sweep = res["val_sweep"]
    for m in ("pass@1", "pass@4"):  # each domain measured on test at its best val temperature
        best = best_temperatures(sweep, m)
        assert {d: v["temperature"] for d, v in res[m].items() if isinstance(v, dict)} == best
        assert all(v["tasks"] == 2 for v in res[m].values() if isinstance(v, dict))
    assert set(best_temperatures(sweep, "pass@4").values()) == {2.0}  # greedy has no pass@4
    # kept samples: the test evaluations' records, each evaluation once, each record at its
    # domain's temperature for the metrics it serves; the results are the same without them
    kept = evaluate_at_best_temperatures(worker_at, variables, val, test, jax.random.key(3),
                                         temperatures=(0.0, 2.0), n_samples=4, ks=(1, 4),
                                         batch_prompts=8, keep_samples=True)
    recs = kept.pop("_samples")
    assert {r["task_id"] for r in recs} == {t.id for t in test}
    for r in recs:
        for m in r["metrics"]:
            assert r["temperature"] == kept[m][r["domain"]]["temperature"]
    for m in ("pass@1", "pass@4"):
        for d in ("left", "right"):
            mine = [r for r in recs if m in r["metrics"] and r["domain"] == d]
            assert len(mine) == 2 * kept[m][d]["samples"]
            assert sum(r["reward"] >= 1 for r in mine) / len(mine) == kept[m][d]["pass@1"]
    drop = lambda r: {d: {k: x for k, x in v.items() if k != "seconds"} if isinstance(v, dict)
                      else v for d, v in r.items()}
    assert {m: drop(kept[m]) for m in ("pass@1", "pass@4")} == {
        m: drop(res[m]) for m in ("pass@1", "pass@4")}


def test_sampled_evaluation_does_not_depend_on_its_chunking(digit_eval):
    """evaluate draws every row from one key by its task's index and sample (row ids), so the
    same evaluation in chunks of 8, 3 (the last one padded) or 1 task generates the same
    completions for every task and sample, and reports the same numbers."""
    variables, tasks, worker_at = digit_eval
    worker = worker_at(2.0)
    seen = {}  # batch_prompts -> {(task id, sample): text}
    generate = worker.generate

    def recording_generate(variables, chunk, rng, group_size=None, pad_to=None, row_ids=None):
        g = generate(variables, chunk, rng, group_size, pad_to, row_ids)
        for k, (t, text) in enumerate(zip(g.tasks, g.texts)):
            seen[current].setdefault((t.id, k % 4), text)
        return g

    worker.generate = recording_generate
    try:
        results = {}
        for current in (8, 3, 1):
            seen[current] = {}
            results[current] = evaluate(worker, variables, tasks, jax.random.key(5),
                                        n_samples=4, ks=(1, 4), batch_prompts=current)
    finally:
        del worker.generate
    assert len(seen[8]) == len(tasks) * 4 and len(set(seen[8].values())) > 8
    assert seen[3] == seen[8] and seen[1] == seen[8]
    drop = lambda r: {d: x for d, x in r.items() if d != "_seconds"}
    assert drop(results[3]) == drop(results[8]) == drop(results[1])


def test_per_template_breakdown(digit_eval):
    """evaluate splits each domain's tasks by generator template (meta["template"]): a template
    whose check can never pass reads 0 of its tasks solved whatever the model writes, and the
    templates' tasks and pass@1 add up to the domain's; tasks without a template are "(none)"."""
    variables, tasks, worker_at = digit_eval
    never = "import sys\nsys.exit(1)\n"
    tpl = [dataclasses.replace(t, meta={**t.meta, "template": "digit"}) for t in tasks[:4]]
    tpl += [dataclasses.replace(t, id=t.id + "n", check=never, meta={**t.meta, "template": "never"})
            for t in tasks[:3]]
    res = evaluate(worker_at(2.0), variables, tpl + tasks[4:], jax.random.key(4), n_samples=4,
                   batch_prompts=8)
    by = res["left"]["by_template"]
    assert list(by) == ["digit", "never"]
    assert by["never"] == {"tasks": 3, "pass@1": 0.0, "solved": 0}
    assert by["digit"]["tasks"] == 4 and 0 <= by["digit"]["solved"] <= 4
    assert by["digit"]["pass@1"] * 4 == pytest.approx(res["left"]["pass@1"] * 7)
    assert "by_template" not in res["right"]  # no task of the domain has a template
    assert template_breakdown({None: [0, 2], "a": [4]}, 4) == {
        "a": {"tasks": 1, "pass@1": 1.0, "solved": 1},
        "(none)": {"tasks": 2, "pass@1": 0.25, "solved": 1}}


def test_kept_samples_are_the_scored_texts(digit_eval):
    """keep_samples: one record per task and sample in task order, whose reward is what the
    sandbox check gives its text (a digit in the answer passes); the aggregate is unchanged."""
    import re

    variables, tasks, worker_at = digit_eval
    res = evaluate(worker_at(2.0), variables, tasks, jax.random.key(6), n_samples=3,
                   batch_prompts=8, keep_samples=True)
    plain = evaluate(worker_at(2.0), variables, tasks, jax.random.key(6), n_samples=3,
                     batch_prompts=8)
    recs = res.pop("_samples")
    assert [(r["task_id"], r["sample"]) for r in recs] == [(t.id, k) for t in tasks
                                                          for k in range(3)]
    assert {r["domain"] for r in recs} == {"left", "right"}
    assert all((r["reward"] >= 1) == bool(re.search("[0-9]", r["text"])) for r in recs)
    assert 0 < sum(r["reward"] >= 1 for r in recs) < len(recs)  # both outcomes occur
    drop = lambda r: {d: x for d, x in r.items() if d != "_seconds"}
    assert drop(res) == drop(plain)
