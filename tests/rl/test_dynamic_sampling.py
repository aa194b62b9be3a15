"""DAPO's dynamic sampling with refill (rl.oversample; rl/pipeline.py: informative_groups,
concat_groups, select_groups; train/rl.py:_Launcher).

Covered: which groups a selection keeps (rewards that differ first, drawn order, failed rows
never count as informative, the batch's shape kept when too few are informative), that every
kept row carries its own prompt, completion, log-probs, reward and task, and a real run_rl with
rl.oversample=2 on sandbox-scored tasks (two rollout calls per update, the trained batch of the
usual size, the fractions logged). Not covered: whether it raises held-out pass rates (docs/results.md).
"""

import json
from unittest import mock

import jax
import numpy as np
import pytest

import train.launch
import train.rl
from configs import rl as rl_configs
from rl.pipeline import ScoredGroup, concat_groups, informative_groups, select_groups
from sandbox.tasks.loaders import save_tasks
from sandbox.tasks.schema import Task
from train.run_config import RunConfig


def _scored(rewards, failed=(), group_size=2, tag=""):
    """A ScoredGroup whose row i holds values derived from i (to check rows stay aligned)."""
    n = len(rewards)
    i = np.arange(n)
    fail = np.zeros(n, bool)
    fail[list(failed)] = True
    return ScoredGroup(
        tasks=[f"{tag}task{k // group_size}" for k in range(n)],
        group_ids=i // group_size, prompts=np.stack([i, i + 100], 1),
        prompt_lengths=i + 1, completions=np.stack([i, -i, 2 * i], 1),
        completion_mask=np.ones((n, 3), bool), sampler_logp=-(i[:, None] + np.zeros(3)),
        texts=[f"{tag}text{k}" for k in range(n)], rewards=np.asarray(rewards, np.float32),
        failed=fail, details=[{"row": f"{tag}{k}"} for k in range(n)], gen_s=1.0)


def test_informative_groups_need_differing_rewards_and_no_failure():
    g = _scored([1, 1, 0, 1, 0, 0, 1, 0, 0.5, 0.5], failed=[7])
    # groups: [1,1] same; [0,1] differ; [0,0] same; [1,0] differ but row 7 failed; [.5,.5] same
    assert informative_groups(g).tolist() == [False, True, False, False, False]


def test_select_keeps_informative_groups_first_in_drawn_order_with_their_rows():
    g = _scored([1, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 0])  # groups 1, 3, 4 informative
    out = select_groups(g, 2)
    assert out.tasks == ["task1", "task1", "task3", "task3"]
    assert out.group_ids.tolist() == [0, 0, 1, 1]
    rows = [2, 3, 6, 7]
    assert out.prompts[:, 0].tolist() == rows and out.completions[:, 2].tolist() == [
        2 * r for r in rows]
    assert out.sampler_logp[:, 0].tolist() == [-r for r in rows]
    assert out.rewards.tolist() == [0, 1, 1, 0] and out.texts == [f"text{r}" for r in rows]
    assert [d["row"] for d in out.details] == [str(r) for r in rows]
    assert out.prompt_lengths.tolist() == [r + 1 for r in rows]
    assert out.selection == {"groups_drawn": 6.0, "informative_frac": 0.5,
                             "kept_informative_frac": 1.0,
                             "drawn_reward_mean": pytest.approx(5 / 12)}


def test_select_fills_with_the_first_uninformative_groups_keeping_the_shape():
    g = _scored([1, 1, 0, 0, 1, 0, 1, 1])  # only group 2 informative
    out = select_groups(g, 3)
    assert out.tasks[::2] == ["task0", "task1", "task2"]  # 2 kept, then 0 and 1 (drawn order)
    assert out.rewards.shape == (6,) and out.selection["kept_informative_frac"] == pytest.approx(
        1 / 3)
    with pytest.raises(ValueError, match="5 groups asked for, 4 scored"):
        select_groups(g, 5)


def test_concat_offsets_group_ids_and_pads_to_the_widest():
    a, b = _scored([1, 0, 1, 1], tag="a"), _scored([0, 0, 0, 1], tag="b")
    c = concat_groups([a, b])
    assert c.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert c.texts[4:] == b.texts and c.gen_s == 2.0
    assert informative_groups(c).tolist() == [True, False, False, True]
    kept = select_groups(c, 2)
    assert kept.tasks == ["atask0", "atask0", "btask1", "btask1"]
    wide = _scored([1, 0], tag="w")  # multi-turn batches: each as wide as its longest row
    wide.completions, wide.completion_mask = np.full((2, 5), 7), np.ones((2, 5), bool)
    wide.sampler_logp, wide.prompts = np.full((2, 5), -1.0), np.full((2, 4), 9)
    d = concat_groups([a, wide])
    assert d.completions.shape == (6, 5) and d.prompts.shape == (6, 4)
    assert (d.completions[:4, 3:] == 0).all() and not d.completion_mask[:4, 3:].any()
    assert (d.completions[4:] == 7).all() and (d.prompts[:4, 2:] == 0).all()
    np.testing.assert_array_equal(d.completions[:4, :3], a.completions)


def test_oversample_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True, "2"):
        d = rl_configs.get_config("smoke").to_dict()
        d["rl"]["oversample"] = bad
        with pytest.raises(ValueError, match="rl.oversample must be an int >= 1"):
            RunConfig.from_config(d)
    c = rl_configs.get_config("smoke")
    c.rl.oversample = 0
    with pytest.raises(ValueError, match="rl.oversample must be an int >= 1"):
        train.launch.validate_run_config(c)
    c.rl.oversample = 3
    assert "3 batches' prompts drawn per update" in train.launch.validate_run_config(c)


# Reward 1 when the (byte-level) answer contains a digit: a random policy's groups are mixed.
DIGIT_CHECK = "import re, sys\nsys.exit(0 if re.search('[0-9]', open('answer.txt').read()) else 1)\n"


@pytest.mark.slow
def test_run_rl_with_oversample_trains_one_batch_of_the_drawn_groups(tmp_path):
    c = rl_configs.get_config("smoke")
    c.workdir = str(tmp_path)
    c.rl.update(dict(steps=2, init_from="scratch", overlap_scoring=False, checkpoint_every=2,
                     oversample=2, prompts_per_batch=2, group_size=2, max_new_tokens=8))
    c.tasks.update(dict(train_per_domain=4, val_per_domain=1, test_per_domain=1,
                        task_file=str(tmp_path / "tasks.jsonl")))
    c.model.update(dict(num_layers=1, layer_pattern="K"))
    c.model.moe.num_experts, c.model.mtp.depth = 0, 0
    c.optim.update(dict(warmup_steps=1))
    c.eval.every = 0
    c.sandbox.workers = 1
    save_tasks([Task(id=f"digit{i}", family="answer_check", prompt="say a digit",
                     check=DIGIT_CHECK, check_language="python", timeout_s=5) for i in range(8)],
               c.tasks.task_file)
    compiled, ahead = [], []  # the programs XLA compiled; the states precompile_updates got

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    def precompile(tasks, rows, group_size, state, **kw):
        ahead.append(state)
        return precompile_updates(tasks, rows, group_size, state, **kw)

    precompile_updates = train.rl.precompile_updates
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with mock.patch.object(train.rl, "precompile_updates", precompile):
            state = train.rl.run_rl(c, progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert int(state.step) == 2
    # the update compiled from the state's shapes before the weights existed (the default
    # GRPO's forward has nothing to run), and the real updates found it compiled: once in all
    assert len(ahead) == 1 and all(isinstance(x, jax.ShapeDtypeStruct)
                                   for x in jax.tree.leaves(ahead[0]))
    assert compiled.count("jit(step)") == 1, sorted(compiled)
    lines = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in lines if "rl/reward_mean" in m]
    assert len(lines) == 2
    for m in lines:
        assert m["rl/groups_drawn"] == 4 and m["rl/rows_trained"] == 4  # 2 of 4 groups trained
        assert m["rl/kept_informative_frac"] == min(1.0, 2 * m["rl/informative_frac"])
