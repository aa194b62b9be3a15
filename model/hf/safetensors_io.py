"""Streaming safetensors: header parsing with validation, one-tensor reads, one-tensor writes.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype",
"shape", "data_offsets": [begin, end]}, optional "__metadata__"}), then the tensors' bytes
(offsets relative to the end of the header). `Checkpoint(dir)` reads every header of a directory
(`model.safetensors`, or the files of `model.safetensors.index.json`), checks it (offsets inside
the file, sizes = shape x dtype size, no overlap, every index entry present in its file) and
then reads one tensor at a time with a plain seek + read (no memory map: host memory holds the
tensor being read, not the file). `write_file(path, entries)` writes a file from (name, shape,
dtype, producer) entries: the header first, then each tensor's bytes as its producer returns
them, so at most one tensor is on the host.

Errors raise `CheckpointError` naming the file and the tensor or field.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER = 100 << 20  # the safetensors library's own limit on the header's JSON

# safetensors dtype names <-> numpy dtypes (the float8 ones for DeepSeek's FP8 weights)
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
          "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
          "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory, file, tensor or config field is missing, malformed or not
    supported; the message names which."""


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "start", "end")

    def __init__(self, name, file, dtype, shape, start, end):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, shape
        self.start, self.end = start, end

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str) -> dict[str, TensorInfo]:
    """name -> TensorInfo of one file, validated (CheckpointError naming what is wrong)."""
    fname = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{fname}: corrupt safetensors header: file of {size} bytes "
                                  "has no 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{fname}: corrupt safetensors header: header length {n} "
                                  f"does not fit the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{fname}: corrupt safetensors header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{fname}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out, spans = {}, []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b, e) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            ok = all(isinstance(x, int) and x >= 0 for x in (*shape, b, e))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{fname}: corrupt safetensors header: entry {name!r} is not "
                                  "{dtype, shape, data_offsets}")
        if dt not in DTYPES:
            raise CheckpointError(f"{fname}: tensor {name!r} has dtype {dt!r}, not one of "
                                  f"{sorted(DTYPES)}")
        if not (b <= e <= data_len) or e - b != math.prod(shape) * DTYPES[dt].itemsize:
            raise CheckpointError(f"{fname}: corrupt safetensors header: tensor {name!r} "
                                  f"{dt} {list(shape)} has data_offsets [{b}, {e}], outside the "
                                  f"{data_len} data bytes or not its size")
        out[name] = TensorInfo(name, path, DTYPES[dt], shape, data_start + b, data_start + e)
        spans.append((b, e, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{fname}: corrupt safetensors header: tensors {n0!r} and "
                                  f"{n1!r} overlap")
    return out


class Checkpoint:
    """Every tensor's header entry in a checkpoint directory; `read(name)` one at a time."""

    def __init__(self, directory: str):
        self.dir = directory
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{INDEX_FILE}: no readable weight_map ({e})") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}: not a "
                                  "safetensors checkpoint directory")
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            path = os.path.join(directory, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{INDEX_FILE} names {fname}, which is missing")
            for name, info in read_header(path).items():
                if weight_map is not None and weight_map.get(name) != fname:
                    raise CheckpointError(f"{fname} holds tensor {name!r}, which {INDEX_FILE} "
                                          f"maps to {weight_map.get(name)!r}")
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} is in two files")
                self.tensors[name] = info
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.tensors))
            if absent:
                raise CheckpointError(f"{INDEX_FILE} maps tensor {absent[0]!r} to "
                                      f"{weight_map[absent[0]]}, which does not hold it")

    def read(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        with open(t.file, "rb") as f:
            f.seek(t.start)
            buf = f.read(t.nbytes)
        if len(buf) != t.nbytes:
            raise CheckpointError(f"{os.path.basename(t.file)}: tensor {name!r} is truncated")
        return np.frombuffer(buf, t.dtype).reshape(t.shape)


Producer = Callable[[], np.ndarray]


def write_file(path: str, entries: Iterable[tuple[str, tuple, np.dtype, Producer]],
               metadata: dict | None = None) -> int:
    """Write a safetensors file from (name, shape, dtype, producer) entries, streaming each
    tensor's bytes; raises AssertionError if a producer's array differs from its entry. Returns
    the data bytes written."""
    entries = list(entries)
    header, off = {}, 0
    for name, shape, dtype, _ in entries:
        nb = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [off, off + nb]}
        off += nb
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, produce in entries:
            arr = produce()
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise AssertionError(f"{name}: planned {tuple(shape)} {np.dtype(dtype)}, got "
                                     f"{arr.shape} {arr.dtype}")
            f.write(np.ascontiguousarray(arr).tobytes())
    return off
