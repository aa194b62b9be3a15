"""Task sources written by others played as episodes in real sandbox sessions (rl.envs): every
runnable AgentBench OS task scores 1 with its reference solution and 0 for an empty episode and
for a wrong answer through the pool, one task of each kind the same through the HTTP server; the
three Terminal-Bench 2
example folders score 1 with solve.sh and 0 with a no-op; hacks against both checks (destroy the
state the expected value is computed from, plant a reward file or a test in /tests) score 0."""

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl.envs import EnvConfig, SessionEnv, play, play_reference
from rl.tools import format_tool_call
from sandbox import SandboxClient
from sandbox.server import SandboxServer
from sandbox.tasks.agentbench import load_agentbench_os
from sandbox.tasks.terminal_bench import load_tb2_dir

TB2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "sandbox", "tasks",
                   "data", "terminal_bench2")
AB = load_agentbench_os("all").tasks


def config(task) -> EnvConfig:
    return EnvConfig(max_turns=len(task.meta.get("solution") or []) + 3, command_timeout_s=30.0,
                     max_episode_tokens=1 << 20, session_disk_mb=64)


def episode(executor, task, how):
    """(reward, info) of one episode: how = "reference" | "empty" | a list of actions."""
    env = SessionEnv([task], executor=executor, config=config(task))
    try:
        if how in ("reference", "empty"):
            steps = play_reference(env, 0, empty=how == "empty")
        else:
            steps = play(env, 0, how)
        return steps[-1].reward, steps[-1].info
    finally:
        env.close()


def wrong_answer(task, executor) -> list[str]:
    """A well-formed wrong final answer: the expected one changed (an answer task). The expected
    value is read in a session of its own, and some tasks' set-up is random (test/57 writes
    RANDOM error lines: about 42 of 210), so an integer is moved far beyond any set-up's range
    rather than by one, which another session's draw could make right."""
    env = SessionEnv([task], executor=executor, config=config(task))
    try:
        env.reset(0)
        exp = env.expected
    finally:
        env.close()
    try:
        wrong = str(int(exp) + 1_000_000_007)
    except ValueError:
        try:
            wrong = str(float(exp.rstrip("KMGB")) * 2 + 1) + exp[len(exp.rstrip("KMGB")):]
        except ValueError:
            wrong = exp + "x"
    return [f"answer({wrong})"]


def sweep(executor, tasks, how, threads=4):
    with ThreadPoolExecutor(max_workers=threads) as ex:
        return list(ex.map(lambda t: episode(executor, t, how if not callable(how)
                                                else how(t, executor)), tasks))


@pytest.fixture(scope="module")
def http(pool):
    token = "ab-" + os.urandom(12).hex()
    srv = SandboxServer(pool, token=token).serve_in_thread()
    client = SandboxClient(srv.url, token=token)
    yield client
    client.close()
    srv.stop()


def _failures(tasks, results, want):
    return [(t.id, r, info.get("status"), info.get("answer"), info.get("check"))
            for t, (r, info) in zip(tasks, results) if r != want]


@pytest.mark.slow
def test_agentbench_every_reference_scores_1_and_empty_0_through_the_pool(pool):
    assert len(AB) == 120
    assert not _failures(AB, sweep(pool, AB, "reference"), 1.0)
    assert not _failures(AB, sweep(pool, AB, "empty"), 0.0)


@pytest.mark.slow
def test_agentbench_wrong_answers_score_0_through_the_pool(pool):
    answer_tasks = [t for t in AB if t.meta.get("answer_task")]
    assert len(answer_tasks) > 90
    assert not _failures(answer_tasks, sweep(pool, answer_tasks, wrong_answer), 0.0)


def _kind(t) -> tuple:
    """What a task exercises: answer or state, the comparison or check, a start command, a
    match or a reference."""
    return (bool(t.meta.get("answer_task")), t.check[-120:], "start" in t.meta,
            "reference" in t.meta, t.meta["split"])


def one_per_kind(tasks):
    seen, out = set(), []
    for t in tasks:
        if _kind(t) not in seen:
            seen.add(_kind(t))
            out.append(t)
    return out


def test_agentbench_through_the_http_server(http):
    """One task of every kind (answer comparisons, check scripts and commands, start commands,
    matches, references, both splits) through SandboxClient and the HTTP server: reference 1,
    empty 0, wrong answer 0. `python scripts/evaluate.py --agentbench=all --completions=canonical
    --config.sandbox.remote=URL` plays all of them through a server."""
    tasks = one_per_kind(AB)
    assert len(tasks) >= 10
    assert not _failures(tasks, sweep(http, tasks, "reference"), 1.0)
    assert not _failures(tasks, sweep(http, tasks, "empty"), 0.0)
    answer_tasks = [t for t in tasks if t.meta.get("answer_task")]
    assert not _failures(answer_tasks, sweep(http, answer_tasks, wrong_answer), 0.0)


def _task(tid):
    return next(t for t in AB if t.id == tid)


def test_agentbench_expected_value_is_fixed_before_the_model_acts(pool):
    """Counting empty files (test/24): deleting everything and answering 0 would match an
    expected value computed at the end; it is computed after setup instead."""
    t = _task("agentbench-os/test/24")
    hack = [format_tool_call("bash", {"command": "rm -rf /home/agent/* /home/agent/.[!.]*"}),
            "answer(0)"]
    r, info = episode(pool, t, hack)
    assert r == 0.0 and info["answer"] == "0"
    assert episode(pool, t, "reference")[0] == 1.0


def test_agentbench_background_writer_lives_through_the_episode(pool):
    """dev/0: a start command appends to /home/agent/log every second; two reads a little over
    a second apart see it grow; the answer is the interval."""
    t = _task("agentbench-os/dev/0")
    env = SessionEnv([t], executor=pool, config=config(t))
    try:
        env.reset(0)
        first = env.session.run("wc -l < /home/agent/log").stdout
        env.session.run("sleep 2.2")
        second = env.session.run("wc -l < /home/agent/log").stdout
        assert int(second) >= int(first or 0) + 2
        assert env.step("answer(1)").reward == 1.0
    finally:
        env.close()
    assert episode(pool, t, ["answer(3)"])[0] == 0.0


@pytest.fixture(scope="module")
def tb2():
    return load_tb2_dir(TB2).tasks


def test_tb2_folders_solved_by_solve_sh_not_by_a_noop(pool, tb2):
    assert len(tb2) == 3
    assert not _failures(tb2, sweep(pool, tb2, "reference", threads=3), 1.0)
    assert not _failures(tb2, sweep(pool, tb2, "empty", threads=3), 0.0)
    noop = [format_tool_call("bash", {"command": "ls -la"})]
    assert not _failures(tb2, sweep(pool, tb2, noop, threads=3), 0.0)


def test_tb2_planted_reward_and_tests_score_0(pool, tb2):
    count = next(t for t in tb2 if t.id.endswith("count-errors"))
    plant = "; ".join([
        "mkdir -p /logs/verifier /tests",
        "echo 1 > /logs/verifier/reward.txt",               # a reward written in advance
        "printf 'exit 0\\n' > /tests/test.sh",             # a test that always passes
        "printf 'import sys; sys.exit(0)\\n' > /tests/test_outputs.py",
        "echo 'api 9' > /app/report.txt"])
    r, info = episode(pool, count, [format_tool_call("bash", {"command": plant})])
    assert r == 0.0 and info["status"] == "fail"
    # the test writes a reward of 0 and exits 0: the reward file decides
    merge = next(t for t in tb2 if t.id.endswith("merge-config"))
    partial = "cp /app/overrides.ini /app/merged.ini"
    assert episode(pool, merge, [format_tool_call("bash", {"command": partial})])[0] == 0.0


def test_agentbench_isolation(pool):
    """On these tasks' workspaces: the background writer of dev/0 does not outlive its episode,
    two episodes open at once do not see each other's /root or /home, and a start command
    reaches neither the network nor the host's files."""
    from sandbox.host import live_pids_of_uid

    t = _task("agentbench-os/dev/0")
    a, b = (SessionEnv([t], executor=pool, config=config(t)) for _ in range(2))
    try:
        a.reset(0)
        b.reset(0)
        uid = a.session._b.uid
        assert live_pids_of_uid(uid)                       # the writer runs ...
        assert a.session.run("echo secret-a > /root/mine; echo x > /home/a-was-here").ok
        r = b.session.run("cat /root/mine; ls /home")
        assert "secret-a" not in r.stdout and "a-was-here" not in r.stdout
        assert a.step("answer(1)").reward == 1.0           # the episode ends, its session closes
        assert not live_pids_of_uid(uid)                   # ... and is gone with it
    finally:
        a.close()
        b.close()
    probe = ("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), timeout=1)' "
             "2>/dev/null && echo net >> /home/agent/leak; "
             "cat /work/main/README.md /proc/1/root/etc/shadow 2>/dev/null >> /home/agent/leak; "
             "ls /run/kimi-sandbox >> /home/agent/leak 2>/dev/null; echo ran >> /home/agent/leak")
    t2 = dataclasses.replace(t, meta={**t.meta, "start": f"( {probe} ) &"})
    env = SessionEnv([t2], executor=pool, config=config(t2))
    try:
        env.reset(0)
        assert env.session.run("sleep 1.5; cat /home/agent/leak").stdout == "ran\n"
    finally:
        env.close()
