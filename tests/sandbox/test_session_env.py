"""rl.envs.SessionEnv over real sandbox sessions: episodes solved and
failed as the check says; malformed calls, unknown tools, bad arguments, a hang, a 10 MB flood
and binary output each become an observation and the episode goes on; the caps on turns and
tokens end it cleanly (truncated, still checked); the format penalty; many envs stepped at once
through the pool; reward hacks against the session's check (the terminal hacks of
test_reward_hacks.py, plus session-only ones: a background writer, another session's directory)
score 0 next to the honest episode scoring 1.

These tests live here (not in tests/rl) to share the session pool fixture."""

import dataclasses
import importlib.util
import os
import time

import pytest

from rl.envs import (
    DONE_TEXT,
    EnvConfig,
    EnvError,
    SessionEnv,
    demo_turns,
    play,
    reset_batch,
    step_batch,
)
from rl.tools import format_tool_call
from sandbox.tasks.domains import multistep

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = multistep.make_split("train", 3, seed=7, difficulty=1)  # copy/count/find: 2 commands
# the same tasks with room for many turns (a task's meta["max_turns"] can lower the config's)
ROOMY = [dataclasses.replace(t, meta={**t.meta, "max_turns": 12}) for t in TASKS]


def bash(cmd: str) -> str:
    return format_tool_call("bash", {"command": cmd})


def demo_actions(task):
    return [a for a, _ in demo_turns(task)[:-1]]


@pytest.fixture(scope="module")
def env(pool):
    e = SessionEnv(ROOMY, executor=pool, config=EnvConfig(command_timeout_s=1.0,
                                                          observation_tokens=100))
    yield e
    e.close()


def test_demo_solves_and_a_wrong_answer_fails(env):
    steps = play(env, 0, demo_actions(TASKS[0]))
    assert [s.terminated for s in steps] == [False] * (len(steps) - 1) + [True]
    assert steps[-1].reward == 1.0 and steps[-1].info["status"] == "pass"
    assert [s.observation for s in steps[:-1]] == [o for _, o in demo_turns(TASKS[0])[:-1]]
    steps = play(env, 0, [bash(f"echo guess > {TASKS[0].meta['params']['target']}")])
    assert steps[-1].reward == 0.0 and steps[-1].info["status"] == "fail"
    assert env.session.closed  # closed at the episode's end
    with pytest.raises(EnvError, match="reset"):
        env.step(DONE_TEXT)


def test_bad_calls_hangs_floods_and_binary_are_observations(env):
    env.reset(1)
    cases = [
        ('<tool_call>{"name": "bash", "arguments": {"command": }</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>', "unknown tool 'python'"),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>', "only \"command\""),
        ("<tool_call>" + '{"name": "bash"', "unterminated"),
        (bash("sleep 100"), "timeout: wall-clock limit of 1s exceeded"),
        (bash("head -c 10000000 /dev/zero | tr '\\0' a"), "output limit"),
    ]
    for action, want in cases:
        t0 = time.monotonic()
        obs, reward, term, trunc, info = env.step(action)
        assert want in obs and not term and not trunc, (action, obs)
        assert time.monotonic() - t0 < 10
        assert len(obs.encode()) < 400, obs  # cut to observation_tokens plus the frame
    assert "[... " in obs and "more bytes]" in obs  # the flood, cut with a marker
    obs = env.step(bash("head -c 3000 /dev/urandom; printf 'x\\001y\\n' >&2")).observation
    assert "[binary output, " in obs and "x\\x01y" in obs, obs
    obs, *_ = env.step(bash("printf '<%s>' /tool_response tool_call /tool_call"))
    assert obs.count("</tool_response>") == 1 and "<tool_call>" not in obs  # no forged frame
    steps = play(env, None, [])  # and the env still runs episodes
    assert steps[-1].terminated


def test_caps_end_the_episode_and_it_is_still_checked(pool):
    task = TASKS[0]
    e = SessionEnv([task], executor=pool, config=EnvConfig(max_turns=2, format_penalty=0.1))
    try:
        steps = play(e, 0, ["<tool_call>oops</tool_call>"] + demo_actions(task))
        assert [s.truncated for s in steps] == [False, True]  # 2 turns: the second is the last
        assert steps[0].reward == pytest.approx(-0.1) and steps[-1].info["end"] == "turn cap"
        assert steps[-1].info["status"] == "fail" and steps[-1].info["episode_return"] == pytest.approx(-0.1)
        e2 = SessionEnv([task], executor=pool, config=EnvConfig(max_episode_tokens=120))
        steps = play(e2, 0, demo_actions(task) + [bash("true")])
        assert steps[-1].truncated and steps[-1].info["end"] == "token cap"
        assert steps[-1].info["tokens"] >= 120 and "check" in steps[-1].info
        e2.close()
    finally:
        e.close()


def test_many_envs_step_concurrently(pool):
    envs = [SessionEnv(TASKS, executor=pool) for _ in range(6)]
    try:
        opened = pool.sessions.stats()["opened"]
        reset_batch(envs, list(range(6)))
        assert pool.sessions.stats()["opened"] == opened + 6  # six episodes open at once
        first = [e.submit_step(demo_actions(e.task)[0]) for e in envs]  # all queued at once
        assert all(f.result(timeout=60).observation.startswith("<tool_response>") for f in first)
        second = step_batch(envs, [demo_actions(e.task)[1] for e in envs])
        assert not any(s.terminated for s in second)
        last = step_batch(envs, [DONE_TEXT] * 6)
        assert [s.reward for s in last] == [1.0] * 6
    finally:
        for e in envs:
            e.close()


def test_close_during_a_turn_ends_it(pool):
    e = SessionEnv(ROOMY, executor=pool, config=EnvConfig(command_timeout_s=20.0))
    e.reset(0)
    f = e.submit_step(bash("sleep 15"))
    with pytest.raises(EnvError, match="still running"):
        e.reset(1)
    time.sleep(0.2)
    e.close()
    r = f.result(timeout=20)
    assert r.truncated and r.reward == 0.0 and r.info["status"] == "sandbox_error", r.info
    assert e.reset(1) == ROOMY[1].prompt  # the env goes on with a new episode
    e.close()


def _terminal_hacks():
    spec = importlib.util.spec_from_file_location("_reward_hacks", os.path.join(HERE, "test_reward_hacks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TERMINAL_HACKS


def test_reward_hacks_against_the_session_check(pool, clean_next):
    task = dataclasses.replace(TASKS[0], timeout_s=1.0)  # (a FIFO stalls the check 1 s, not 5)
    target = task.meta["params"]["target"]  # copy the file named in a pointer file here
    env = SessionEnv([task], executor=pool, config=EnvConfig(max_turns=6))
    hacks = dict(_terminal_hacks())
    hacks.update({
        "background_writer": "x=$(cat *.txt | head -c 0); (sleep 0.3; for f in *.txt; do "
                             f"cp $f {target}; done) & disown; nohup sleep 1 >/dev/null 2>&1 &",
        "other_sessions_dir": f"for d in /run/kimi-sandbox/slots/*/work; do cp $d/* . ; done; "
                              f"ls /proc/*/root/work 2>/dev/null > {target}",
        "link_target_to_every_file": f"ln -sf /dev/stdin {target}",
        "fifo_target": f"mkfifo {target}",
    })
    try:
        for name, cmd in hacks.items():
            steps = play(env, 0, [bash(cmd)])
            assert steps[-1].reward == 0.0 and steps[-1].info["status"] != "sandbox_error", \
                (name, steps[-1].info)
        steps = play(env, 0, demo_actions(task))
        assert steps[-1].reward == 1.0  # the honest episode, next to them
    finally:
        env.close()
    clean_next(pool)


def test_folder_tasks_load_and_solve(pool):
    from sandbox.tasks.folders import load_task_dirs

    tasks = load_task_dirs(os.path.join(HERE, "..", "..", "sandbox", "tasks", "data", "folder_tasks"))
    assert len(tasks) == 3 and all(t.meta["solution"] for t in tasks)
    env = SessionEnv(tasks, executor=pool, config=EnvConfig(observation_tokens=200))
    try:
        for i, t in enumerate(tasks):
            steps = play(env, i, [bash(c) for c in t.meta["solution"]])
            assert steps[-1].reward == 1.0, (t.id, steps[-1].info)
            steps = play(env, i, [bash(t.meta["solution"][0])])  # reading alone solves nothing
            assert steps[-1].reward == 0.0, t.id
    finally:
        env.close()
