"""The multi-turn agent scores an episode by its return, not by its last step (rl/agent.py,
rl/envs.py), on a real sandbox session (here beside the session pool fixture).

Covered: an episode whose first turn is a malformed tool call (format penalty 0.25) and whose
next turns solve the task: the env's step rewards are -0.25, 0, 0 and 1.0 (hand-worked: the
check passes on the last step, the penalty lands on the malformed one), and the agent's row,
collected and grouped by AgentRolloutWorker as after a sampled episode, scores their sum 0.75,
not the last step's 1.0.
Not covered: sampling the turns (tests/rl/test_agent.py plays them from a trained model).
"""

import pytest

from configs import models
from model.config import ModelConfig
from model.tokenizer import ByteTokenizer
from model.transformer import Model
from rl.agent import AgentRolloutWorker
from rl.envs import DONE_TEXT, EnvConfig, demo_turns
from rl.sampler import SamplingConfig
from sandbox.tasks.domains import multistep

PENALTY = 0.25


def test_agent_scores_the_episode_return_not_the_last_step(pool):
    task = multistep.make_split("train", 3, seed=7, difficulty=1)[0]
    actions = ['<tool_call>{"name": "bash", "arguments": {"command": }</tool_call>']  # bad JSON
    actions += [a for a, _ in demo_turns(task)[:-1]] + [DONE_TEXT]
    tok = ByteTokenizer()
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.d_model = 1, "K", 32
    c.moe.num_experts, c.moe.dense_dim, c.mtp.depth = 0, 32, 0
    c.max_seq_len = 1024
    model = Model(ModelConfig.from_dict(c))  # never run: the turns below are given, not sampled
    worker = AgentRolloutWorker(
        model, tok, SamplingConfig(max_new_tokens=64, temperature=0.7, eos_id=tok.eos_id), pool,
        group_size=1, width=1024, env_config=EnvConfig(max_turns=5, format_penalty=PENALTY))
    (row,) = worker._open([task])
    step_rewards = []
    try:
        for a in actions:  # each turn goes through the worker's own collection of its result
            row.pending = row.env.submit_step(a)
            res = row.pending.result(timeout=60)
            step_rewards.append(res.reward)
            worker._collect([row], wait=True)
    finally:
        if not row.done:
            row.env.close()
    assert row.done and res.terminated and res.info["status"] == "pass", res.info
    assert step_rewards == pytest.approx([-PENALTY, 0.0, 0.0, 1.0])  # hand-worked
    g = worker._group([row], 1, 1, 0.0, 0.0)
    assert float(g.rewards[0]) == pytest.approx(sum(step_rewards))  # 0.75, not the last 1.0
    assert not g.failed[0] and g.details[0]["malformed_turns"] == 1
