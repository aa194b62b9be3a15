"""rl/checkpoint.py: round trip (state, rng, data position, ref params, meta), restoring a middle
one of several steps, pruning, corruption fallback, interrupted saves (a real SIGKILL mid-save),
target mismatch errors, ref pointers."""

import gc
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    RefPointer,
    load_params,
)
from rl.train_step import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOG = "rl.checkpoint"

# When one array read of a corrupted step fails, orbax leaves its sibling read coroutines to be
# garbage-collected with their exceptions unretrieved ("Exception ignored in coroutine
# _read_array_index_and_device_put"); pytest reports those as unraisable-exception warnings.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_orbax_leftovers():
    yield
    gc.collect()  # inside the test's warning filter, not at interpreter exit


def make_state(seed=0, updates=2):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"dense": {"kernel": jax.random.normal(k1, (48, 32)), "bias": jnp.zeros(32)},
              "emb": jax.random.normal(k2, (16, 8)).astype(jnp.bfloat16),
              "codes": jnp.arange(10, dtype=jnp.int8)}
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    for i in range(updates):  # a non-trivial optimizer state (moments, count)
        grads = jax.tree.map(lambda p, c=i + 1: (jnp.ones_like(p) * c).astype(p.dtype)
                             if jnp.issubdtype(p.dtype, jnp.floating) else jnp.zeros_like(p),
                             params)
        upd, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, upd)
    return TrainState(params=params, router_state={"layer_0": {"bias": jnp.full(4, 0.5)}},
                      opt_state=opt_state, step=jnp.int32(updates), skipped=jnp.int32(1))


def data_iter():
    return iter(grain.MapDataset.range(100).shuffle(seed=7).batch(4).to_iter_dataset())


def tree_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def save_steps(d, steps, *, keep=5, it=None, **kw):
    ck = Checkpointer(d, keep=keep, **kw)
    for s in steps:
        if it is not None:
            next(it)
        assert ck.save(s, make_state(seed=s), rng=jax.random.key(s), data_iter=it,
                       meta={"pos": s})
    ck.close()


def abstract():
    return jax.eval_shape(make_state)


def test_round_trip_state_rng_data_ref_meta(tmp_path):
    state = make_state(seed=1)
    ref = make_state(seed=2).params
    rng = jax.random.fold_in(jax.random.key(42), 3)
    it, ref_it = data_iter(), data_iter()
    for _ in range(3):
        np.testing.assert_array_equal(next(it), next(ref_it))
    expected_state = jax.device_get(state)
    meta = {"config": {"lr": 1e-4, "layers": [1, 2]}, "data_position": 3,
            "np_scalar": np.float32(0.5)}

    ck = Checkpointer(tmp_path, keep=3, async_save=True)
    assert ck.save(7, state, rng=rng, data_iter=it, ref_params=ref, meta=meta)
    # The train step donates its state: the arrays may die as soon as save() returns.
    for x in jax.tree.leaves(state):
        x.delete()
    ck.close()
    assert ck.latest_step() == 7
    uninterrupted = [next(ref_it) for _ in range(5)]

    ck2 = Checkpointer(tmp_path)
    it2 = data_iter()
    restored = ck2.restore_latest(jax.eval_shape(make_state), data_iter=it2)
    assert restored.step == 7
    st, rng2, meta2, ref2 = restored
    assert isinstance(st, TrainState)
    tree_equal(st, expected_state)
    tree_equal(ref2, ref)
    assert jax.dtypes.issubdtype(rng2.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(rng2), jax.random.key_data(rng))
    np.testing.assert_array_equal(jax.random.normal(rng2, (3,)), jax.random.normal(rng, (3,)))
    assert meta2 == {"config": {"lr": 1e-4, "layers": [1, 2]}, "data_position": 3,
                     "np_scalar": 0.5}
    for want in uninterrupted:
        np.testing.assert_array_equal(next(it2), want)
    ck2.close()


def test_raw_key_no_ref_no_data_and_empty_dir(tmp_path):
    ck = Checkpointer(tmp_path / "a")
    assert ck.restore_latest(abstract()) is None
    key = jax.random.PRNGKey(5)  # raw uint32[2] key
    assert ck.save(0, make_state(), rng=key)
    ck.wait()
    st, rng, meta, ref = ck.restore_latest(abstract())
    assert rng.dtype == jnp.uint32
    np.testing.assert_array_equal(rng, key)
    assert ref is None and meta == {}
    tree_equal(st, make_state())
    with pytest.raises(TypeError, match="not JSON"):
        ck.save(1, make_state(), rng=key, meta={"bad": object()}, force=True)
    ck.close()


def test_keep_prunes_save_every_and_force(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, save_every=2)
    state = make_state()
    saved = [s for s in range(1, 9) if ck.save(s, state, rng=jax.random.key(s))]
    assert saved == [2, 4, 6, 8]
    assert ck.save(9, state, rng=jax.random.key(9), force=True)
    assert not ck.save(9, state, rng=jax.random.key(9), force=True)  # never rewritten
    ck.wait()
    assert ck.all_steps() == [8, 9]
    ck.close()
    on_disk = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())
    assert on_disk == ["8", "9"]


def test_restore_a_middle_step_of_several(tmp_path):
    """Steps 1..3 with distinct data positions (1, 3, 6 batches consumed), states, rngs and
    metas: restoring step 2 gives step 2's of each (not the latest's or the first's), and
    restore_latest step 3's."""
    it = data_iter()
    ck = Checkpointer(tmp_path, keep=5)
    consumed = 0
    for s in (1, 2, 3):
        for _ in range(s):
            next(it)
        consumed += s
        assert ck.save(s, make_state(seed=s), rng=jax.random.key(s), data_iter=it,
                       meta={"pos": consumed})
    ck.close()
    batches = list(data_iter())  # the uninterrupted order

    ck = Checkpointer(tmp_path)
    it2 = data_iter()
    r = ck.restore(2, abstract(), data_iter=it2)
    assert r.step == 2 and r.meta == {"pos": 3}
    tree_equal(r.state, make_state(seed=2))
    np.testing.assert_array_equal(jax.random.key_data(r.rng),
                                  jax.random.key_data(jax.random.key(2)))
    np.testing.assert_array_equal(next(it2), batches[3])
    it3 = data_iter()
    latest = ck.restore_latest(abstract(), data_iter=it3)
    assert latest.step == 3 and latest.meta == {"pos": 6}
    np.testing.assert_array_equal(next(it3), batches[6])
    ck.close()


def _array_file(step_dir):
    files = list((step_dir / "state").glob("ocdbt.process_*/d/*"))
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir, d):
    f = _array_file(step_dir)
    os.truncate(f, f.stat().st_size // 2)


def _delete_array(step_dir, d):
    _array_file(step_dir).unlink()


def _flip_byte(step_dir, d):
    f = _array_file(step_dir)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def _swap_in_older_state(step_dir, d):  # well-formed files holding other values: digest only
    shutil.rmtree(step_dir / "state")
    shutil.copytree(d / "1" / "state", step_dir / "state")


def _delete_meta(step_dir, d):
    (step_dir / "meta" / "metadata").unlink()


def _delete_data_state(step_dir, d):
    for f in (step_dir / "data").glob("process_*.json"):
        f.unlink()


def _edit_meta(step_dir, d):  # still valid JSON, other content
    (step_dir / "meta" / "metadata").write_text('{"pos": 99}')


def _edit_data_position(step_dir, d):
    for f in (step_dir / "data").glob("process_*.json"):
        f.write_text('{"next_index": 40}')


def _truncate_manifest(step_dir, d):
    f = step_dir / "manifest" / "metadata"
    f.write_text(f.read_text()[:50])


def _empty_step_dir(step_dir, d):
    shutil.rmtree(step_dir)
    step_dir.mkdir()


@pytest.mark.parametrize("corrupt,reason", [
    (_truncate, ""), (_delete_array, ""), (_flip_byte, ""), (_swap_in_older_state, "digest"),
    (_delete_meta, ""), (_delete_data_state, ""), (_edit_meta, "meta digest"),
    (_edit_data_position, "data-iterator state digest"), (_truncate_manifest, ""),
    (_empty_step_dir, "")])
def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog, corrupt, reason):
    it = data_iter()
    save_steps(tmp_path, [1, 2], it=it)
    corrupt(tmp_path / "2", tmp_path)

    caplog.set_level(logging.WARNING, logger=LOG)
    ck = Checkpointer(tmp_path)
    it2 = data_iter()
    restored = ck.restore_latest(abstract(), data_iter=it2)
    assert restored.step == 1 and restored.meta == {"pos": 1}
    tree_equal(restored.state, make_state(seed=1))
    expected = data_iter()
    next(expected)
    np.testing.assert_array_equal(next(it2), next(expected))  # step 1's data position

    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    unusable = [m for m in msgs if "step 2" in m and "unusable" in m]
    assert unusable, msgs
    assert reason in unusable[0]
    moved = [m for m in msgs if "moved the bad one to" in m]
    assert moved and "corrupt" in moved[0], msgs
    kept = list((tmp_path / "corrupt").iterdir())
    assert [p.name.split(".")[0] for p in kept] == ["2"]  # kept for inspection, not deleted
    assert ck.all_steps() == [1] and ck.latest_step() == 1
    # The run resumes from step 1 and can write step 2 again.
    assert ck.save(2, restored.state, rng=restored.rng)
    ck.close()
    assert Checkpointer(tmp_path).restore_latest(abstract()).step == 2


def test_every_step_corrupt_raises_and_moves_nothing(tmp_path):
    save_steps(tmp_path, [1, 2])
    for s in ("1", "2"):
        _truncate(tmp_path / s, tmp_path)
    ck = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"step 2: .*step 1: .*Nothing was moved"):
        ck.restore_latest(abstract())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert not (tmp_path / "corrupt").exists()
    ck.close()


def test_unfinished_tmp_dir_is_ignored_reported_and_removed(tmp_path, caplog):
    save_steps(tmp_path, [1])
    fake = tmp_path / "5.orbax-checkpoint-tmp-1700000000"  # a writer died before committing
    (fake / "state").mkdir(parents=True)
    (fake / "state" / "_METADATA").write_text("{trunc")
    reader = Checkpointer(tmp_path, read_only=True)  # e.g. an evaluator on a live run
    assert reader.latest_step() == 1 and reader.restore_latest(abstract()).step == 1
    reader.close()
    assert fake.exists()  # a read-only reader never removes anything

    caplog.set_level(logging.WARNING, logger=LOG)
    ck = Checkpointer(tmp_path)
    assert any(fake.name in r.getMessage() and "unfinished" in r.getMessage()
               for r in caplog.records)
    assert ck.restore_latest(abstract()).step == 1
    assert ck.save(5, make_state(), rng=jax.random.key(0))  # the step can be written afresh
    ck.close()
    assert not fake.exists()
    assert Checkpointer(tmp_path).latest_step() == 5


CHILD = textwrap.dedent("""
    import os, signal, sys
    import grain, jax, jax.numpy as jnp
    from rl.checkpoint import Checkpointer
    ck = Checkpointer(sys.argv[1], keep=1)
    it = iter(grain.MapDataset.range(100).shuffle(seed=7).batch(4).to_iter_dataset())
    next(it)
    ck.save(1, {"w": jnp.arange(4096.0)}, rng=jax.random.key(1), data_iter=it, meta={"pos": 1})
    ck.wait()
    next(it)
    real_get_state = it.get_state
    def get_state():  # die when grain's orbax handler asks for the position, mid-save
        if "grain" in sys._getframe(1).f_code.co_filename:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_get_state()
    it.get_state = get_state
    ck.save(2, {"w": jnp.arange(4096.0) + 1}, rng=jax.random.key(2), data_iter=it)
    print("not reached")
""")


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, caplog):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    tmp_dirs = [p.name for p in tmp_path.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert tmp_dirs and tmp_dirs[0].startswith("2."), sorted(os.listdir(tmp_path))
    assert not (tmp_path / "2").exists() and (tmp_path / "1").is_dir()

    caplog.set_level(logging.WARNING, logger=LOG)
    ck = Checkpointer(tmp_path, keep=1)
    assert any(tmp_dirs[0] in r.getMessage() for r in caplog.records)
    it = data_iter()
    target = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    st, rng, meta, ref = ck.restore_latest(target, data_iter=it, abstract_ref=target)
    assert meta == {"pos": 1} and ref is None
    np.testing.assert_array_equal(st["w"], np.arange(4096.0))
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(1)))
    expected = data_iter()
    next(expected)
    np.testing.assert_array_equal(next(it), next(expected))
    assert ck.save(2, st, rng=rng, data_iter=it)
    ck.close()
    assert not any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())


def test_target_mismatch_is_a_clear_error(tmp_path):
    save_steps(tmp_path, [1, 2])
    ck = Checkpointer(tmp_path)
    a = abstract()
    bad_shape = a.replace(params={**a.params, "emb": jax.ShapeDtypeStruct((16, 9), jnp.bfloat16)})
    with pytest.raises(CheckpointMismatchError) as e:
        ck.restore_latest(bad_shape)
    msg = str(e.value)
    assert "step 2" in msg and ".params['emb']" in msg and "bfloat16[16,8]" in msg
    assert "bfloat16[16,9]" in msg
    bad_dtype = a.replace(step=jax.ShapeDtypeStruct((), jnp.float32))
    with pytest.raises(CheckpointMismatchError, match=r"\.step: checkpoint int32\[\] vs target "
                                                      r"float32\[\]"):
        ck.restore_latest(bad_dtype)
    extra = a.replace(router_state={**a.router_state, "new": jax.ShapeDtypeStruct((2,),
                                                                                 jnp.float32)})
    with pytest.raises(CheckpointMismatchError, match="not in the checkpoint.*new"):
        ck.restore_latest(extra)
    assert ck.all_steps() == [1, 2]  # a mismatch is not corruption: nothing moved
    ck.close()


def test_ref_params_by_pointer(tmp_path):
    sft = tmp_path / "sft"
    sft_state = make_state(seed=11)
    with Checkpointer(sft) as ck:
        ck.save(100, sft_state, rng=None)
    rl = tmp_path / "rl"
    ck = Checkpointer(rl, ref_source=str(sft))  # newest step of the SFT run, by pointer
    assert ck.ref_source == RefPointer(directory=str(sft), step=100)
    with pytest.raises(ValueError, match="pointer"):
        ck.save(1, make_state(), rng=None, ref_params=sft_state.params)
    assert ck.save(1, make_state(), rng=None)
    ck.close()
    assert not (rl / "1" / "ref_params").exists()  # nothing duplicated
    st, rng, meta, ref = Checkpointer(rl).restore_latest(abstract())
    assert rng is None
    tree_equal(ref, sft_state.params)
    tree_equal(load_params(sft, jax.eval_shape(lambda: sft_state.params)), sft_state.params)

    # A pointer into the run's own directory pins that step against pruning.
    own = tmp_path / "own"
    ck = Checkpointer(own, keep=1, ref_source=RefPointer(str(own), step=0))
    for s in range(4):
        ck.save(s, make_state(seed=s), rng=None)
    ck.wait()
    assert ck.all_steps() == [0, 3]
    restored = ck.restore_latest(abstract())
    tree_equal(restored.ref_params, make_state(seed=0).params)
    ck.close()
