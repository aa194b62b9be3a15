"""Multi-process pieces of the RL loop, on two local processes joined by jax.distributed (gloo
collectives over 4 fake CPU devices each, one (data 2, fsdp 2, expert 2) mesh across both):

* each process's share of a global batch (rl.pipeline.host_prompt_slice) and the global array
  assembled from every process's rows (model.sharding.to_global), reduced by a MeshJit program
  (compiled, then a barrier, then run, with donation), and this process's rows back
  (host_rows); a sum over the data axis, one participant on each process, is x0 + x1 bit for
  bit (what one process gives: the layout scripts/multihost_check.py compares bit for bit);
* the advantages of a batch over both processes' rows (rl.pipeline.batch_advantages):
  REINFORCE++-baseline's batch std and the advantage metrics equal one process's over all rows;
* host-side metrics reduced over processes (reduce_host_metrics: mean / max / sum by key, keys
  only some processes report) and a JSON gather (allgather_json);
* the Checkpointer saving a sharded state with rng and the data-iterator position from both
  processes and restoring it into its shardings on both; then this (single-device) process
  restores the same checkpoint: equal values, equal tree digests (rl.checkpoint.tree_digest)
  across processes and meshes;
* replica_mismatches: agrees when replicas agree, and names the slice when one device's replica
  of a "replicated" array was made to differ (a silent divergence);
* the start-up config agreement (train.launch.config_agreement): the same config passes, a config
  that differs on one process stops both, naming the differing fields and the processes; a data
  stream that ends on one process ends both at the same step (train.phase.next_global_batch);
* per-process SFT input (train.sft.sft_stream with the mesh): each process reads only its rows
  of each global batch, and together they are the one-process stream's batches.

The full loop on two processes (scripts/train_rl.py, 3 RL steps, compared with one process) is
`python scripts/multihost_check.py` (3 to 4.5 minutes: too slow for the suite; its last result
is in docs/scaling.md section 3).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _values():
    """The state both processes save: deterministic host values (shapes divisible by 8)."""
    return {"w": np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7.0,
            "e": np.arange(4 * 8 * 4, dtype=np.float32).reshape(4, 8, 4) - 3.0,
            "step": np.int32(2)}


def test_two_processes_share_batches_metrics_and_sharded_checkpoints(tmp_path, two_processes):
    outs = two_processes.finish(two_processes.start(__file__, tmp_path, devices=4))
    digests = [json.loads(so.strip().splitlines()[-1])["digest"] for so, _ in outs]
    assert digests[0] == digests[1]

    # this process (one device) restores what the two processes wrote
    import jax

    from rl.checkpoint import Checkpointer, tree_digest

    want = _values()
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          want)
    restored = ckpt.restore_latest(target)
    ckpt.close()
    assert restored is not None and restored.step == 2
    for k in want:
        np.testing.assert_array_equal(np.asarray(restored.state[k]), want[k])
    np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                  jax.random.key_data(jax.random.key(12)))
    assert tree_digest(restored.state) == digests[0]


# =========================================================================== worker
def worker(tmp):
    sys.path.insert(0, str(ROOT))
    from runtime.xla_env import configure_xla_env

    configure_xla_env(fast_compile=True)
    from model import sharding as shd

    assert shd.maybe_initialize_distributed()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rl.checkpoint import Checkpointer, tree_digest
    from rl.pipeline import host_prompt_slice, task_dataset

    me = jax.process_index()
    assert jax.process_count() == 2 and jax.device_count() == 8
    mesh = shd.make_mesh((2, 2, 2, 1))  # data across the two processes

    # -- batches: 4 prompts x 2 samples; process p holds prompts 2p, 2p+1 (rows 4p..4p+3)
    assert host_prompt_slice(4, 2, mesh) == slice(2 * me, 2 * me + 2)
    local = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + 100 * me  # my 4 rows
    g = shd.to_global(local, mesh)
    assert g.shape == (8, 3) and g.sharding.spec == P(("data", "fsdp", "expert"))
    total = shd.MeshJit(lambda x: (jnp.sum(x, axis=0), x * 2), mesh, in_shardings=(
        shd.batch_sharding(mesh, 8),), out_shardings=(shd.replicated(mesh),
                                                      shd.batch_sharding(mesh, 8)),
        donate_argnums=(0,), name="sum")
    s, doubled = total(g)
    want = np.concatenate([np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * p
                           for p in range(2)]).sum(0)
    np.testing.assert_array_equal(np.asarray(s), want)
    np.testing.assert_array_equal(shd.host_rows(doubled), local * 2)
    assert g.is_deleted()  # donated
    # a sum over processes with one participant on each (the data axis) is x0 + x1 bit for bit,
    # what one process's in-process all-reduce gives too; a sum over more participants runs as
    # gloo's ring (another addition order than one process's device order), which is why
    # scripts/multihost_check.py --devices 1 is the layout compared bit for bit
    rows = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    rows *= np.logspace(0, 4, 64, dtype=np.float32)  # magnitudes that round differently
    spec = P(("data", "fsdp", "expert"))
    x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, spec), lambda i: rows[i])
    over_data = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                                      in_specs=spec, out_specs=spec))(x)
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(over_data, tiled=True)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  np.tile(rows[:4] + rows[4:], (2, 1)).view(np.uint32))
    # the host share of a batch that splits a group is refused
    try:
        host_prompt_slice(3, 2, mesh=shd.make_mesh((2, 1, 1, 4)))
    except ValueError as e:
        assert "splits a group" in str(e)
    else:
        raise AssertionError("a group split over processes was accepted")

    # -- advantages over the global batch (rl.pipeline.batch_advantages): the rows of both
    # processes in one program, so REINFORCE++-baseline's batch std and the metrics are the
    # whole batch's, as on one process (each process's groups kept apart)
    from rl.algorithms import get_algorithm, prepare_advantages
    from rl.pipeline import batch_advantages

    rewards = np.array([0.0, 1.0, 1.0, 1.0, 0.0, 0.2, 0.9, 0.0], np.float32)  # process p: 4p..
    tmask = np.ones((8, 5), bool)
    tmask[1, 3:] = tmask[6, 2:] = False
    gids = np.array([0, 0, 1, 1] * 2)  # each process numbers its own groups
    mine = slice(4 * me, 4 * me + 4)
    for est in ("reinforce_baseline", "grpo"):
        algo = get_algorithm("grpo", estimator=est)
        got = batch_advantages(algo, rewards[mine], tmask[mine], group_ids=gids[mine], mesh=mesh)
        want = jax.device_get(prepare_advantages(algo, rewards, tmask,
                                                 group_ids=gids + np.repeat([0, 2], 4)))
        np.testing.assert_allclose(got.advantages, want.advantages[mine], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got.keep, want.keep[mine])
        for k, v in want.metrics.items():
            np.testing.assert_allclose(got.metrics[k], v, rtol=1e-6, err_msg=k)
        alone = jax.device_get(prepare_advantages(algo, rewards[mine], tmask[mine],
                                                  group_ids=gids[mine]))
        if est == "reinforce_baseline":  # one process's rows alone have another batch std
            assert not np.allclose(alone.advantages, want.advantages[mine])

    # -- host metrics
    met = {"reward_mean": float(me), "logp_gap_max": 1.0 + me, "sandbox_failed": 1.0}
    if me == 1:
        met["reward/code"] = 0.5
    red = shd.reduce_host_metrics(met)
    assert red == {"reward_mean": 0.5, "logp_gap_max": 2.0, "sandbox_failed": 2.0,
                   "reward/code": 0.5}, red
    assert shd.allgather_json({"p": me}) == [{"p": 0}, {"p": 1}]

    # -- sharded checkpoints written by both processes, restored on both
    vals = _values()
    sh = {"w": NamedSharding(mesh, P(("fsdp", "expert"))),
          "e": NamedSharding(mesh, P("expert", "fsdp")), "step": shd.replicated(mesh)}
    state = {k: jax.make_array_from_callback(np.shape(v), sh[k], lambda i, v=v: np.asarray(v)[i])
             for k, v in vals.items()}
    it = iter(task_dataset(list(range(10)), seed=0, batch_size=2))
    ckpt = Checkpointer(pathlib.Path(tmp) / "ckpt", keep=2)
    for step in (1, 2):
        batch = next(it)
        ckpt.save(step, state, rng=jax.random.key(10 + step), data_iter=it, force=True)
    ckpt.wait()
    after = next(it)
    it2 = iter(task_dataset(list(range(10)), seed=0, batch_size=2))
    target = shd.sharded_abstract(jax.eval_shape(lambda: state), sh)
    r = ckpt.restore_latest(target, data_iter=it2)
    ckpt.close()
    assert r.step == 2 and next(it2) == after and batch != after
    for k in vals:
        assert r.state[k].sharding == sh[k], (k, r.state[k].sharding)
        np.testing.assert_array_equal(multihost_utils.process_allgather(r.state[k], tiled=True),
                                      vals[k])
    digest = tree_digest(r.state)
    assert digest == tree_digest(state)

    # -- replicas: agree, then one device's replica of a replicated array is made to differ
    assert shd.replica_mismatches(r.state) == []
    devs = [d for d in mesh.devices.flat if d.process_index == me]
    bad_val = 1.0 if me == 1 else 0.0  # process 1's last device holds a different replica
    shards = [jax.device_put(np.full((4,), bad_val if (d is devs[-1]) else 0.0, np.float32), d)
              for d in devs]
    diverged = jax.make_array_from_single_device_arrays((4,), shd.replicated(mesh), shards)
    bad = shd.replica_mismatches({"bias": diverged})
    assert bad == ["['bias']((None, None),)"], bad

    # -- start-up agreement on the config, and a data stream that ends on one process
    import train.launch
    import train.phase
    import train.sft
    from configs import rl as rl_configs

    c = rl_configs.get_config("smoke_8dev")
    assert "the same on all 2 processes" in train.launch.config_agreement(c)
    if me == 1:
        c.seed, c.rl.steps = 5, 7
    try:
        train.launch.config_agreement(c)
    except ValueError as e:
        assert "rl.steps (4 on process(es) [0]; 7 on process(es) [1])" in str(e) and \
            "seed (0 on process(es) [0]; 5 on process(es) [1])" in str(e), str(e)
    else:
        raise AssertionError("different configs on the two processes were accepted")
    stream = iter(range(3 if me == 0 else 2))
    assert [train.phase.next_global_batch(stream, "test data", i) for i in range(2)] == [0, 1]
    try:
        train.phase.next_global_batch(stream, "test data", 2)
    except train.phase.DataExhausted as e:
        assert "process(es) [1] ended at step 2" in str(e), str(e)
    else:
        raise AssertionError("a stream that ended on process 1 did not end both")

    # -- per-process SFT input: this process's rows of each global batch, read by index
    from ml_collections import ConfigDict

    from model.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    examples = [(f"add {i} and 1", str(i + 1), True) for i in range(24)]
    s = ConfigDict(dict(seq_len=32, batch_size=8, episode_seq_len=None,
                        episode_batch_size=None, episode_share=None))
    mine = list(zip(range(3), train.sft.sft_stream(examples, tok, s, 0, mesh=mesh)))
    every = list(zip(range(3), train.sft.sft_stream(examples, tok, s, 0)))
    for (_, got), (_, full) in zip(mine, every):
        assert got["tokens"].shape == (4, 32)
        np.testing.assert_array_equal(got["tokens"], full["tokens"][4 * me:4 * me + 4])
    print(json.dumps({"digest": digest}))


if __name__ == "__main__":
    worker(sys.argv[1])
