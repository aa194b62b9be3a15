"""Multi-turn rollouts (rl/agent.py): episodes in sandbox sessions, the target mask, log-probs.

A test-preset model memorises one demonstrated episode of a multi-step terminal task (read a
file to learn which file to copy, then copy it), so sampling from it produces real multi-turn
episodes: tool calls, observations from the session, a last word, the isolated check.
Covered: the episode rows (model tokens targets, observations and prompt not), the sampler's
log-probs on model tokens equal the trainer's (temperature 0.7), observation positions
contribute exactly nothing to the loss, its gradient or the KL, the reward is the session
check's, and SFT rendering (encode_episode) equals what a rollout of the same turns produces.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model import objectives
from model.config import ModelConfig
from model.objectives import fit_lm_on_batch
from model.tokenizer import ByteTokenizer
from model.transformer import Model
from rl import losses
from rl.agent import AgentRolloutWorker, encode_episode
from rl.algorithms import get_algorithm
from rl.envs import EnvConfig, demo_turns
from rl.pipeline import build_train_batch
from rl.sampler import Sampler, SamplingConfig
from rl.train_step import make_logp_fn, make_rl_loss
from sandbox import SandboxPool
from sandbox.tasks.domains import multistep

WIDTH, TURN = 448, 96
ENV = EnvConfig(observation_tokens=32, max_turns=4)
SAMPLING = SamplingConfig(max_new_tokens=TURN, temperature=0.7, eos_id=ByteTokenizer.eos_id)


@pytest.fixture(scope="module")
def agent():
    tok = ByteTokenizer()
    task = min(multistep.make_split("train", 40, seed=1, difficulty=1), key=lambda t: len(t.prompt))
    ids, target = encode_episode(tok, task.prompt, demo_turns(task, ENV))
    c = models.get_config("test")
    c.max_seq_len = 512
    model = Model(ModelConfig.from_dict(c))
    rows = np.zeros((2, WIDTH), np.int32)
    rows[:, :len(ids)] = ids
    variables, hist = fit_lm_on_batch(model, model.init(jax.random.key(0)), jnp.asarray(rows),
                                      steps=30, lr=1e-2)
    assert float(hist[-1]["ce"]) < 0.1
    with SandboxPool(workers=2) as pool:
        worker = AgentRolloutWorker(model, tok, SAMPLING, pool, group_size=2, width=WIDTH,
                                    env_config=ENV)
        group = worker.start(variables, [task], jax.random.key(3)).result()
    return dict(model=model, variables=variables, task=task, tok=tok, group=group,
                demo=(ids, target))


@pytest.mark.slow
def test_episodes_are_multi_turn_and_scored_by_the_session_check(agent):
    g = agent["group"]
    assert not g.failed.any(), g.details
    turns = [d["turns"] for d in g.details]
    assert max(turns) >= 3, [(d.get("end"), d.get("status"), t[-160:]) for d, t in zip(g.details, g.texts)]
    solved = g.rewards == 1.0
    assert solved.any(), [(d.get("status"), d.get("end"), t) for d, t in zip(g.details, g.texts)]
    for d, r in zip(g.details, g.rewards):
        assert (d["status"] == "pass") == (r == 1.0)
    # a solved episode's text holds the session's real observation of the pointer file
    answer = agent["task"].meta["demo_turns"][0]["stdout"].strip()
    assert any(answer in t and "<tool_response>" in t for t in np.array(g.texts)[solved])


def test_targets_are_the_model_tokens_only(agent):
    g, tok = agent["group"], agent["tok"]
    for i in range(len(g.tasks)):
        comp, tm = g.completions[i][g.completion_mask[i]], g.target_mask[i][g.completion_mask[i]]
        text_model = tok.decode(comp[tm], stop_at_eos=False)
        text_obs = tok.decode(comp[~tm], stop_at_eos=False)
        assert "<tool_response>" not in text_model and "exit " not in text_model
        if g.details[i]["turns"] > 1:
            assert text_obs.count("<tool_response>") == g.details[i]["turns"] - 1
            assert text_model.count("<tool_call>") >= 1
        assert np.all(g.sampler_logp[i][g.completion_mask[i]][~tm] == 0)
    # the SFT rendering of the demonstrated turns is what a rollout of those turns produces
    ids, target = agent["demo"]
    solved = [i for i, r in enumerate(g.rewards) if r == 1.0 and g.details[i]["turns"] == 3]
    if solved:
        i = solved[0]
        row = list(g.prompts[i][:g.prompt_lengths[i]]) + list(g.completions[i][g.completion_mask[i]])
        tmask = [False] * g.prompt_lengths[i] + list(g.target_mask[i][g.completion_mask[i]])
        if row == ids:
            assert tmask == target


def test_sampler_logprobs_equal_trainer_and_observations_carry_no_loss(agent):
    model, variables, g = agent["model"], agent["variables"], agent["group"]
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.1, tis_cap=2.0)
    logp_fn = make_logp_fn(model, SAMPLING)
    ref = jax.tree.map(lambda x: x * 0.9, variables)  # another policy: the KL is not 0

    def forward(tokens, mask):
        return {"old_logp": logp_fn(variables, tokens, mask), "ref_logp": logp_fn(ref, tokens, mask)}

    batch, met = build_train_batch(g, algo, WIDTH, forward=forward)
    m = batch["loss_mask"]
    np.testing.assert_allclose(batch["old_logp"][m], batch["rollout_logp"][m], atol=2e-4)
    assert met["completion_len_mean"] == g.target_mask.sum(1).mean()  # model tokens only

    # observation positions (in the rows, not targets) may hold anything: nothing changes
    obs = np.zeros_like(m)
    for i in range(len(g.tasks)):
        p = g.prompt_lengths[i]
        c = g.completion_mask[i].sum()
        obs[i, p:p + c] = ~g.target_mask[i][:c]
    assert obs.any() and not (obs & m).any()
    fn = jax.jit(jax.value_and_grad(make_rl_loss(model, algo, sampling=SAMPLING), has_aux=True))
    counts = losses.agg_counts(m)
    tcounts = objectives.target_counts(m, model.cfg.mtp.depth)

    def run(b):
        jb = {k: jnp.asarray(v) for k, v in b.items()}
        jb["advantages"] = jnp.asarray(np.where(m, 0.5, b["advantages"]), jnp.float32)
        (loss, (met, _, _)), grads = fn((variables["params"], None), variables["router_state"], jb,
                                        counts, tcounts)
        return float(loss), float(met["kl_ref"]), grads

    base = run(batch)
    junk = dict(batch)
    for k in ("old_logp", "ref_logp", "rollout_logp"):
        junk[k] = np.where(obs, 37.0, batch[k])
    got = run(junk)
    assert base[0] == got[0] and base[1] == got[1]
    for a, b in zip(jax.tree.leaves(base[2]), jax.tree.leaves(got[2])):
        np.testing.assert_array_equal(a, b)
    # the same junk on one model token does change the loss (the check has teeth)
    one = np.zeros_like(m)
    one[np.argwhere(m)[0][0], np.argwhere(m)[0][1]] = True
    junk2 = dict(batch, ref_logp=np.where(one, 37.0, batch["ref_logp"]))
    assert run(junk2)[1] != base[1]


def test_routing_worker_merges_one_shot_and_agent_rows_in_task_order(agent):
    from rl.agent import RoutingWorker
    from rl.pipeline import RolloutWorker
    from sandbox.tasks.sampling import make_split
    from sandbox.verifiers import Verifier

    model, variables, tok, task = agent["model"], agent["variables"], agent["tok"], agent["task"]
    (arith, _), = make_split("arithmetic", "train", 1, seed=3, difficulty=1)
    with SandboxPool(workers=2) as pool:
        one = RolloutWorker(model, tok, SamplingConfig(max_new_tokens=8, eos_id=tok.eos_id),
                            Verifier(pool), group_size=2, max_prompt_len=96)
        both = RoutingWorker(one, AgentRolloutWorker(model, tok, SAMPLING, pool, group_size=2,
                                                     width=WIDTH, env_config=ENV))
        g = both.start(variables, [arith, task, arith], jax.random.key(4), pad_to=3).result()
    assert [t.id for t in g.tasks] == [arith.id] * 2 + [task.id] * 2 + [arith.id] * 2
    assert list(g.group_ids) == [0, 0, 1, 1, 2, 2]
    assert ["turns" in d for d in g.details] == [False, False, True, True, False, False]
    # one-shot rows: every completion token is the model's; agent rows: observations are not
    for i in (0, 1, 4, 5):
        np.testing.assert_array_equal(g.target_mask[i], g.completion_mask[i])
    assert (g.completion_mask[2] & ~g.target_mask[2]).any()
    batch, _ = build_train_batch(g, get_algorithm("grpo", kl_placement="none", kl_coef=0.0),
                                 WIDTH)
    assert batch["tokens"].shape == (6, WIDTH) and batch["loss_mask"].sum() == g.target_mask.sum()


def test_routing_worker_rows_draw_by_their_ids(agent):
    """With row_ids (one per task and sample) a sampled row's completion depends on its id, not
    on its place: the same tasks started in another order and grouping, with their ids, give
    the same completions, one-shot (T=1) and multi-turn (T=2) alike; evaluation relies on
    it (rl.pipeline.evaluate). Bad ids are refused before anything runs."""
    from rl.agent import RoutingWorker
    from rl.pipeline import RolloutWorker
    from sandbox.tasks.sampling import make_split
    from sandbox.verifiers import Verifier

    model, variables, tok, task = agent["model"], agent["variables"], agent["tok"], agent["task"]
    (arith, _), = make_split("arithmetic", "train", 1, seed=3, difficulty=1)
    other = multistep.make_split("train", 3, seed=5, difficulty=1)[0]
    with SandboxPool(workers=2) as pool:
        one = RolloutWorker(model, tok, SamplingConfig(max_new_tokens=8, temperature=1.0,
                                                       eos_id=tok.eos_id),
                            Verifier(pool), group_size=2, max_prompt_len=96)
        hot = dataclasses.replace(SAMPLING, temperature=2.0)  # the fitted model is peaked
        both = RoutingWorker(one, AgentRolloutWorker(model, tok, hot, pool, group_size=2,
                                                     width=WIDTH, env_config=ENV))
        key = jax.random.key(11)
        a = both.start(variables, [arith, task, other], key, row_ids=[0, 1, 2, 3, 4, 5]).result()
        b = both.start(variables, [other, arith], key, pad_to=2, row_ids=[4, 5, 0, 1]).result()
        c = both.start(variables, [other, arith], key, pad_to=2).result()  # ids by place
        with pytest.raises(ValueError, match="row_ids must be 4 ids"):
            both.start(variables, [other, arith], key, row_ids=[0, 1, 2])
    def tokens(g, row):  # the row's completion (merged groups pad to different widths)
        return g.completions[row][g.completion_mask[row]].tolist()

    for row, i in ((0, 4), (1, 5), (2, 0), (3, 1)):
        assert tokens(b, row) == tokens(a, i) and b.texts[row] == a.texts[i]
    assert len({a.texts[i] for i in range(6)}) == 6  # sampled: the rows differ
    # without the ids, `other`'s episodes draw by their place (rows 0, 1): other tokens
    assert any(tokens(c, r) != tokens(a, r + 4) for r in (0, 1))


@pytest.mark.slow
def test_turn_cache_equals_rereading_the_whole_context(agent, monkeypatch):
    """Turns that continue the episode's decode cache (prefilling only the last sampled token and
    the observation) give the episodes of turns that re-read the whole context: token for token
    greedy and sampled from the same rng (T=0.7), log-probs within 2e-4, the same rewards; they
    prefill a fraction of the positions. The sampled run also has the cache start afresh
    mid-episode (a padded segment that does not fit: forced by a narrow cache)."""
    import rl.agent as agent_mod

    model, variables, tok, task = agent["model"], agent["variables"], agent["tok"], agent["task"]
    tasks = [task] + multistep.make_split("train", 3, seed=5, difficulty=1)
    runs = {}
    with SandboxPool(workers=2) as pool:
        for temperature, cached, narrow in ((0.0, False, False), (0.0, True, False),
                                            (0.7, False, False), (0.7, True, True)):
            sampling = SamplingConfig(max_new_tokens=TURN, temperature=temperature,
                                      eos_id=tok.eos_id)
            w = AgentRolloutWorker(model, tok, sampling, pool, group_size=2, width=WIDTH,
                                   env_config=ENV, cache_turns=cached)
            if narrow:  # segments padded to 256 in a cache of exactly WIDTH positions
                monkeypatch.setattr(agent_mod, "_SEGMENT_MIN", 256)
                w.cache_len = WIDTH
            calls = []
            new_cache = w.sampler.new_cache
            w.sampler.new_cache = lambda *a, calls=calls, f=new_cache: calls.append(a) or f(*a)
            g = w.start(variables, tasks, jax.random.key(7)).result()
            runs[temperature, cached] = g, len(calls)
    for temperature in (0.0, 0.7):
        (full, n_full), (cached, n_cached) = runs[temperature, False], runs[temperature, True]
        assert max(d["turns"] for d in full.details) >= 3 and (full.rewards == 1.0).any()
        # one cache per half, kept across turns; the narrow one (T=0.7) started afresh too
        assert n_full == 0 and (n_cached == 2 if temperature == 0 else n_cached > 2), n_cached
        np.testing.assert_array_equal(cached.completions, full.completions)
        np.testing.assert_array_equal(cached.target_mask, full.target_mask)
        np.testing.assert_array_equal(cached.rewards, full.rewards)
        np.testing.assert_allclose(cached.sampler_logp, full.sampler_logp, atol=2e-4)
    full, cached = runs[0.0, False][0], runs[0.0, True][0]
    assert cached.prefill_tokens * 3 < full.prefill_tokens, (cached.prefill_tokens,
                                                             full.prefill_tokens)


def test_one_device_mesh_rollouts_keep_the_turn_cache(agent):
    """run_rl passes its mesh to the rollout workers; a mesh of one device (the CPU configs)
    has nothing to shard, so make_rollout_worker builds the plain samplers (the agent keeps
    its turn cache; on several devices: tests/rl/test_sharded_rl.py); a train state's variables (laid
    out on the mesh) reach them as single-device arrays, so an episode batch compiles nothing
    that a worker made without a mesh (the demo's evaluation) compiled already, and plays the
    same episodes."""
    from ml_collections import ConfigDict

    from configs import rl as rl_configs
    from model import sharding as shd
    from rl import sampler as sampler_mod
    from train.rollouts import make_rollout_worker

    r = rl_configs.get_config("demo").rl
    r.agent.width = WIDTH
    mesh, rules = shd.mesh_from_config(ConfigDict({"sharding": shd.sharding_config("one_device")}))
    assert mesh.size == 1
    model, tok, task = agent["model"], agent["tok"], agent["task"]
    on_mesh = jax.device_put(agent["variables"], jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))

    def compiled():
        return sum(f._cache_size() for f in sampler_mod._PROGRAMS.values()
                   if hasattr(f, "_cache_size"))

    with SandboxPool(workers=2) as pool:
        plain, w = (make_rollout_worker(r, model, tok, SAMPLING, None, pool, group_size=2,
                                        tasks=[task], mesh=m, rules=rules)
                    for m in (None, mesh))
        assert w.agent.cache_turns and w.agent.sampler.mesh is None
        assert w.one_shot.mesh is None and w.one_shot.sampler.mesh is None
        # the evaluation's variables: a checkpoint restored onto the device (committed there)
        restored = jax.device_put(agent["variables"], jax.devices()[0])
        a = plain.start(restored, [task], jax.random.key(3)).result()
        before = compiled()
        b = w.start(on_mesh, [task], jax.random.key(3)).result()
        assert compiled() == before > 0
    np.testing.assert_array_equal(a.completions, b.completions)
    np.testing.assert_array_equal(a.rewards, b.rewards)


def test_extend_compiles_once_for_a_fresh_and_a_continued_cache(agent):
    """With committed variables (a restored checkpoint, or `_OnDevice`'s), a fresh cache
    (`new_cache`: uncommitted zeros) and the cache an earlier `extend` returned (committed
    where the variables are) reach the extend program placed alike, so one shape compiles once,
    not once per placement (the demo compiled a second copy mid-RL: 5.8 s). With uncommitted
    variables nothing is moved."""
    from rl import sampler as sampler_mod

    model = agent["model"]
    sampler = Sampler(model, SamplingConfig(max_new_tokens=2, temperature=0.0, eos_id=-1))
    variables = jax.device_put(agent["variables"], jax.devices()[0])
    fn = sampler_mod._program(model, sampler.cfg, mode=("extend",))
    B, S = 3, 56  # a cache shape no other test extends
    first = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 0, 0]],
                     np.int32)
    n0 = fn._cache_size()
    out1, cache = sampler.extend(variables, sampler.new_cache(B, S), first,
                                 np.array([6, 3, 4]), jax.random.key(0))
    assert fn._cache_size() == n0 + 1
    assert all(x.committed for x in jax.tree.leaves(cache))
    more = np.zeros_like(first)  # the two generated tokens fed back: the same M = 6
    more[:, :2] = np.asarray(out1.tokens)
    sampler.extend(variables, cache, more, np.array([2, 2, 2]), jax.random.key(1))
    assert fn._cache_size() == n0 + 1  # the same program for the continued cache
    fresh = sampler.new_cache(B, S)
    assert sampler_mod._commit_like(agent["variables"], fresh) is fresh  # uncommitted: as is


@pytest.mark.slow
def test_two_processes_play_their_episodes_in_lockstep(agent, tmp_path, two_processes):
    """Two processes joined by jax.distributed (one CPU device each, a data=2 mesh across them)
    each play their own episodes in their own sandbox sessions, every turn one sampler program
    over both processes' rows: process 0 two tasks x 2, process 1 one task x 2 and two padding
    rows, so its second half has nothing to generate while process 0's does and it joins those
    turns with rows that sit out. Greedy, with the turn cache and re-reading the context, each
    process's episodes equal what one process without a mesh plays for the same tasks. Also
    row refill (rl.sampler) over both processes' rows, 2 slots each, sampled at T=1 from the
    weights halved (so rows end apart): each process's rows equal one process's refill of all
    8 rows in 4 slots (with the slots not scaled to the global batch they do not). Sampled
    episodes (T=1, the halved weights, cached turns) too: each row draws by its episode's global
    index and its tokens' positions, so the two processes' episodes equal one process's of all
    rows, though each turn call there holds other rows. A batch whose shares differ in kind
    across the processes is refused on both."""
    import pickle

    model, variables, tok, task = agent["model"], agent["variables"], agent["tok"], agent["task"]
    tasks = [task] + multistep.make_split("train", 3, seed=5, difficulty=1)
    shares = [tasks[:2], tasks[2:3]]  # process 1: one task x 2 + two padding rows
    greedy = SamplingConfig(max_new_tokens=TURN, temperature=0.0, eos_id=tok.eos_id)
    with open(tmp_path / "in.pkl", "wb") as f:
        pickle.dump({"cfg": model.cfg, "variables": jax.device_get(variables), "shares": shares,
                     "tasks": tasks}, f)
    procs = two_processes.start(__file__, tmp_path, devices=1)
    with SandboxPool(workers=2) as pool:  # meanwhile, one process without a mesh
        w = AgentRolloutWorker(model, tok, greedy, pool, group_size=2, width=WIDTH,
                               env_config=ENV)
        want = [w.generate(variables, share, jax.random.key(0), pad_to=2) for share in shares]
        w = AgentRolloutWorker(model, tok, _turn_sampling(tok), pool, group_size=2, width=WIDTH,
                               env_config=ENV)
        sampled = w.generate(_softened(variables), tasks[:3], jax.random.key(3), pad_to=4)
    prompts, lens = _refill_prompts(tok, tasks)  # both processes' rows: 4 tasks x 2
    refill = Sampler(model, _turn_sampling(tok)).generate(
        _softened(variables), prompts, lens, jax.random.key(1), group_size=2, slots=4)
    two_processes.finish(procs)
    assert max(d["turns"] for d in want[0].details) >= 3 and (want[0].rewards == 1.0).any()
    got_refill = {}
    for pid, ref in enumerate(want):
        with open(tmp_path / f"out{pid}.pkl", "rb") as f:
            got = pickle.load(f)
        got_refill[pid] = got.pop("refill")
        got_sampled = got.pop("sampled")
        rows = slice(4 * pid, 4 * pid + len(got_sampled["rewards"]))  # padding rows dropped
        for k in ("completions", "target_mask", "rewards", "sampler_logp"):
            a, b = _pad_cols(got_sampled[k], getattr(sampled, k)[rows])
            np.testing.assert_allclose(a, b, atol=2e-4 if k == "sampler_logp" else 0,
                                       err_msg=f"{pid} sampled {k}")
        for cached, g in got.items():
            for k in ("completions", "target_mask", "rewards"):
                np.testing.assert_array_equal(g[k], getattr(ref, k), err_msg=f"{pid} {cached} {k}")
            assert g["turns"] == [d["turns"] for d in ref.details]
        # row refill over both processes' rows (2 slots each) equals one process's (4 slots)
        rows = slice(4 * pid, 4 * pid + 4)
        for k in ("tokens", "mask"):
            np.testing.assert_array_equal(got_refill[pid][k], np.asarray(getattr(refill, k))[rows])
    assert len(set(np.asarray(refill.lengths).tolist())) > 1  # rows end apart: slots refill
    # the sampled copies of a task played apart
    assert not np.array_equal(sampled.completions[0], sampled.completions[1])


def _pad_cols(a, b):
    """Two [n, ...] arrays zero-padded to the same width (a group's completions are as wide as
    its longest row)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim < 2:
        return a, b
    w = max(a.shape[1], b.shape[1])
    pad = lambda x: np.pad(x, [(0, 0), (0, w - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return pad(a), pad(b)


def _turn_sampling(tok):
    """Model turns sampled at T=1 that stop at the tool call's end (rows end apart)."""
    return SamplingConfig(max_new_tokens=TURN, temperature=1.0, eos_id=tok.eos_id,
                          stop_sequences=(tuple(tok.encode("</tool_call>")),))


def _softened(variables):
    """The memorised model's weights halved: its sampled turns vary (and end apart)."""
    return jax.tree.map(lambda x: x * 0.5, variables)


def _refill_prompts(tok, tasks):
    """[8, P] first-turn prompts: each task's twice (groups of 2), right-padded, and lengths."""
    from rl.pipeline import encode_prompts

    prompts, lens = encode_prompts(tok, [t.prompt for t in tasks], 128)
    return np.repeat(prompts, 2, axis=0), np.repeat(lens, 2)


def _lockstep_process(tmp):
    """One of the two processes of test_two_processes_play_their_episodes_in_lockstep."""
    import pickle

    from runtime.xla_env import configure_xla_env

    configure_xla_env(fast_compile=True)
    from model import sharding as shd

    assert shd.maybe_initialize_distributed()
    me = jax.process_index()
    tmp = pathlib.Path(tmp)
    with open(tmp / "in.pkl", "rb") as f:
        d = pickle.load(f)
    model, tok = Model(d["cfg"]), ByteTokenizer()
    mesh = shd.make_mesh((2, 1, 1, 1))  # one device per process: rows split by process
    sh = shd.variables_shardings(shd.model_shardings(model, mesh), d["variables"], mesh)
    variables = jax.tree.map(lambda x, s: jax.make_array_from_callback(
        np.shape(x), s, lambda i: np.asarray(x)[i]), d["variables"], sh)
    greedy = SamplingConfig(max_new_tokens=TURN, temperature=0.0, eos_id=tok.eos_id)
    out = {}
    with SandboxPool(workers=2) as pool:
        for cached in (True, False):
            w = AgentRolloutWorker(model, tok, greedy, pool, group_size=2, width=WIDTH,
                                   env_config=ENV, mesh=mesh, cache_turns=cached)
            assert w.lockstep and w.cache_turns == cached
            g = w.generate(variables, d["shares"][me], jax.random.key(0), pad_to=2)
            out[cached] = {"completions": g.completions, "target_mask": g.target_mask,
                           "rewards": g.rewards, "turns": [x["turns"] for x in g.details]}
        w = AgentRolloutWorker(model, tok, _turn_sampling(tok), pool, group_size=2, width=WIDTH,
                               env_config=ENV, mesh=mesh)
        g = w.generate(_softened(variables), d["shares"][me], jax.random.key(3), pad_to=2)
        out["sampled"] = {"completions": g.completions, "target_mask": g.target_mask,
                          "rewards": g.rewards, "sampler_logp": g.sampler_logp}
    # a batch whose shares differ in kind (process 0 one-shot, process 1 multi-turn) is refused
    # on both, before any sampler program (which would wait for the other process forever)
    from rl.agent import RoutingWorker
    from rl.pipeline import RolloutWorker
    from sandbox.tasks import Task

    routing = RoutingWorker(RolloutWorker(model, tok, greedy, None, group_size=1,
                                          max_prompt_len=128, mesh=mesh), w)
    share = [Task(id="one-shot", family="python", prompt="1+1")] if me == 0 else d["tasks"][:1]
    try:
        routing.start(variables, share, jax.random.key(2))
    except ValueError as e:
        assert "different task kinds" in str(e), e
    else:
        raise AssertionError("a batch of mixed kinds across processes was accepted")
    prompts, lens = _refill_prompts(tok, d["tasks"])
    mine = slice(4 * me, 4 * me + 4)
    r = Sampler(model, _turn_sampling(tok), mesh=mesh).generate(
        _softened(variables), prompts[mine], lens[mine], jax.random.key(1), group_size=2,
        slots=2)
    out["refill"] = {k: shd.host_rows(getattr(r, k)) for k in ("tokens", "mask")}
    with open(tmp / f"out{me}.pkl", "wb") as f:
        pickle.dump(out, f)


if __name__ == "__main__":
    import sys

    _lockstep_process(sys.argv[1])
