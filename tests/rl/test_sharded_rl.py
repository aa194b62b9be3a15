"""The real RL train step and sampler on a mesh equal the single-device ones.

On 8 fake CPU devices, one step of `rl.train_step.make_train_step` (GRPO with the k3 KL to a
reference policy in the loss, TIS against rollout log-probs, sampled log-probs at temperature
0.8, the test model cut to a KDA layer and an MTP block with a DSA layer, MoE with expert
parallelism (all_to_all dispatch) in both)
on the meshes (data, fsdp, expert, tensor) = (2,2,2,1), (1,2,4,1), (2,1,2,2) gives
the loss, metrics, gradients, updated parameters, router state and optimizer state of the
single-device step (f32); the mesh step's state keeps the shardings the rules give (experts
over "expert", Adam moments like their parameters) and the old state is donated; greedy
rollouts of the sharded sampler (`rl.sampler.Sampler(mesh=...)`, KDA/DSA caches sharded over
the batch) equal the single-device ones token for token, and so do two `Sampler.extend` calls through one decode
cache laid out on the mesh (the agent's turn cache). The sampler's model is the test
preset's KDA + DSA trunk (MoE, all_to_all) with a DSA top-k of 8, so its 6-token greedy decode
over a 12-position cache crosses top-k: the first steps attend densely by the run-time choice
(model/layers/dsa.py RUNTIME_DENSE_DECODE), the later ones select, on every mesh.

bf16 parameters with the default numerics (an f32 master copy, f32 Adam moments) take the same
step on one device and on a mesh (the `master` child, ~15 s).

The gradients are read from the optimizer state: the step's optimizer is the real
`make_optimizer` (clipping + AdamW with the weight-decay mask) behind a transformation that
keeps the last gradient in its state, so one compiled step per mesh yields everything.

Multi-device work runs in child processes (`python tests/rl/test_sharded_rl.py CHILD ...`,
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before jax is imported): the
single-device reference and two mesh children (one mesh and the planner check; two meshes)
start at once; every child builds the same inputs (numpy), and the mesh children wait for the
reference's pickled results before comparing. Not covered here: more than one process (tests/rl/test_multihost.py),
micro-batches on a mesh (the split is tested against the full batch in
tests/rl/test_engine.py).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (data, fsdp, expert, tensor). Every one splits the batch 8 ways (the batch axes are data, fsdp
# and expert); pure data parallelism, (8,1,1,1), is tests/model/test_sharding.py's.
MESHES = [(2, 2, 2, 1), (1, 2, 4, 1), (2, 1, 2, 2)]
GROUPS = [MESHES[:1], MESHES[1:]]  # the first child also runs the planner check
N, P, L, G = 8, 6, 16, 6  # rows, prompt width, packed width, greedy tokens
TOL = dict(rtol=1e-5, atol=1e-5)  # f32; see _close


# =========================================================================== plumbing
def _env(devices: int = 8) -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count", "--_x")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    return env


def _run_child(*args, timeout=900) -> str:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *map(str, args)]
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"child {args} failed (rc {r.returncode}):\n--- stdout\n"
                             f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-8000:]}")
    return r.stdout


def _mesh_arg(meshes) -> str:
    return ";".join(",".join(map(str, m)) for m in meshes)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Runs the reference child and the mesh children at once (the mesh children compile and
    run, then wait for the reference's results to compare); {mesh: stdout or the child's
    failure}."""
    ref = tmp_path_factory.mktemp("sharded_rl") / "reference.pkl"
    with ThreadPoolExecutor(3) as ex:
        reference = ex.submit(_run_child, "reference", ref)
        futs = {tuple(g): ex.submit(_run_child, "meshes", ref, _mesh_arg(g)) for g in GROUPS}
        reference.result()
    out = {}
    for group, f in futs.items():
        try:
            text = f.result()
        except AssertionError as e:
            text = e
        for m in group:
            out[m] = text
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_rl_step_and_greedy_rollouts_on_mesh_equal_one_device(outcomes, mesh):
    text = outcomes[mesh]
    if isinstance(text, Exception):
        raise text
    assert f"OK step {mesh}" in text, text[-3000:]
    assert f"OK rollouts {mesh}" in text, text[-3000:]


def test_planner_matches_compiled_rl_step_memory(outcomes):
    """model/plan.py's per-device training memory for the tiny model on the eight_devices mesh
    (EP all_to_all, batch 8 x 64) is within 10% of XLA's memory analysis of the compiled real
    RL train step (arguments + temporaries + unaliased outputs), run by the first mesh child."""
    text = outcomes[MESHES[0]]
    if isinstance(text, Exception):
        raise text
    assert "OK planner" in text, text[-3000:]


def test_bf16_params_with_f32_master_copy_on_one_device_and_on_a_mesh():
    """bf16 parameters with the default numerics (optim.master_dtype="float32": an f32 master
    copy and f32 Adam moments) build their train state and take a real RL step on one device
    and on the (2,2,2,1) mesh of 8 fake devices: the master copy and both moments are f32 and
    laid out like their parameters, the parameters stay bf16 and are their master rounded, and
    the mesh step's master copy equals the single-device one (f32 sums in another order)."""
    out = _run_child("master")
    assert "OK master one device" in out and "OK master mesh" in out, out[-3000:]


# =========================================================================== children
def _setup():
    sys.path.insert(0, str(ROOT))
    from runtime.xla_env import configure_xla_env

    configure_xla_env(fast_compile=True)  # before jax is imported, as tests/conftest.py
    import jax

    cache = ROOT / ".cache" / "jax"
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_default_matmul_precision", "highest")


def _parts():
    """(model, algo, optimizer, sampling) of the test: every piece the real RL step has."""
    import jax
    import jax.numpy as jnp
    import optax
    from ml_collections import ConfigDict

    from configs import models
    from model.config import ModelConfig
    from model.transformer import Model
    from rl.algorithms import get_algorithm
    from rl.sampler import SamplingConfig
    from rl.train_step import make_optimizer

    # the test preset cut to one KDA layer + the MTP block (a DSA layer): every layer kind, MoE
    # (4 experts, top-2, shared expert) in both blocks, at 2/3 of the two-layer compile time
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.mtp.layer_kind = 1, "K", "D"
    c.moe.expert_parallel = "all_to_all"  # the shard_map dispatch under a mesh
    c.moe.router = "sigmoid"  # aux-free bias moves with the global expert counts
    model = Model(ModelConfig.from_dict(c))
    algo = get_algorithm("grpo", kl_placement="loss", kl_kind="k3", kl_coef=0.05, tis_cap=2.0)
    inner = make_optimizer(ConfigDict(dict(
        lr=1e-4, warmup_steps=1, total_steps=10, final_lr_frac=0.1, weight_decay=0.1, b1=0.9,
        b2=0.99, eps=1e-8, clip_norm=1.0)))

    def init(params):
        return jax.tree.map(jnp.zeros_like, params), inner.init(params)

    def update(g, state, params=None):
        u, s = inner.update(g, state[1], params)
        return u, (g, s)

    opt = optax.GradientTransformation(init, update)  # the real optimizer + the last gradient
    return model, algo, opt, SamplingConfig(max_new_tokens=8, temperature=0.8)


def _greedy():
    from rl.sampler import SamplingConfig

    return SamplingConfig(max_new_tokens=G, temperature=0.0, eos_id=-1)


def _sample_model():
    """The sampler's model: the test preset's trunk (a KDA and a DSA layer, MoE with
    all_to_all in both) with DSA top-k 8 < the 12-position cache (prompts <= P, G new tokens):
    prefill and the first decode steps fit top-k (dense at run time), the rest select."""
    from configs import models
    from model.config import ModelConfig
    from model.transformer import Model

    c = models.get_config("test")
    assert c.layer_pattern == "KD"
    c.moe.expert_parallel, c.moe.router = "all_to_all", "sigmoid"
    c.dsa.index_topk = 8
    assert P + 1 <= c.dsa.index_topk < P + G  # the longest row crosses top-k while decoding
    return Model(ModelConfig.from_dict(c))


def _extends(sampler, variables):
    """Two `Sampler.extend` calls through one decode cache (the agent's cached turns): the
    prompts from an empty cache, then per row its last generated token and two more (row 0 sits
    the second call out); greedy. -> host arrays (tokens and masks of both calls, the cache's
    final positions)."""
    import jax

    from model import sharding as shd
    prompts, plen, _ = _inputs()
    cache = sampler.new_cache(N, P + 2 * G + 4)
    first, cache = sampler.extend(variables, cache, prompts, plen, jax.random.key(4))
    last = shd.host_rows(first.tokens)[:, -1]
    new = np.stack([last, np.full(N, 7), np.arange(N) + 11], axis=1).astype(np.int32)
    lens = np.full(N, 3, np.int32)
    lens[0] = 0
    second, cache = sampler.extend(variables, cache, new, lens, jax.random.key(5))
    return {k: shd.host_rows(v) for k, v in dict(
        first=first.tokens, first_mask=first.mask, second=second.tokens,
        second_mask=second.mask, positions=cache["lengths"]).items()}


def _inputs():
    """Prompts [N,P] (+ lengths) and one packed RL batch, from numpy only (every child builds
    the same): old log-probs near the random-init policy's (log 1/259, so ratios sit near 1 and
    the clip leaves most tokens their gradient), a reference and the sampler's log-probs around
    them (the KL and TIS terms are not trivial)."""
    from rl.sampler import pack

    rng = np.random.default_rng(0)
    plen = rng.integers(2, P + 1, N).astype(np.int32)
    prompts = np.where(np.arange(P)[None] < plen[:, None], rng.integers(3, 250, (N, P)), 0)
    prompts = prompts.astype(np.int32)
    comps = rng.integers(3, 250, (N, L - P)).astype(np.int32)
    cmask = np.arange(L - P)[None] < rng.integers(2, L - P + 1, (N, 1))
    tokens, mask = pack(prompts, plen, comps, cmask, width=L)

    def around(x, sd):
        return np.where(mask, x + rng.normal(0, sd, x.shape), 0.0).astype(np.float32)

    old = around(np.full((N, L), -np.log(259.0)), 0.05)
    batch = {"tokens": tokens, "loss_mask": mask,
             "advantages": rng.normal(size=(N, 1)).astype(np.float32), "old_logp": old,
             "ref_logp": around(old, 0.3), "rollout_logp": around(old, 0.05)}
    return prompts, plen, batch


def child_reference(path):
    _setup()
    import jax
    import jax.numpy as jnp

    from rl.sampler import Sampler
    from rl.train_step import init_train_state, make_train_step

    model, algo, opt, sampling = _parts()
    variables = model.init(jax.random.key(0))
    prompts, plen, batch = _inputs()
    step = make_train_step(model, algo, opt, sampling=sampling, donate=False)
    new, met = step(init_train_state(variables, opt), {k: jnp.asarray(v) for k, v in
                                                        batch.items()})
    sm = _sample_model()
    sampler, sv = Sampler(sm, _greedy()), sm.init(jax.random.key(1))
    out = sampler.generate(sv, prompts, plen, jax.random.key(3))
    ext = _extends(sampler, sv)
    tmp = pathlib.Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(jax.device_get({"state": new, "metrics": met, "tokens": out.tokens,
                                    "rollout_mask": out.mask, "extends": ext}), f)
    tmp.rename(path)  # the mesh children wait for the complete file
    print("OK reference")


def _wait_for(path, timeout=900):
    import time

    path = pathlib.Path(path)
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"no reference result at {path} after {timeout} s")
        time.sleep(0.5)
    with open(path, "rb") as f:
        return pickle.load(f)


def _close(name, got, want, rtol=TOL["rtol"], atol=TOL["atol"]):
    import jax

    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    gl, wl = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(gl) == len(wl), f"{name}: {len(gl)} leaves vs {len(wl)}"
    worst = 0.0
    for p, g, w in zip(paths, gl, wl):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{name}{p}: {g.shape} vs {w.shape}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{name}{p}")
        if w.size:
            worst = max(worst, float(np.max(np.abs(g - w))))
    return worst


def child_meshes(path, meshes):
    _setup()
    import jax

    from model import sharding as shd
    from rl.sampler import Sampler
    from rl.train_step import init_train_state_sharded, make_train_step, train_state_shardings

    model, algo, opt, sampling = _parts()
    prompts, plen, host_batch = _inputs()
    sm = _sample_model()
    sample_vars = sm.init(jax.random.key(1))
    ref = None  # the reference child's results, read when the first comparison needs them
    import time

    for shape in [tuple(int(x) for x in m.split(",")) for m in meshes.split(";")]:
        t0 = time.perf_counter()
        mesh = shd.make_mesh(shape)
        sh = train_state_shardings(model, opt, mesh)
        variables = shd.init_sharded(model, jax.random.key(0), mesh)  # never whole anywhere
        state = init_train_state_sharded(variables, opt, sh)
        batch = shd.to_global(host_batch, mesh)
        assert batch["tokens"].sharding.spec == shd.batch_sharding(mesh, N).spec
        step = make_train_step(model, algo, opt, sampling=sampling, mesh=mesh)
        new, met = step(state, batch)
        assert state.params["layer_0"]["ffn"]["w_gate"].is_deleted()  # the state was donated
        # layout: experts over "expert" (and fsdp / tensor on their dims), moments alike
        w = new.params["layer_0"]["ffn"]["w_gate"]
        mu = new.opt_state[1][1][0].mu["layer_0"]["ffn"]["w_gate"]
        assert w.sharding == mu.sharding == sh.params["layer_0"]["ffn"]["w_gate"]
        E, D, F = w.shape
        assert w.addressable_shards[0].data.shape == (E // shape[2], D // shape[1],
                                                      F // shape[3])
        assert len(new.step.sharding.device_set) == 8  # scalars replicated
        ref = ref or _wait_for(path)
        want = ref["state"]
        errs = {"loss": _close("loss", met["loss"], ref["metrics"]["loss"]),
                "metrics": _close("metrics", met, ref["metrics"], rtol=1e-4, atol=1e-5),
                "grads": _close("grads", new.opt_state[0], want.opt_state[0]),
                "params": _close("params", new.params, want.params),
                "router_state": _close("router_state", new.router_state, want.router_state),
                "opt_state": _close("opt_state", new.opt_state[1], want.opt_state[1])}
        assert int(new.step) == 1 and int(new.skipped) == 0
        assert "router_dropped_frac" in met and "router_dropped_frac_max" in met
        print(f"OK step {shape} max abs errors " + " ".join(f"{k}={v:.1e}"
                                                             for k, v in errs.items())
              + f" ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
        sv = jax.device_put(sample_vars, shd.variables_shardings(  # (one init compile per child)
            shd.model_shardings(sm, mesh), sample_vars, mesh))
        sampler = Sampler(sm, _greedy(), mesh=mesh)
        out = sampler.generate(sv, prompts, plen, jax.random.key(3))
        assert out.tokens.sharding.spec == shd.batch_sharding(mesh, N).spec
        np.testing.assert_array_equal(shd.host_rows(out.tokens), ref["tokens"])
        np.testing.assert_array_equal(shd.host_rows(out.mask), ref["rollout_mask"])
        # the agent's turn cache: the decode cache laid out over the mesh between calls
        cache = sampler.new_cache(N, 16)
        assert cache["lengths"].sharding.spec == shd.batch_sharding(mesh, N).spec
        ext = _extends(sampler, sv)
        assert ext["positions"][0] == ref["extends"]["positions"][0] > 0  # row 0 sat out
        for k, v in ext.items():
            np.testing.assert_array_equal(v, ref["extends"][k], err_msg=f"extend {k}")
        print(f"OK rollouts {shape} ({time.perf_counter() - t0:.1f} s)")
    if meshes.startswith(",".join(map(str, MESHES[0]))):
        planner_vs_compiled()


def planner_vs_compiled():
    """The planner's train-step memory vs the compiled real RL step's (see the parent test)."""
    import jax
    import jax.numpy as jnp

    from configs import models
    from configs import rl as rl_configs
    from model import sharding as shd
    from model.config import ModelConfig
    from model.plan import per_device_plan
    from model.transformer import Model
    from rl.algorithms import algo_from_config
    from rl.train_step import (
        init_train_state,
        make_optimizer,
        make_train_step,
        train_state_shardings,
    )
    from train.run_plan import run_plan_from_config

    c = rl_configs.get_config("smoke_8dev")
    c.model = models.get_config("tiny")
    c.model.moe.expert_parallel = "all_to_all"
    cfg = ModelConfig.from_dict(c.model)
    model, opt = Model(cfg), make_optimizer(c.optim)
    mesh, rules = shd.mesh_from_config(c)
    sh = train_state_shardings(model, opt, mesh, rules)
    state = shd.sharded_abstract(jax.eval_shape(
        lambda: init_train_state(model.init(jax.random.key(0)), opt)), sh)
    n, length = 8, 64
    b = shd.batch_sharding(mesh, n, rules)

    def arr(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=b)

    batch = {"tokens": arr((n, length), jnp.int32), "loss_mask": arr((n, length), jnp.bool_),
             "advantages": arr((n, 1), jnp.float32), "old_logp": arr((n, length), jnp.float32),
             "ref_logp": arr((n, length), jnp.float32),
             "rollout_logp": arr((n, length), jnp.float32)}
    step = make_train_step(model, algo_from_config(c.rl.algo), opt, mesh=mesh, rules=rules,
                           state_shardings=sh)
    ma = step.lower(state, batch).compile().memory_analysis()
    xla = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
           - ma.alias_size_in_bytes)
    import dataclasses
    run = dataclasses.replace(run_plan_from_config(c), reference=False)  # not in the step
    plan = per_device_plan(cfg, c.sharding.mesh, batch=n, seq=length, rules=rules, run=run)
    ratio = plan["train"]["total"] / xla
    assert abs(ratio - 1) <= 0.10, (plan["train"]["total"], xla, ratio)
    print(f"OK planner {plan['train']['total']} bytes vs compiled {xla} (ratio {ratio:.3f})")


def child_master():
    """See test_bf16_params_with_f32_master_copy_on_one_device_and_on_a_mesh."""
    _setup()
    import dataclasses

    import jax
    import jax.numpy as jnp
    from ml_collections import ConfigDict

    from model import sharding as shd
    from model.transformer import Model
    from rl.train_step import (
        MasterCopyState,
        init_train_state,
        init_train_state_sharded,
        make_optimizer,
        make_train_step,
        train_state_shardings,
    )

    model, algo, _, sampling = _parts()
    # bf16 parameters, f32 compute: the two layouts' gradients then differ by f32 rounding only
    # (with bf16 compute, Adam's first step lr * g / |g| flips on gradients near 0)
    model = Model(dataclasses.replace(model.cfg, param_dtype="bfloat16", dtype="float32"))
    opt = make_optimizer(ConfigDict(dict(
        lr=1e-4, warmup_steps=1, total_steps=10, final_lr_frac=0.1, weight_decay=0.1, b1=0.9,
        b2=0.99, eps=1e-8, clip_norm=1.0, mu_dtype="float32", master_dtype="float32")))
    _, _, host_batch = _inputs()
    variables = model.init(jax.random.key(0))

    def check(state, where):
        assert isinstance(state.opt_state, MasterCopyState), type(state.opt_state)
        w = state.params["layer_0"]["ffn"]["w_gate"]
        m = state.opt_state.master["layer_0"]["ffn"]["w_gate"]
        adam = [s for s in jax.tree.leaves(state.opt_state.inner, is_leaf=lambda x: hasattr(
            x, "mu")) if hasattr(s, "mu")][0]
        mu, nu = (x["layer_0"]["ffn"]["w_gate"] for x in (adam.mu, adam.nu))
        assert w.dtype == jnp.bfloat16 and m.dtype == mu.dtype == nu.dtype == jnp.float32
        assert w.sharding == m.sharding == mu.sharding == nu.sharding, where
        np.testing.assert_array_equal(np.asarray(m.astype(jnp.bfloat16), np.float32),
                                      np.asarray(w, np.float32))
        return np.asarray(jax.device_get(state.opt_state.master["layer_0"]["ffn"]["w_gate"]))

    step = make_train_step(model, algo, opt, sampling=sampling, donate=False)
    one, met = step(init_train_state(variables, opt),
                    {k: jnp.asarray(v) for k, v in host_batch.items()})
    want = check(one, "one device")
    assert int(one.step) == 1 and np.isfinite(float(met["loss"]))
    print("OK master one device")

    mesh = shd.make_mesh((2, 2, 2, 1))
    sh = train_state_shardings(model, opt, mesh)
    state = init_train_state_sharded(shd.init_sharded(model, jax.random.key(0), mesh), opt, sh)
    step = make_train_step(model, algo, opt, sampling=sampling, mesh=mesh)
    new, met = step(state, shd.to_global(host_batch, mesh))
    got = check(new, "mesh")
    assert new.opt_state.master["layer_0"]["ffn"]["w_gate"].addressable_shards[0].data.shape[0] \
        == got.shape[0] // 2  # experts over "expert"
    assert int(new.step) == 1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    print(f"OK master mesh (max abs master difference {np.max(np.abs(got - want)):.1e})")


CHILDREN = {"reference": child_reference, "meshes": child_meshes, "master": child_master}

if __name__ == "__main__":
    CHILDREN[sys.argv[1]](*sys.argv[2:])
