"""Orbax checkpoints for the SFT and RL drivers: train state, rng, metadata, data position (and,
optionally, reference-policy params: the drivers store none, see below).

    ckpt = Checkpointer("runs/x/ckpt", keep=3, save_every=50)
    restored = ckpt.restore_latest(jax.eval_shape(lambda: state), data_iter=it)
    if restored is not None:
        state, rng, meta, ref_params = restored       # restored.step: the checkpoint's step
    for step in range(start, total):
        ...
        ckpt.save(step, state, rng=rng, data_iter=it, ref_params=ref, meta={"config": cfg})
    ckpt.close()                                      # waits for the last async save

One checkpoint is one orbax step directory `<directory>/<step>/` with the items
  state       the TrainState pytree (params, router_state, opt_state, step, skipped; a
              CriticTrainState adds the critic's value_params and value_opt_state)
  ref_params  the frozen reference-policy params (only when saved by copy, see below)
  rng         {"key_data": uint32 array} (typed keys go through jax.random.key_data)
  meta        the caller's JSON dict (config, data position, anything else)
  manifest    JSON written by this module: per-leaf path, shape, dtype and content digest of
              every array item, the rng key implementation, the reference-params pointer
  data        the grain iterator state (grain.checkpoint.CheckpointSave: one JSON per process)

Reference params (train/rl.py does not use them: its frozen reference policy is the initial
weights, reloaded on resume; tests/rl/test_checkpoint.py covers the feature): by default
(`ref_source=None`) they are saved by copy whenever `save` gets `ref_params`. With
`ref_source=RefPointer(dir, step, item, field)` (or a directory string) they are never written:
every checkpoint records the pointer and `restore_latest` loads them from it (`load_params`). A
pointer into this Checkpointer's own directory pins that step against pruning.

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it into place only
once every item is written (an atomic rename on local/POSIX file systems; a commit file on GCS),
and prunes old steps only after the new one is committed, so a process killed at any point of a
save (SIGKILL included) leaves the previous checkpoints intact. An unfinished tmp directory is
never read; the next Checkpointer on the directory logs a warning naming it and removes it.

Integrity: orbax alone does not detect flipped bytes in an array file (zstd frames carry no
checksum: the array is read back as garbage) and silently casts to the target dtype. Here every
saved array gets a 64-bit content digest (computed on device, jitted, per leaf) recorded in the
manifest and checked after restore, and the restore target's structure, shapes and dtypes are
checked against the manifest before anything is read; the JSON items (meta, the data-iterator
position, the manifest itself) carry sha256 digests too. `restore_latest` tries steps newest first:
a step that fails to restore (missing or truncated files, unreadable JSON, digest mismatch, empty
step directory...) is reported with a warning naming the step and the reason, and once an older
step restores cleanly each failed newer step is moved (never deleted) to
`<directory>/corrupt/<step>.<unix time>` with a second warning. If no step restores, it raises
`CheckpointError` listing every step and reason and moves nothing (a failure that hits every
step, e.g. out of memory, is not taken for corruption). A target that does not match the
checkpoint raises `CheckpointMismatchError` at once (an older step would not match either).

Multi-process: every process calls save/restore (orbax coordinates); fallback decisions are
agreed over processes and only process 0 moves or removes directories.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

from model.config import SPAN_NAME_RE

try:  # grain's orbax handler for its iterators (DESIGN section 6)
    import grain.checkpoint as _grain_ckpt
except ImportError:  # pragma: no cover - grain is a hard dependency of the project
    _grain_ckpt = None

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_TMP_MARK = ".orbax-checkpoint-tmp"
_CORRUPT_DIR = "corrupt"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a checkpoint that cannot be used as asked."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose content does not match what was saved (digest or manifest)."""


class CheckpointMismatchError(ValueError):
    """The restore target's structure, shapes or dtypes differ from the checkpoint's."""


class RefSourceError(CheckpointError):
    """The reference params a checkpoint points to could not be loaded."""


@dataclasses.dataclass(frozen=True)
class RefPointer:
    """Where reference params live: `<directory>/<step>/<item>`, subtree `field` (None: the item).

    step=None means the newest committed step of `directory` when the Checkpointer is built.
    """

    directory: str
    step: int | None = None
    item: str = "state"
    field: str | None = "params"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `restore_latest` returns; unpacks as `state, rng, meta, ref_params`."""

    state: Any
    rng: Any
    meta: dict
    ref_params: Any
    step: int

    def __iter__(self):
        return iter((self.state, self.rng, self.meta, self.ref_params))


# ---------------------------------------------------------------- content digests


def _fmix32(h):  # murmur3 finalizer on uint32 (wrapping arithmetic)
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_words(x):
    """The array's bits as uint32 words (exact; sub-byte types are widened losslessly first)."""
    dt = x.dtype
    if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
        dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return _as_words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    floating = jnp.issubdtype(dt, jnp.floating)
    bits = jnp.finfo(dt).bits if floating else jnp.iinfo(dt).bits
    if bits < 8:  # int4 / float4: widen exactly
        if floating:
            x, bits = x.astype(jnp.float32), 32
        else:
            x = x.astype(jnp.int8 if jnp.issubdtype(dt, jnp.signedinteger) else jnp.uint8)
            bits = 8
    if bits == 8:
        return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if bits == 16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if bits == 32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    if bits == 64:
        return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    raise TypeError(f"no digest for dtype {dt}")


def _leaf_digest(x):
    """Two wrapping uint32 sums: of the words, and of a position-keyed nonlinear mix of them."""
    w = _as_words(x)
    idx = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):  # row-major linear index without flattening (sharding)
        idx = idx + lax.broadcasted_iota(jnp.uint32, w.shape, d) * np.uint32(stride % (1 << 32))
        stride *= w.shape[d]
    h1 = jnp.sum(w, dtype=jnp.uint32)
    h2 = jnp.sum(_fmix32(w ^ _fmix32(idx + np.uint32(0x9E3779B9))), dtype=jnp.uint32)
    return jnp.stack([h1, h2])


def tree_digest(tree) -> str:
    """One sha256 hex string over every leaf's path, shape, dtype and content digest: equal
    for equal trees (bit for bit), whatever their shardings or the process count. Computed on
    device per leaf (sharded arrays are never gathered); every process must call it."""
    d = _describe(tree, digests=True)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


@jax.jit
def _tree_digests(xs: list):
    """[_leaf_digest(x) for x in xs] as ONE program: one dispatch for a whole tree. (One small
    program per leaf, dispatched asynchronously, deadlocked XLA:CPU's collectives on fake
    multi-device hosts: several all-reduce programs in flight starve its thread pool.)"""
    return [_leaf_digest(x) for x in xs]


def _host_words(x):
    """The uint32 words `_as_words` gives for x, in numpy, when x lives whole in host memory
    (a numpy array, or a jax array on one CPU device) and has a dtype of 8, 16 or 32 bits or
    bool; None otherwise (the device program digests it)."""
    if isinstance(x, jax.Array):
        if (len(x.sharding.device_set) != 1 or x.is_deleted()
                or next(iter(x.sharding.device_set)).platform != "cpu"):
            return None
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return None
    elif not isinstance(x, np.ndarray):
        return None
    dt = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))  # numpy inputs: what jnp would make
    if dt == np.bool_:
        return np.asarray(x, dt).astype(np.uint32)
    numeric = jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)
    if not numeric or dt.itemsize not in (1, 2, 4) or x.size >= 1 << 32:
        return None
    bits = jnp.finfo(dt).bits if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo(dt).bits
    if bits < 8:
        return None  # sub-byte types: the device path widens them
    a = np.ascontiguousarray(np.asarray(x, dt))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[dt.itemsize]).astype(np.uint32)


def _host_digest(w: np.ndarray) -> np.ndarray:
    """`_leaf_digest` on host words (numpy uint32, wrapping arithmetic): the same two sums."""
    idx = np.arange(w.size, dtype=np.uint32).reshape(w.shape)
    with np.errstate(over="ignore"):
        h1 = np.sum(w, dtype=np.uint32)
        h2 = np.sum(_fmix32(w ^ _fmix32(idx + np.uint32(0x9E3779B9))), dtype=np.uint32)
    return np.array([h1, h2], np.uint32)


def _digests(xs: list) -> list:
    """uint32[2] content digest of every array in xs (numpy). Arrays held whole in host memory
    (numpy, or on one CPU device) are digested in numpy (the same arithmetic, no compile: a
    device program per tree structure costs a compile each); the rest on device: one program for
    all of them; arrays committed to different device sets (which one program cannot take)
    are digested one at a time, each finished before the next starts."""
    if not xs:
        return []
    words = [_host_words(x) for x in xs]
    if any(w is not None for w in words):
        rest = [x for x, w in zip(xs, words) if w is None]
        dev = iter(_digests(rest))
        return [_host_digest(w) if w is not None else next(dev) for w in words]
    try:
        return [np.asarray(d) for d in jax.device_get(_tree_digests(list(xs)))]
    except ValueError as e:
        if "devices" not in str(e):
            raise
    return [np.asarray(jax.device_get(_tree_digests([x]))[0]) for x in xs]


def _dtype_name(dt) -> str:
    return str(dt) if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key) else jnp.dtype(dt).name


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _describe(tree, *, digests: bool) -> dict:
    """{keystr path: {shape, dtype, digest}} for every leaf of a pytree of arrays."""
    leaves = [(k, x if hasattr(x, "shape") else np.asarray(x)) for k, x in _leaves(tree)]
    ds = _digests([x for _, x in leaves]) if digests else [None] * len(leaves)
    return {k: {"shape": [int(s) for s in x.shape], "dtype": _dtype_name(x.dtype),
                "digest": None if d is None else [int(v) for v in np.asarray(d)]}
            for (k, x), d in zip(leaves, ds)}


def _verify(tree, described: dict, what: str):
    bad = []
    leaves = _leaves(tree)
    want = [described.get(k, {}).get("digest") for k, _ in leaves]
    todo = [i for i, w in enumerate(want) if w is not None]
    got = [None] * len(leaves)
    for i, d in zip(todo, _digests([leaves[i][1] for i in todo])):
        got[i] = d
    for (k, _), w, g in zip(leaves, want, got):
        if w is not None and [int(v) for v in np.asarray(g)] != list(w):
            bad.append(k)
    if bad:
        more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        raise CorruptCheckpointError(
            f"{what}: content digest mismatch in {len(bad)} of {len(leaves)} arrays: "
            f"{', '.join(bad[:5])}{more}")


def _fmt(shape, dtype) -> str:
    return f"{dtype}[{','.join(str(s) for s in shape)}]"


def _check_target(abstract, described: dict, what: str):
    """Raise CheckpointMismatchError unless `abstract` has exactly the checkpoint's leaves."""
    want = {k: (tuple(int(s) for s in x.shape), _dtype_name(x.dtype)) for k, x in _leaves(abstract)}
    have = {k: (tuple(v["shape"]), v["dtype"]) for k, v in described.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    diff = [f"{k}: checkpoint {_fmt(*have[k])} vs target {_fmt(*want[k])}"
            for k in sorted(want) if k in have and have[k] != want[k]]
    if not (missing or extra or diff):
        return
    parts = []
    if diff:
        parts.append(f"{len(diff)} leaves differ in shape/dtype: " + "; ".join(diff[:8])
                     + (f"; (+{len(diff) - 8} more)" if len(diff) > 8 else ""))
    if missing:
        parts.append(f"{len(missing)} target leaves not in the checkpoint: {missing[:8]}")
    if extra:
        parts.append(f"{len(extra)} checkpoint leaves not in the target: {extra[:8]}")
    spans = [any(SPAN_NAME_RE.search(k) for k in keys) for keys in (missing, extra)]
    if spans[0] != spans[1]:
        parts.append("the checkpoint and the target differ in model.scan_layers (stacked spans "
                     "'layers_<first>_<last>' against per-layer 'layer_<i>'): set "
                     f"model.scan_layers={spans[1]} as the checkpoint was written, or convert "
                     "its variables with model.transformer.stack_layers / unstack_layers")
    raise CheckpointMismatchError(f"{what} does not match the restore target: " + ". ".join(parts))


# ---------------------------------------------------------------- helpers


def _json_default(o):
    if isinstance(o, (np.generic,)):
        return o.item()
    if isinstance(o, (np.ndarray, jax.Array)):
        return np.asarray(o).tolist()
    if hasattr(o, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        return o.to_dict()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (pathlib.PurePath, epath.Path)):
        return os.fspath(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"checkpoint meta: {type(o).__name__} is not JSON-serialisable ({o!r:.80})")


def _to_json(obj) -> Any:
    return json.loads(json.dumps(obj, default=_json_default))


def _json_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _iter_state_json(data_iter):
    """The iterator position as grain's handler writes it (a dict, or JSON bytes for DataLoader)."""
    st = data_iter.get_state()
    return json.loads(st.decode() if isinstance(st, bytes | bytearray) else json.dumps(st))


def _data_file(step_dir: epath.Path) -> epath.Path:  # grain's per-process file name
    return step_dir / "data" / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def _seal(manifest: dict) -> dict:
    return {**manifest, "self_digest": _json_digest(manifest)}


def _unseal(manifest, where: str) -> dict:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where}: unreadable manifest")
    body = {k: v for k, v in manifest.items() if k != "self_digest"}
    if manifest.get("self_digest") != _json_digest(body):
        raise CorruptCheckpointError(f"{where}: manifest digest mismatch")
    return body


def _all_devices_replicated():
    """A sharding that replicates over every device of every process (multi-process jobs)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _abstract(tree):
    """ShapeDtypeStructs for a target given as abstract or concrete arrays; on a single-device
    process leaves without a sharding get that device, in a multi-process job they are
    replicated over every device (else orbax uses the saved sharding)."""
    single = jax.process_count() == 1 and jax.device_count() == 1
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if single else None
    if jax.process_count() > 1:
        dev = _all_devices_replicated()

    def f(x):
        sh = getattr(x, "sharding", None)
        if sh is None:
            sh = dev
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    return jax.tree.map(f, tree)


def _is_uri(p: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", p) is not None


def _path(p) -> epath.Path:
    s = os.fspath(p)
    return epath.Path(s if _is_uri(s) else os.path.abspath(s))


def _committed_steps(root: epath.Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def latest_committed_step(directory) -> int | None:
    """The newest committed step under a Checkpointer directory (a path or URI), read without
    opening a manager (nothing is created, cleaned or waited for); None when there is none."""
    steps = _committed_steps(_path(directory))
    return steps[-1] if steps else None


def _reason(e: BaseException) -> str:
    """One line: the error and, when chained, its root cause (tensorstore's status message)."""

    def line(x):
        m = str(x).split(" See full TensorStore details")[0].strip()
        m = m.splitlines()[0] if m else ""
        m = m if len(m) <= 300 else m[:300] + "..."
        return f"{type(x).__name__}: {m}" if m else type(x).__name__

    root, seen, c = None, {id(e)}, e.__cause__ or e.__context__
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        root, c = c, c.__cause__ or c.__context__
    return line(e) + (f" (caused by {line(root)})" if root is not None else "")


def _all_processes_ok(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _is_primary() -> bool:
    return jax.process_index() == 0


def _read_json_item(path: epath.Path):
    ck = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    try:
        return ck.restore(path, args=ocp.args.JsonRestore())
    finally:
        ck.close()


def _subtree(described: dict, field: str | None, what: str) -> dict:
    if field is None:
        return described
    for prefix in (f".{field}", f"['{field}']"):
        sub = {k[len(prefix):]: v for k, v in described.items()
               if k.startswith(prefix) and (len(k) == len(prefix) or k[len(prefix)] in ".[")}
        if sub:
            return sub
    raise CheckpointMismatchError(f"{what} has no field {field!r}")


def load_params(directory, abstract_params, *, step: int | None = None, item: str = "state",
                field: str | None = "params", verify: bool = True):
    """Restore one subtree (default: `state.params`) of a checkpoint written by Checkpointer,
    checked against `abstract_params` (shapes, dtypes) and against the saved digests.

    Reads only that subtree (orbax partial restore): the optimizer state is not loaded.
    """
    root = _path(directory)
    if step is None:
        steps = _committed_steps(root)
        if not steps:
            raise CheckpointError(f"no committed checkpoint in {root}")
        step = steps[-1]
    step_dir = root / str(step)
    what = f"checkpoint {step_dir} item {item!r}" + (f" field {field!r}" if field else "")
    manifest = _unseal(_read_json_item(step_dir / "manifest"), what)
    if item not in manifest["items"]:
        raise CheckpointError(f"{step_dir} has no item {item!r}")
    described = _subtree(manifest["items"][item], field, what)
    _check_target(abstract_params, described, what)
    target = _abstract(abstract_params)
    full = {field: target} if field else target
    restore_args = ocp.checkpoint_utils.construct_restore_args(full)
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
        out = ck.restore(step_dir / item, args=ocp.args.PyTreeRestore(
            item=full, restore_args=restore_args, partial_restore=field is not None))
    finally:
        ck.close()
    params = out[field] if field else out
    if verify:
        _verify(params, described, what)
    return params


# ---------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Async orbax CheckpointManager for the RL loop keeping the `keep` newest steps.

    Args:
      directory: root directory (local path or a URI orbax understands).
      keep: number of newest checkpoints kept (None: all). A step that reference params point to
        (ref_source into this directory) is kept as well.
      save_every: `save(step)` writes when step % save_every == 0 (or force=True, or when a
        multi-host preemption signal was received).
      async_save: write arrays in a background thread (device->host copies happen inside `save`,
        so the caller may donate or delete the saved arrays as soon as it returns).
      ref_source: None to save reference params by copy; a RefPointer (or a directory string:
        its newest step's state.params) to store only a pointer.
      verify: record and check per-array content digests.
      read_only: never write, remove or move anything (for evaluators reading a live run).
    """

    def __init__(self, directory, *, keep: int | None = 3, save_every: int = 1,
                 async_save: bool = True, ref_source: RefPointer | str | os.PathLike | None = None,
                 verify: bool = True, read_only: bool = False):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if _grain_ckpt is None or not hasattr(_grain_ckpt, "CheckpointSave"):
            raise ImportError("grain with orbax support is required (grain.checkpoint.CheckpointSave)")
        self.directory = _path(directory)
        self.keep, self.save_every, self.verify = keep, int(save_every), verify
        self.read_only = read_only
        self._closed = False

        if not read_only and _is_primary():
            self._report_tmp_dirs()

        self.ref_source = self._resolve_ref_source(ref_source)
        pinned = []
        if self.ref_source is not None and _path(self.ref_source.directory) == self.directory:
            pinned.append(int(self.ref_source.step))
        pp = ocp.checkpoint_managers
        preservation = pp.LatestN(n=keep)
        if pinned:
            preservation = pp.AnyPreservationPolicy([preservation, pp.CustomSteps(pinned)])
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=pp.AnySavePolicy([
                pp.FixedIntervalPolicy(self.save_every), pp.PreemptionCheckpointingPolicy()]),
            preservation_policy=preservation,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "ref_params": ocp.StandardCheckpointHandler(),
            "rng": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "manifest": ocp.JsonCheckpointHandler(),
            "data": _grain_ckpt.CheckpointHandler(),
        }
        self._mngr = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

    # ------------------------------------------------------------ setup helpers

    def _report_tmp_dirs(self):
        if not self.directory.exists():
            return
        for p in sorted(self.directory.iterdir(), key=lambda p: p.name):
            if _TMP_MARK in p.name:
                logger.warning(
                    "checkpoint: %s is an unfinished save (the writer stopped before committing "
                    "it, e.g. a crash or kill); it is never restored and is being removed",
                    p)

    def _resolve_ref_source(self, src) -> RefPointer | None:
        if src is None:
            return None
        if not isinstance(src, RefPointer):
            src = RefPointer(directory=os.fspath(src))
        src = dataclasses.replace(src, directory=os.fspath(_path(src.directory)))
        if src.step is None:
            steps = _committed_steps(_path(src.directory))
            if not steps:
                raise CheckpointError(f"ref_source {src.directory} has no committed checkpoint; "
                                      "give RefPointer(directory, step=...) explicitly")
            src = dataclasses.replace(src, step=steps[-1])
        return src

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    # ------------------------------------------------------------ public API

    def all_steps(self) -> list[int]:
        """Committed steps (an in-flight async save is not included until it commits)."""
        return [s for s in self._mngr.all_steps() if self._step_dir(s).exists()]

    def latest_step(self) -> int | None:
        """Newest committed step, or None."""
        steps = self.all_steps()
        return max(steps) if steps else None

    def save(self, step: int, state, *, rng, data_iter=None, ref_params=None,
             meta: dict | None = None, force: bool = False) -> bool:
        """Start saving a checkpoint for `step` if due (or force); returns whether it started.

        The arrays are copied to host before this returns; the files are written in the
        background (`wait()` blocks until committed). A step that already exists is not
        rewritten (returns False). Errors of a previous async save surface here or in wait().
        """
        step = int(step)
        if self.read_only:
            raise CheckpointError(f"Checkpointer({self.directory}) is read-only")
        if step in self._mngr.all_steps():
            logger.info("checkpoint: step %d already saved in %s; not rewritten", step,
                        self.directory)
            return False
        if not force and not self._mngr.should_save(step):
            return False
        if ref_params is not None and self.ref_source is not None:
            raise ValueError("reference params are stored by pointer (ref_source="
                             f"{self.ref_source}); do not pass ref_params to save()")
        meta_json = _to_json({} if meta is None else meta)
        if not isinstance(meta_json, dict):
            raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")

        items: dict[str, Any] = {"state": ocp.args.StandardSave(state),
                                 "meta": ocp.args.JsonSave(meta_json)}
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION, "step": step, "time": time.time(),
            "process_count": jax.process_count(),
            "items": {"state": _describe(state, digests=self.verify)},
            "rng": None, "ref": {"mode": "none"}, "data": data_iter is not None,
            "meta_digest": _json_digest(meta_json), "data_digest": None,
        }
        if rng is not None:
            typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
            key_data = jax.random.key_data(rng) if typed else jnp.asarray(rng)
            if jax.process_count() > 1:  # every process holds the same key: one global array
                kd = np.asarray(key_data)
                key_data = jax.make_array_from_callback(kd.shape, _all_devices_replicated(),
                                                        lambda i: kd[i])
            rng_tree = {"key_data": key_data}
            items["rng"] = ocp.args.StandardSave(rng_tree)
            manifest["rng"] = {"typed": bool(typed),
                               "impl": str(jax.random.key_impl(rng)) if typed else None}
            manifest["items"]["rng"] = _describe(rng_tree, digests=self.verify)
        if self.ref_source is not None:
            manifest["ref"] = {"mode": "pointer", **self.ref_source.to_json()}
        elif ref_params is not None:
            items["ref_params"] = ocp.args.StandardSave(ref_params)
            manifest["ref"] = {"mode": "copy"}
            manifest["items"]["ref_params"] = _describe(ref_params, digests=self.verify)
        if data_iter is not None:
            items["data"] = _grain_ckpt.CheckpointSave(data_iter)
            if jax.process_count() == 1:  # the manifest is written by process 0 only
                manifest["data_digest"] = _json_digest(_iter_state_json(data_iter))
        items["manifest"] = ocp.args.JsonSave(_seal(manifest))
        return bool(self._mngr.save(step, args=ocp.args.Composite(**items), force=True))

    def restore(self, step: int, abstract_state, *, data_iter=None, abstract_ref=None) -> Restored:
        """Restore one given step (no fallback); see restore_latest for the arguments."""
        self._mngr.wait_until_finished()
        return self._restore_step(int(step), abstract_state, data_iter, abstract_ref)

    def restore_latest(self, abstract_state, *, data_iter=None, abstract_ref=None
                       ) -> Restored | None:
        """Restore the newest usable checkpoint, or return None when there is none.

        abstract_state: the target (jax.eval_shape of the state, or a state); its structure,
          shapes and dtypes must equal the checkpoint's (else CheckpointMismatchError), its
          shardings (when given) place the restored arrays.
        data_iter: a grain iterator, moved to the checkpoint's position (left untouched when no
          checkpoint is restored).
        abstract_ref: target for the reference params (default: abstract_state.params).

        Returns Restored(state, rng, meta, ref_params, step), which unpacks as the 4-tuple
        (state, rng, meta, ref_params); rng is a typed key when a typed key was saved.
        Unusable newer steps are reported, then moved to <directory>/corrupt/ (never deleted).
        """
        self._mngr.wait_until_finished()
        self._mngr.reload()
        failures: list[tuple[int, str]] = []
        for step in sorted(self._mngr.all_steps(), reverse=True):
            error: BaseException | None = None
            out = None
            try:
                out = self._restore_step(step, abstract_state, data_iter, abstract_ref)
            except (CheckpointMismatchError, RefSourceError):
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read a step is reported
                error = e
            if not _all_processes_ok(error is None):
                reason = _reason(error) if error is not None else "failed on another process"
                logger.warning("checkpoint: step %d in %s is unusable (%s); trying an older one",
                               step, self.directory, reason)
                failures.append((step, reason))
                continue
            for bad, reason in failures:
                self._quarantine(bad, reason, restored=step)
            if failures:
                self._mngr.reload()
            return out
        if failures:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: "
                + "; ".join(f"step {s}: {r}" for s, r in failures)
                + ". Nothing was moved or deleted (a failure of every step may not be corruption).")
        return None

    def wait(self):
        """Block until the in-flight save is committed (raises its error, if any)."""
        self._mngr.wait_until_finished()
        self._mngr.check_for_errors()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ internals

    def _restore_step(self, step, abstract_state, data_iter, abstract_ref) -> Restored:
        where = f"checkpoint step {step} in {self.directory}"
        got = self._mngr.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))
        manifest = _unseal(got["manifest"], where)
        described = manifest["items"]
        _check_target(abstract_state, described["state"], f"{where} (state)")
        args = {"state": ocp.args.StandardRestore(_abstract(abstract_state)),
                "meta": ocp.args.JsonRestore()}
        if manifest.get("rng"):
            kd = described["rng"]["['key_data']"]
            args["rng"] = ocp.args.StandardRestore(_abstract(
                {"key_data": jax.ShapeDtypeStruct(tuple(kd["shape"]), jnp.dtype(kd["dtype"]))}))
        ref_mode = manifest["ref"]["mode"]
        if ref_mode == "copy":
            aref = abstract_ref if abstract_ref is not None else _default_ref(abstract_state)
            _check_target(aref, described["ref_params"], f"{where} (ref_params)")
            args["ref_params"] = ocp.args.StandardRestore(_abstract(aref))
        r = self._mngr.restore(step, args=ocp.args.Composite(**args))
        state = r["state"]
        if self.verify:
            _verify(state, described["state"], f"{where} (state)")
        rng = None
        if manifest.get("rng"):
            rng_tree = r["rng"]
            if self.verify:
                _verify(rng_tree, described["rng"], f"{where} (rng)")
            rng = rng_tree["key_data"]
            if manifest["rng"]["typed"]:
                rng = jax.random.wrap_key_data(rng, impl=manifest["rng"]["impl"])
        ref_params = None
        if ref_mode == "copy":
            ref_params = r["ref_params"]
            if self.verify:
                _verify(ref_params, described["ref_params"], f"{where} (ref_params)")
        elif ref_mode == "pointer":
            ptr = manifest["ref"]
            aref = abstract_ref if abstract_ref is not None else _default_ref(abstract_state)
            try:
                ref_params = load_params(ptr["directory"], aref, step=ptr["step"],
                                         item=ptr["item"], field=ptr["field"], verify=self.verify)
            except CheckpointMismatchError:
                raise
            except Exception as e:
                raise RefSourceError(
                    f"{where}: its reference params point to {ptr['directory']} step "
                    f"{ptr['step']} ({ptr['item']}.{ptr['field']}), which could not be loaded: "
                    f"{_reason(e)}") from e
        meta = r["meta"]
        if _json_digest(meta) != manifest["meta_digest"]:
            raise CorruptCheckpointError(f"{where}: meta digest mismatch")
        if data_iter is not None:
            if manifest.get("data"):
                if manifest.get("data_digest") is not None:  # check before touching the iterator
                    f = _data_file(self._step_dir(step))
                    if _json_digest(json.loads(f.read_text())) != manifest["data_digest"]:
                        raise CorruptCheckpointError(f"{where}: data-iterator state digest mismatch")
                self._mngr.restore(step, args=ocp.args.Composite(
                    data=_grain_ckpt.CheckpointRestore(data_iter)))
            else:
                logger.warning("checkpoint: %s holds no data-iterator state; the iterator is "
                               "left at its current position", where)
        logger.info("checkpoint: restored step %d from %s", step, self.directory)
        return Restored(state=state, rng=rng, meta=meta, ref_params=ref_params, step=step)

    def _quarantine(self, step: int, reason: str, *, restored: int):
        src = self._step_dir(step)
        if self.read_only or not _is_primary():
            if _is_primary():
                logger.warning("checkpoint: step %d (%s) is unusable: %s; restored step %d "
                               "instead; left in place (read-only)", step, src, reason, restored)
            return
        dest_root = self.directory / _CORRUPT_DIR
        dest_root.mkdir(parents=True, exist_ok=True)
        dest = dest_root / f"{step}.{int(time.time())}"
        n = 0
        while dest.exists():
            n += 1
            dest = dest_root / f"{step}.{int(time.time())}.{n}"
        src.rename(dest)
        logger.warning("checkpoint: step %d was unusable (%s); restored step %d instead and moved "
                       "the bad one to %s (kept for inspection, not deleted)", step, reason,
                       restored, dest)


def _default_ref(abstract_state):
    if hasattr(abstract_state, "params"):
        return abstract_state.params
    if isinstance(abstract_state, dict) and "params" in abstract_state:
        return abstract_state["params"]
    raise ValueError("pass abstract_ref: the state has no .params to take the reference "
                     "params' structure from")
