"""The RL train step's speed choices keep its numbers (rl/train_step.py, train/rl.py,
train/rollouts.py, rl/pipeline.py).

Covered: old_logp="current" (no separate old-log-prob forward: old = stop_gradient of the step's
own log-probs) gives the loss, gradients, metrics and the updated parameters of the separate
pass (old_logp="batch"), with micro-batches and a sampling temperature, and the step's
sampler/trainer gap metrics equal build_train_batch's; the loop keeps the pass where old
log-probs are needed before the advantages (critic, KL in the reward) or when asked to
(rl.old_logp_pass="always"), and the step rejects a batch that contradicts its mode;
ref_logp="step" (the reference log-probs computed inside the train step from the reference
variables it is called with) gives the parameters and metrics of the separate reference forward
(ref_logp="batch"), with micro-batches, on a mesh too, and the loop takes it exactly where the KL
term is in the loss (rl.ref_logp_pass="auto"); the step rejects calls that contradict its mode;
rl.mtp_loss_weight scales exactly the MTP term and 0 drops it; the jitted prepare_advantages
equals the eager one; the reference variables share the policy's tree (one log-prob compile);
the loop's train step (on the mesh) compiles once for a batch shape, however many updates it
feeds its own output state back (benchmarks/train_step_compile.py measures that compile); the
programs compiled ahead on threads (train.rl.precompile_updates for the RL update of both row
kinds, train.sft.supervised_step for SFT's batch shapes) are the ones the first steps then run
(no compile there, and without them those steps do compile).
Not covered: the timings (benchmarks/rl_loop.py and the peer bench measure them).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import models
from configs import rl as configs_rl
from model import sharding as shd
from model.config import ModelConfig
from model.transformer import Model
from rl import losses
from rl.algorithms import get_algorithm, prepare_advantages
from rl.pipeline import _prepare_advantages_jit
from rl.sampler import SamplingConfig
from rl.train_step import (
    check_old_logp,
    check_ref_logp,
    init_train_state,
    init_train_state_sharded,
    make_logp_fn,
    make_optimizer,
    make_rl_loss,
    make_train_step,
    train_state_shardings,
)
from train.rollouts import old_logp_source, ref_logp_source
from train.run_config import RLConfig, RunConfig
from train.weights import reference_variables

N, L, P = 4, 24, 8


def _batch(model, variables, sampling, seed=1):
    """A packed batch with completions of different lengths, rollout log-probs off the
    trainer's (a real gap) and a reference off the policy (a real KL)."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, 200, (N, L)), jnp.int32)
    mask = np.zeros((N, L), bool)
    for i, end in enumerate((L, L - 3, L - 9, 14)):
        mask[i, P:end] = True
    mask = jnp.asarray(mask)
    old = make_logp_fn(model, sampling)(variables, tokens, mask)
    noise = lambda s: jnp.asarray(rng.normal(0, s, (N, L)), jnp.float32)
    return {"tokens": tokens, "loss_mask": mask,
            "advantages": jnp.asarray(rng.normal(size=(N, 1)), jnp.float32),
            "rollout_logp": jnp.where(mask, old + noise(0.05), 0.0),
            "ref_logp": jnp.where(mask, old + noise(0.1), 0.0)}, old


@contextlib.contextmanager
def _backend_compiles():
    """The XLA compiles inside the block: a list that gets one entry (seconds) per compile."""
    compiles = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _opt():
    return make_optimizer(ml_collections.ConfigDict(dict(
        lr=1e-2, warmup_steps=1, total_steps=10, final_lr_frac=1.0, weight_decay=0.0, b1=0.9,
        b2=0.99, eps=1e-8, clip_norm=1.0)))


def test_current_old_logp_equals_the_separate_pass(small_lm):
    model, variables = small_lm
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=20)
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.05, tis_cap=2.0)
    batch, old = _batch(model, variables, sampling)
    counts = losses.agg_counts(batch["loss_mask"])
    tcounts = {"next": jnp.sum(batch["loss_mask"][:, 1:]).astype(jnp.float32),
               "mtp": jnp.zeros((0,), jnp.float32)}
    trainable = (variables["params"], None)
    rs = variables.get("router_state", {})

    def value_and_grad(mode, mb):
        fn = make_rl_loss(model, algo, sampling=sampling, old_logp=mode)
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(trainable, rs, mb, counts, tcounts)

    (l_b, (m_b, _, _)), g_b = value_and_grad("batch", {**batch, "old_logp": old})
    (l_c, (m_c, _, _)), g_c = value_and_grad("current", batch)
    assert abs(float(m_b["tis_weight_mean"]) - 1.0) > 1e-3  # the TIS weight is in play
    np.testing.assert_allclose(float(l_c), float(l_b), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    for k in ("pg_loss", "kl_loss", "tis_weight_mean", "logp_gap_abs", "logp_gap_max"):
        np.testing.assert_allclose(float(m_c[k]), float(m_b[k]), rtol=1e-5, atol=1e-7)

    # the whole step (2 micro-batches, one update): same parameters after it, and the step's gap
    # metrics are the separate pass's (what build_train_batch logs). Plain SGD: Adam's first
    # step is lr * g / (|g| + eps), which turns rounding-level gradient differences on
    # near-zero gradients into update differences of up to lr (seen once: 7e-6 at lr 1e-2)
    opt = optax.sgd(1e-2)
    out = {}
    for mode, b in (("batch", {**batch, "old_logp": old}), ("current", batch)):
        step = make_train_step(model, algo, opt, micro_batches=2, sampling=sampling,
                               donate=False, old_logp=mode)
        out[mode] = step(init_train_state(variables, opt), b)
    (s_b, _), (s_c, met_c) = out["batch"], out["current"]
    for a, b in zip(jax.tree.leaves(s_c.params), jax.tree.leaves(s_b.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    m = np.asarray(batch["loss_mask"])
    gap = np.abs(np.asarray(old) - np.asarray(batch["rollout_logp"]))[m]
    assert float(met_c["logp_gap_abs"]) == pytest.approx(float(gap.mean()), rel=1e-4)
    assert float(met_c["logp_gap_max"]) == pytest.approx(float(gap.max()), rel=1e-4)

    # a batch that contradicts the step's mode is an error, not silently used or dropped
    with pytest.raises(ValueError, match="holds old_logp"):
        make_train_step(model, algo, opt, donate=False, old_logp="current")(
            init_train_state(variables, opt), {**batch, "old_logp": old})
    with pytest.raises(ValueError, match="has no old_logp"):
        make_train_step(model, algo, opt, donate=False)(init_train_state(variables, opt), batch)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_step_ref_logp_equals_the_separate_pass(small_lm, on_mesh):
    """The train step that takes the reference log-probs itself (ref_logp="step", per
    micro-batch, from the reference variables) ends at the parameters and metrics of the step fed
    the separate forward's ref_logp (ref_logp="batch"); the reference differs from the policy, so
    the KL term is live. On a mesh its reference variables come in with the model's shardings."""
    model, variables = small_lm
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, top_k=20)
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.5)
    batch, _ = _batch(model, variables, sampling)
    batch.pop("ref_logp")
    ref_params = jax.tree.map(lambda x: x * 0.9, variables["params"])
    mesh = shd.make_mesh(devices=jax.devices()[:1]) if on_mesh else None
    opt = optax.sgd(1e-2)  # plain SGD: see test_current_old_logp_equals_the_separate_pass

    def state():
        if mesh is None:
            return init_train_state(variables, opt)
        return init_train_state_sharded(variables, opt, train_state_shardings(model, opt, mesh))

    st = state()
    ref_vars = reference_variables({"params": ref_params}, st)
    glob = (lambda b: shd.to_global(b, mesh)) if mesh is not None else (lambda b: b)
    ref_logp = make_logp_fn(model, sampling, mesh=mesh)(ref_vars, *(
        glob((batch["tokens"], batch["loss_mask"]))))
    out = {}
    for mode, b, args in (("batch", {**batch, "ref_logp": ref_logp}, ()),
                          ("step", batch, (ref_vars,))):
        step = make_train_step(model, algo, opt, micro_batches=2, sampling=sampling,
                               donate=False, old_logp="current", ref_logp=mode, mesh=mesh)
        out[mode] = step(state(), glob(b), *args)
    (s_b, m_b), (s_s, m_s) = out["batch"], out["step"]
    assert float(m_b["kl_ref"]) > 1e-4  # the reference is not the policy: the KL term is in play
    for k in ("loss", "kl_ref", "kl_loss", "pg_loss", "grad_norm"):
        np.testing.assert_allclose(float(m_s[k]), float(m_b[k]), rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s_s.params), jax.tree.leaves(s_b.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # calls that contradict the step's mode are errors, not silently used or dropped
    in_step = make_train_step(model, algo, opt, donate=False, old_logp="current",
                              ref_logp="step")
    with pytest.raises(ValueError, match="computes reference log-probs"):
        in_step(init_train_state(variables, opt), batch)  # no reference variables
    with pytest.raises(ValueError, match="computes reference log-probs"):
        in_step(init_train_state(variables, opt), {**batch, "ref_logp": ref_logp}, ref_vars)
    with pytest.raises(ValueError, match="ref_logp='batch'"):
        make_train_step(model, algo, opt, donate=False, old_logp="current")(
            init_train_state(variables, opt), {**batch, "ref_logp": ref_logp}, ref_vars)


def test_ref_logp_in_the_step_exactly_where_the_kl_is_in_the_loss():
    auto = ml_collections.ConfigDict(dict(ref_logp_pass="auto"))
    assert ref_logp_source(auto, get_algorithm("grpo")) == "step"  # KL in the loss
    assert ref_logp_source(auto, get_algorithm("ppo", kl_placement="loss")) == "step"
    # KL in the loss at weight 0: the reference forward still runs for its metric (kl_ref)
    assert ref_logp_source(auto, get_algorithm("grpo", kl_coef=0.0)) == "step"
    for algo in (get_algorithm("rloo"), get_algorithm("ppo"),  # KL in the reward: before
                 get_algorithm("dapo", max_len=48, overlong_cache_len=8)):  # no KL term
        assert ref_logp_source(auto, algo) == "batch"
        with pytest.raises(ValueError, match="no KL term in its loss"):
            check_ref_logp(algo, "step")
    separate = ml_collections.ConfigDict(dict(ref_logp_pass="separate"))
    assert ref_logp_source(separate, get_algorithm("grpo")) == "batch"
    assert ref_logp_source(RLConfig(), get_algorithm("grpo")) == "step"  # the default
    d = configs_rl.get_config("smoke").to_dict()
    d["rl"]["ref_logp_pass"] = "fused"
    with pytest.raises(ValueError, match="rl.ref_logp_pass must be one of"):
        RunConfig.from_config(d)
    with pytest.raises(ValueError, match="ref_logp must be"):
        check_ref_logp(get_algorithm("grpo"), "inline")


def test_train_step_compiles_once_per_batch_shape(small_lm):
    """Two updates on the mesh, the second fed the first's output state and another batch of the
    same shapes: one XLA compile in all (a state that comes back with another tree, dtype or
    sharding, e.g. a missing router_state key, would compile the step again every update)."""
    model, variables = small_lm
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7)
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.05)
    mesh = shd.make_mesh(devices=jax.devices()[:1])
    opt = optax.sgd(1e-2)
    batches = [shd.to_global(_batch(model, variables, sampling, seed)[0], mesh) for seed in (1, 2)]
    state = init_train_state_sharded(variables, opt, train_state_shardings(model, opt, mesh))
    step = make_train_step(model, algo, opt, sampling=sampling, old_logp="current", mesh=mesh)
    jax.block_until_ready((state, batches))
    with _backend_compiles() as compiles:
        for b in batches:
            state, met = step(state, b)
        jax.block_until_ready(state)
    assert int(state.step) == 2 and np.isfinite(float(met["loss"]))
    assert len(compiles) == 1, f"{len(compiles)} compiles for two updates of one batch shape"


def _scored_group(rows, group_size, prompt_len, gen_len, task, seed=0):
    """A scored group as a rollout worker returns it: prompts and completions of different
    lengths, sampled log-probs, rewards that differ within each group."""
    from rl.pipeline import ScoredGroup

    rng = np.random.default_rng(seed)
    pl = rng.integers(2, prompt_len + 1, rows).astype(np.int32)
    cmask = np.arange(gen_len)[None] < rng.integers(1, gen_len + 1, rows)[:, None]
    return ScoredGroup(
        tasks=[task] * rows, group_ids=np.arange(rows) // group_size,
        prompts=rng.integers(3, 200, (rows, prompt_len)).astype(np.int32), prompt_lengths=pl,
        completions=rng.integers(3, 200, (rows, gen_len)).astype(np.int32),
        completion_mask=cmask, sampler_logp=np.where(cmask, -rng.random((rows, gen_len)), 0.0),
        texts=[""] * rows, rewards=rng.random(rows).astype(np.float32),
        failed=np.zeros(rows, bool), details=[], gen_s=0.0,
        target_mask=(cmask & (rng.random((rows, gen_len)) < 0.7))
        if task.meta.get("domain") == "multistep" else None)


@pytest.mark.parametrize("ref_mode,ahead", [("step", "state"), ("batch", "state"),
                                            ("step", "abstract")])
def test_precompiled_updates_compile_nothing_at_the_first_update(small_lm, ref_mode, ahead):
    """train.rl.precompile_updates (the train step compiled on a thread while the first rollouts
    generate) compiles exactly the programs the real updates then use: after it, updates on
    real groups of both row kinds (one-shot and multi-turn, each at its own width) compile
    nothing, with the reference log-probs in the step or from the separate forward, and when it
    compiled from the state's abstract form (shapes and shardings, before the state exists, as
    run_rl starts it where the forward has nothing to run). Without it the same updates compile
    (the count is not vacuous)."""
    from sandbox.tasks.schema import Task
    from train.rl import precompile_updates, train_on_group
    from train.rollouts import RolloutForward

    model, variables = small_lm
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7)
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.05)
    mesh = shd.make_mesh(devices=jax.devices()[:1])
    opt = optax.sgd(1e-2)
    rows, group = 8, 4
    tasks = [Task(id="a", family="math", prompt="1+1", answer="2"),
             Task(id="b", family="terminal", prompt="ls", meta={"domain": "multistep"})]
    width = lambda ts: 40 if ts[0].meta.get("domain") == "multistep" else 24

    def updates(compiles: list, precompile: bool) -> tuple[int, int]:
        state = init_train_state_sharded(variables, opt,
                                         train_state_shardings(model, opt, mesh))
        ref = reference_variables(variables, state)  # on the mesh, as run_rl's initial weights
        ref = jax.device_put(ref, shd.variables_shardings(shd.model_shardings(model, mesh), ref,
                                                          mesh))
        forward = RolloutForward(logp_fn=make_logp_fn(model, sampling, mesh=mesh),
                                  logp_value_fn=None, ref_vars=ref, old_logp=False,
                                  ref_in_step=ref_mode == "step", mesh=mesh)
        step = make_train_step(model, algo, opt, sampling=sampling, old_logp="current",
                               ref_logp=ref_mode, mesh=mesh)
        kw = dict(algo=algo, width=width, forward=forward, step_fn=step, mesh=mesh, rules=None)
        jax.block_until_ready(state)
        compiles.clear()
        if precompile:
            target, fw = state, forward
            if ahead == "abstract":
                target = shd.sharded_abstract(jax.eval_shape(lambda: state),
                                              train_state_shardings(model, opt, mesh))
                fw = dataclasses.replace(forward, logp_fn=None, ref_vars=target.variables)
            precompile_updates(tasks, rows, group, target, **{**kw, "forward": fw}).result()
        before = len(compiles)
        for i, t in enumerate(tasks * 2):
            g = _scored_group(rows, group, 10 if t is tasks[0] else 6,
                              12 if t is tasks[0] else 30, t, seed=i)
            state, met, _ = train_on_group(g, state, **kw)
        assert int(state.step) == 4 and np.isfinite(met["loss"])
        return before, len(compiles) - before

    with _backend_compiles() as compiles:
        ahead, after = updates(compiles, precompile=True)
        _, cold = updates(compiles, precompile=False)
    assert ahead >= 2, f"precompile_updates compiled {ahead} programs (two train steps at least)"
    assert after == 0, f"{after} compiles in the updates after precompile_updates"
    assert cold >= 2, f"without precompile_updates the updates compiled {cold} programs"


def test_precompile_from_shapes_only_where_the_forward_has_nothing_to_run(small_lm):
    """precompile_updates refuses an abstract state when the rollout-time forward runs on the
    state's weights (here the separate reference pass): that forward needs the real state."""
    from train.rl import precompile_updates
    from train.rollouts import RolloutForward

    model, variables = small_lm
    mesh = shd.make_mesh(devices=jax.devices()[:1])
    opt = optax.sgd(1e-2)
    abstract = shd.sharded_abstract(
        jax.eval_shape(lambda: init_train_state(variables, opt)),
        train_state_shardings(model, opt, mesh))
    forward = RolloutForward(logp_fn=None, logp_value_fn=None, ref_vars=abstract.variables,
                              old_logp=False, ref_in_step=False, mesh=mesh)
    assert forward.runs and not dataclasses.replace(forward, ref_in_step=True).runs
    with pytest.raises(ValueError, match="pass the train state itself"):
        precompile_updates([], 8, 4, abstract, algo=None, width=24, forward=forward,
                           step_fn=None, mesh=mesh, rules=None)


@pytest.mark.parametrize("algo_name", ["grpo", "ppo"])
def test_abstract_rl_state_is_the_state_run_rl_creates(algo_name):
    """train.state.abstract_rl_state (what run_rl's update compiles against before the weights
    load) has init_rl_state's tree, shapes, dtypes and shardings, with a critic too."""
    from configs import rl as rl_configs
    from rl.algorithms import algo_from_config
    from train.state import abstract_rl_state, init_rl_state

    c = rl_configs.get_config("smoke")
    c.model.update(dict(num_layers=1, layer_pattern="D"))
    if algo_name == "ppo":
        c.rl.algo = rl_configs.get_config("ppo_tiny").rl.algo
    model, algo = Model(ModelConfig.from_dict(c.model)), algo_from_config(c.rl.algo)
    assert algo.needs_values == (algo_name == "ppo")
    mesh, rules = shd.mesh_from_config(c)
    c = RunConfig.from_config(c)
    state = init_rl_state(c, model, algo, model.init(jax.random.key(0)), mesh=mesh,
                          rules=rules)[0]
    abstract = abstract_rl_state(c, model, algo, mesh=mesh, rules=rules)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
        assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)


def test_supervised_steps_compiled_ahead_compile_nothing_at_their_first_steps(small_lm):
    """train.sft.supervised_step with a compiler pool (run_sft: the warm-up's and SFT's batch
    shapes compile on threads, SFT's while the warm-up trains) compiles exactly the programs
    the phase then runs: its steps on batches of both widths compile nothing more. Without
    the pool the same steps compile (the count is not vacuous)."""
    import concurrent.futures

    from train.sft import supervised_step

    model, variables = small_lm
    mesh = shd.make_mesh(devices=jax.devices()[:1])
    opt = optax.adamw(1e-3)
    shapes = [(4, 16), (2, 24)]
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(3, 200, (b, w)).astype(np.int32),
                "loss_mask": rng.random((b, w)) < 0.7} for b, w in shapes * 2]

    def run(compiles: list, ahead: bool) -> tuple[int, int]:
        state = init_train_state_sharded(variables, opt, train_state_shardings(model, opt, mesh))
        jax.block_until_ready(state)
        compiles.clear()
        pool = concurrent.futures.ThreadPoolExecutor(2) if ahead else None
        step = supervised_step(model, opt, variables, objective="lm", mesh=mesh, rules=None,
                               shapes=shapes, compiler=pool)
        for c in step.compiling:
            c.result()
        before = len(compiles)
        for b in batches:
            state, met = step.fn(state, shd.to_global(b, mesh))
        assert int(state.step) == 4 and np.isfinite(float(met["loss"]))
        return before, len(compiles) - before

    with _backend_compiles() as compiles:
        ahead, after = run(compiles, ahead=True)
        _, cold = run(compiles, ahead=False)
    assert ahead >= 2 and after == 0, (ahead, after)
    assert cold >= 2, f"without compiles ahead the steps compiled {cold} programs"


def test_old_logp_pass_kept_where_old_is_needed_before_the_advantages():
    r = ml_collections.ConfigDict(dict(old_logp_pass="auto"))
    assert old_logp_source(r, get_algorithm("grpo")) == "current"
    assert old_logp_source(r, get_algorithm("dapo", max_len=48, overlong_cache_len=8)) == "current"
    for name in ("ppo", "rloo"):  # critic values / KL in the reward need old first
        algo = get_algorithm(name, kl_placement="reward")
        assert old_logp_source(r, algo) == "batch"
        with pytest.raises(ValueError, match="before its advantages"):
            check_old_logp(algo, "current")
    always = ml_collections.ConfigDict(dict(old_logp_pass="always"))
    assert old_logp_source(always, get_algorithm("grpo")) == "batch"
    d = configs_rl.get_config("smoke").to_dict()
    d["rl"]["old_logp_pass"] = "never"
    with pytest.raises(ValueError, match="rl.old_logp_pass must be one of"):
        RunConfig.from_config(d)
    with pytest.raises(ValueError, match="old_logp must be"):
        check_old_logp(get_algorithm("grpo"), "fused")


def test_rl_mtp_loss_weight_scales_only_the_mtp_term():
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.d_model = 1, "K", 32
    c.moe.num_experts, c.moe.dense_dim = 0, 32
    c.mtp.update(dict(depth=1, loss_weight=0.3, layer_kind="K"))
    model = Model(ModelConfig.from_dict(c))
    variables = model.init(jax.random.key(0))
    batch, old = _batch(model, variables, None)
    batch["old_logp"] = old
    algo = get_algorithm("grpo", kl_placement="loss", kl_coef=0.05)
    counts = losses.agg_counts(batch["loss_mask"])
    m = batch["loss_mask"].astype(jnp.float32)
    tcounts = {"next": jnp.sum(m[:, 1:]), "mtp": jnp.stack([jnp.sum(m[:, 2:])])}
    no_mtp = dict(tcounts, mtp=jnp.zeros((0,), jnp.float32))
    res = {}
    for w in (None, 0.5, 0.0):
        fn = make_rl_loss(model, algo, mtp_loss_weight=w)
        res[w] = jax.jit(fn)((variables["params"], None), variables.get("router_state", {}), batch,
                             counts, no_mtp if w == 0.0 else tcounts)
    (l0, (m0, _, _)), (l5, (m5, _, _)), (ld, (md, _, _)) = res[0.0], res[0.5], res[None]
    assert "mtp_ce" not in m0 and float(m5["mtp_ce"]) > 1.0
    np.testing.assert_allclose(float(l5) - float(l0), 0.5 * float(m5["mtp_ce"]), rtol=1e-4)
    np.testing.assert_allclose(float(ld) - float(l0), 0.3 * float(md["mtp_ce"]), rtol=1e-4)
    with pytest.raises(ValueError, match=">= 0"):
        make_rl_loss(model, algo, mtp_loss_weight=-1.0)


@pytest.mark.parametrize("name,extra", [
    ("dapo", dict(max_len=20, overlong_cache_len=4)),  # dynamic sampling + overlong shaping
    ("rloo", dict(kl_placement="reward")),  # KL folded into token rewards
])
def test_jitted_prepare_advantages_equals_eager(name, extra):
    algo = get_algorithm(name, **extra)
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, 8).astype(np.float32)
    rewards[:4] = 1.0  # group 0: all equal (dynamic sampling drops it)
    mask = np.zeros((8, 24), bool)
    for i in range(8):
        mask[i, 4:4 + int(rng.integers(1, 20))] = True
    kw = dict(group_ids=np.repeat(np.arange(2), 4), lengths=mask.sum(1))
    if algo.kl_placement == "reward":
        kw["kl"] = np.where(mask, rng.normal(0, 0.1, mask.shape), 0.0).astype(np.float32)
    eager = prepare_advantages(algo, jnp.asarray(rewards), jnp.asarray(mask),
                               **{k: jnp.asarray(v) for k, v in kw.items()})
    jitted = _prepare_advantages_jit(algo, rewards, mask, **kw)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert np.asarray(eager.keep).sum() < 8 if name == "dapo" else True


def test_reference_variables_share_the_policy_tree(small_lm):
    model, variables = small_lm
    state = init_train_state(variables, _opt())
    ref = reference_variables({"params": variables["params"]}, state)  # no router_state key
    assert jax.tree.structure(ref) == jax.tree.structure(state.variables)
    logp_fn = make_logp_fn(model)
    tokens = jnp.full((2, 8), 5, jnp.int32)
    mask = jnp.ones((2, 8), bool)
    logp_fn(state.variables, tokens, mask)
    logp_fn(ref, tokens, mask)
    assert logp_fn._cache_size() == 1  # one program for the policy and the reference
    with pytest.raises(ValueError, match="lack"):
        reference_variables({}, state)


def test_host_digests_equal_the_device_program():
    from rl import checkpoint as ck

    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
          jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16),
          jnp.asarray(rng.integers(-100, 100, (2, 3, 4)), jnp.int8),
          jnp.asarray(rng.integers(0, 2, (5,)), bool),
          jnp.asarray(rng.normal(size=(4, 4)), jnp.float16),
          jnp.asarray(rng.integers(0, 255, (9,)), jnp.uint8),
          jnp.asarray(12345, jnp.int32),                  # 0-d
          np.arange(6, dtype=np.int64).reshape(2, 3)]    # numpy, canonicalised like jnp
    device = [np.asarray(d) for d in jax.device_get(ck._tree_digests(list(xs)))]
    for x, d in zip(xs, device):
        w = ck._host_words(x)
        assert w is not None, x.dtype
        np.testing.assert_array_equal(ck._host_digest(w), d)
    assert ck._host_words(jax.random.key(0)) is None  # keys: the device program
    assert ck._host_words(jnp.asarray([1, 2], jnp.int4)) is None  # sub-byte: widened on device
    got = ck._digests(xs + [jax.random.key(3)])  # mixed: host and device, order kept
    for a, b in zip(got[:-1], device):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[-1], np.asarray(ck._tree_digests([jax.random.key(3)])[0]))


def test_init_sharded_on_one_device_reuses_the_model_init_program(small_lm):
    from model import sharding as shd
    from model.transformer import _INIT_PROGRAMS

    model, variables = small_lm
    mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    v = shd.init_sharded(model, jax.random.key(0), mesh)
    for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = shd.model_shardings(model, mesh)
    for a, s in zip(jax.tree.leaves(v), jax.tree.leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    assert _INIT_PROGRAMS[(model.cfg, 8, True)]._cache_size() == 1  # one init compile for both
