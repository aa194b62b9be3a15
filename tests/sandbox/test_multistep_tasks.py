"""The multi-step terminal family (sandbox/tasks/domains/multistep.py) and the folder-per-task
loader (sandbox/tasks/folders.py): splits disjoint and deterministic, levels balanced, sizes for
the tiny model, answers that cannot be guessed from the prompt, offline demonstrations equal to
what real sessions print (one task per template, correct and corrupted, judged by the real
check), the imperfect fraction, and every malformed task folder refused with a message."""

import os
import random
import re
from collections import Counter

import pytest

from rl.envs import EnvConfig, SessionEnv, demo_turns, play
from rl.tools import format_tool_call
from sandbox import TaskFormatError
from sandbox.tasks.domains import multistep
from sandbox.tasks.folders import load_task_dir
from sandbox.tasks.sft import sft_episodes

TRAIN = multistep.make_split("train", 240, seed=0)


def test_splits_are_disjoint_deterministic_and_balanced():
    val = multistep.make_split("val", 60, seed=0)
    test = multistep.make_split("test", 60, seed=3)
    prompts = {s: {t.prompt for t in ts} for s, ts in (("train", TRAIN), ("val", val), ("test", test))}
    assert not prompts["train"] & prompts["test"] and not prompts["train"] & prompts["val"]
    assert not prompts["val"] & prompts["test"]
    assert all(t.meta["split"] == "test" and t.id.startswith("multistep/test/") for t in test)
    assert [t.id for t in multistep.make_split("train", 240, seed=0)] == [t.id for t in TRAIN]
    assert len({t.id for t in TRAIN}) == 240
    assert {t.id for t in multistep.make_split("train", 30, seed=1)} != {t.id for t in TRAIN[:30]}
    assert Counter(t.meta["difficulty"] for t in TRAIN) == {1: 80, 2: 80, 3: 80}
    assert set(Counter(t.meta["template"] for t in TRAIN)) == {
        f.__name__[3:] for fs in multistep.TEMPLATES.values() for f in fs}
    with pytest.raises(ValueError, match="split"):
        multistep.make_split("dev", 1, seed=0)


def test_sizes_fit_the_tiny_model_and_answers_cannot_be_guessed():
    hidden = Counter()
    for t in TRAIN:
        d = multistep.describe(t)
        assert d["prompt_bytes"] < multistep.MAX_PROMPT_BYTES
        assert d["commands"] == t.meta["difficulty"] + 1
        assert d["max_command_bytes"] <= multistep.MAX_COMMAND_BYTES
        assert d["max_stdout_bytes"] <= multistep.MAX_OBSERVATION_BYTES
        last = t.meta["demo_turns"][-1]["command"]
        # what the last command acts on (a random name, or a number) is in no prompt: only in
        # a file, which the earlier commands read
        secret = [w for w in last.replace("/", " ").replace("=", " ").split()
                  if (w.endswith(".txt") and len(w) == 8) or w.strip("'").isdigit()]
        assert secret and not any(s in t.prompt for s in secret), (t.prompt, last)
        hidden.update(s for s in secret if s.endswith(".txt"))
        for turn in t.meta["demo_turns"]:
            assert turn["stdout"] == "" or turn["stdout"].endswith("\n")
        obs = [o for _, o in demo_turns(t, EnvConfig(observation_tokens=100))[:-1]]
        assert all("more bytes]" not in o for o in obs)  # never cut at the demo's budget
    assert hidden.most_common(1)[0][1] <= 2  # names are drawn per task


def test_corruptions_fail_and_the_imperfect_fraction_is_exact():
    rng = random.Random(0)
    for t in TRAIN[:60]:
        turns = multistep.corrupt(rng, t)
        _, final = multistep.simulate(t.files, [x["command"] for x in turns])
        assert not multistep.passes(t, final)
        assert [x["command"] for x in turns] != [x["command"] for x in t.meta["demo_turns"]]
    eps = sft_episodes(TRAIN[:50], 0.4, seed=1)
    assert sum(not ok for _, _, ok in eps) == 20
    assert [t.id for t, _, _ in eps] == [t.id for t in TRAIN[:50]]
    with pytest.raises(ValueError):
        sft_episodes(TRAIN[:5], 1.5, seed=0)


def test_offline_demonstrations_match_real_sessions(pool):
    """One task per template: the demo's observations are what the sandbox prints, the demo
    scores 1, a corrupted demo scores 0 (judged by the real, isolated check)."""
    by_template = {}
    for t in TRAIN:
        by_template.setdefault(t.meta["template"], t)
    tasks = list(by_template.values())
    env = SessionEnv(tasks, executor=pool)
    rng = random.Random(5)
    try:
        for i, t in enumerate(tasks):
            turns = demo_turns(t, env.config)
            steps = play(env, i, [a for a, _ in turns[:-1]])
            assert [s.observation for s in steps[:-1]] == [o for _, o in turns[:-1]], t.meta["template"]
            assert steps[-1].reward == 1.0, (t.meta["template"], steps[-1].info)
            wrong = demo_turns(t, env.config, turns=multistep.corrupt(rng, t))
            steps = play(env, i, [a for a, _ in wrong[:-1]])
            assert [s.observation for s in steps[:-1]] == [o for _, o in wrong[:-1]]
            assert steps[-1].reward == 0.0 and steps[-1].info["status"] == "fail", t.meta["template"]
    finally:
        env.close()


def _blind_answers(task):
    """{rule: final files} of rules that act without reading the pointer or grepping: the last
    demonstrated command (cp, wc or sed) applied to the first / last random-named file (top
    level, and in the task's directory), the first / last file of words, the first / last
    file holding a number; for count_named also every constant count 1..60."""
    files, last = task.files, task.meta["demo_turns"][-1]["command"]
    fixed = set(multistep._PTRS) | set(multistep._OUTS) | set(multistep._CFGS)
    top = sorted(p for p in files if "/" not in p and p not in fixed)
    inner = sorted(p for p in files if "/" in p)
    kinds = {"any": top, "dir": inner,
             "words": [p for p in top if not re.fullmatch(r"\d+\n", files[p])
                       and ".txt" not in files[p]],
             "number": [p for p in top if re.fullmatch(r"\d+\n", files[p])]}
    out = {}
    for kind, paths in kinds.items():
        for pos, path in (("first", paths[:1]), ("last", paths[-1:])):
            if not path:
                continue
            cmd = (re.sub(r"^cp \S+", f"cp {path[0]}", last) if last.startswith("cp ") else
                   re.sub(r"< \S+", f"< {path[0]}", last) if last.startswith("wc ") else
                   re.sub(r"=(\d+)/'", f"={files[path[0]].strip()}/'", last)
                   if kind == "number" else None)
            if cmd is not None:
                out[f"{kind}-{pos}"] = multistep.simulate(files, [cmd])[1]
    if task.meta["template"] == "count_named":
        target = task.meta["params"]["target"]
        out.update({f"count-{k}": {**files, target: f"{k}\n"} for k in range(1, 61)})
    return out


def test_blind_rules_pass_few_tasks_of_any_template():
    """A policy that never reads what the task points to (always copies the first file, always
    writes the same count, ...) passes at most 15% of any template's tasks (the decoys and the
    count range in multistep.py; before them up to 50%), while the demonstrations pass all."""
    tasks = multistep.make_split("train", 720, seed=2)
    wins, seen = Counter(), Counter()
    for t in tasks:
        seen[t.meta["template"]] += 1
        for rule, final in _blind_answers(t).items():
            wins[t.meta["template"], rule] += multistep.passes(t, final)
    assert min(seen.values()) >= 60 and len(seen) == 8
    rates = {k: n / seen[k[0]] for k, n in wins.items()}
    worst = max(rates, key=rates.get)
    assert rates[worst] <= 0.15, (worst, rates[worst])
    assert sum(1 for k in rates if k[1].startswith("count-")) == 60  # the rules did run
    assert any(r > 0 for r in rates.values())  # and can win (the decoys are not the answer)


def test_a_blind_episode_fails_in_a_real_session(pool):
    """The first rule above as a shell command in real sessions, on count_named and copy_named
    tasks: `wc -l`/`cp` of the alphabetically first 4-letter file, never reading the pointer."""
    tasks = [t for t in multistep.make_split("test", 90, seed=4, difficulty=1)
             if t.meta["template"] in ("count_named", "copy_named")][:24]
    env = SessionEnv(tasks, executor=pool)
    first = "$(ls | grep -E '^[a-z2-9]{4}[.]txt$' | grep -vxE 'note|hint|todo|memo|next|info|lead|clue' | head -1)"
    try:
        rewards = []
        for i, t in enumerate(tasks):
            out = t.meta["params"]["target"]
            cmd = (f"wc -l < {first} > {out}" if t.meta["template"] == "count_named"
                   else f"cp {first} {out}")
            rewards.append(play(env, i, [format_tool_call("bash", {"command": cmd})])[-1].reward)
    finally:
        env.close()
    assert len(tasks) == 24 and sum(rewards) <= 3, rewards


def _folder(tmp_path, files: dict[str, str | bytes]):
    root = tmp_path / "t"
    base = {"instruction.md": "Do it.", "tests/test.sh": "exit 0\n"}
    for rel, content in {**base, **files}.items():
        if content is None:
            continue
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


@pytest.mark.parametrize("files, error", [
    ({"instruction.md": None}, "no instruction.md"),
    ({"instruction.md": "  \n"}, "is empty"),
    ({"tests/test.sh": None}, "exactly one test script"),
    ({"tests/test.py": "pass\n"}, "exactly one test script"),
    ({"tests/helper.py": "x = 1\n"}, "besides test.sh"),
    ({"environment/Dockerfile": "FROM debian\n"}, "Dockerfile is not supported"),
    ({"environment/other.txt": "x"}, "only files/ and setup.sh"),
    ({"environment/files/a.bin": b"\xff\xfe"}, "not UTF-8 text"),
    ({"task.toml": "[agent]\nmax_turns = 'four'\n"}, "wrong type"),
    ({"task.toml": "[agent]\nmax_steps = 4\n"}, "unknown key 'max_steps'"),
    ({"task.toml": "[docker]\nimage = 'x'\n"}, "unknown section [docker]"),
    ({"task.toml": "[environment]\ncpus = 2\n"}, "one CPU"),
    ({"task.toml": "[agent]\nmax_turns = 0\n"}, "must be positive"),
    ({"task.toml": "[agent\n"}, "not valid TOML"),
])
def test_bad_task_folders_are_refused(tmp_path, files, error):
    with pytest.raises(TaskFormatError, match=error.replace("[", r"\[").replace("(", r"\(")):
        load_task_dir(_folder(tmp_path, files))


def test_task_folder_fields(tmp_path):
    t = load_task_dir(_folder(tmp_path, {
        "task.toml": "[task]\nname = 'me/t1'\n[metadata]\ndifficulty = 'hard'\n[agent]\n"
                     "max_turns = 3\ntimeout_sec = 20\n[verifier]\ntimeout_sec = 7\n"
                     "[environment]\nmemory_mb = 128\nstorage_mb = 4\n",
        "environment/files/d/a.txt": "x\n", "environment/setup.sh": "touch made\n",
        "tests/test.sh": None, "tests/test.py": "import sys; sys.exit(0)\n",
        "solution/solve.sh": "# comment\n\nls \\\n  -l\ncat d/a.txt\n"}))
    assert (t.id, t.family, t.prompt, t.check_language) == ("me/t1", "terminal", "Do it.", "python")
    assert t.files == {"d/a.txt": "x\n"} and t.setup == "touch made\n"
    assert (t.timeout_s, t.memory_mb) == (7.0, 128)
    assert t.meta["max_turns"] == 3 and t.meta["agent_timeout_s"] == 20.0 and t.meta["disk_mb"] == 4
    assert t.meta["difficulty"] == "hard" and t.meta["solution"] == ["ls \n  -l", "cat d/a.txt"]
    os.symlink("/etc/passwd", tmp_path / "t" / "environment" / "files" / "link")
    with pytest.raises(TaskFormatError, match="symbolic link"):
        load_task_dir(tmp_path / "t")
    assert format_tool_call("bash", {"command": t.meta["solution"][0]}).count("\\n") == 1


def test_tasks_are_the_same_in_every_process():
    # splits, demonstrations and checks must not depend on PYTHONHASHSEED (set iteration order
    # once shuffled the random file names differently in every process)
    import subprocess
    import sys
    code = ("import hashlib, json\nfrom sandbox.tasks.domains import DOMAINS, multistep\n"
            "from sandbox.tasks.sampling import make_split\n"
            "ts = multistep.make_split('train', 12, seed=1)\n"
            "fams = [f for f, d in DOMAINS.items() if d.generated and not d.multi_turn]\n"
            "ts += [t for f in fams for t, _ in make_split(f, 'val', 4, 1)]\n"
            "print(hashlib.sha256(json.dumps([t.to_dict() for t in ts], sort_keys=True)"
            ".encode()).hexdigest())")
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=root, env={**os.environ, "PYTHONHASHSEED": h}).stdout
            for h in ("1", "2", "3")}
    assert len(outs) == 1, outs
