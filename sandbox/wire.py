"""Message framing between this package's processes: an 8-byte little-endian length, then a pickle.

Used on the pipes of every process this package starts (pool workers, math-verify workers, the
reaper). Both ends are this package, never untrusted input: a sandboxed program never writes to
these pipes. `read_msg` returns None at end of file (the other end closed or died).
"""

from __future__ import annotations

import os
import pickle
import struct

_HDR = struct.Struct("<Q")


def read_msg(fd: int):
    hdr = _read_exact(fd, _HDR.size)
    if hdr is None:
        return None
    (n,) = _HDR.unpack(hdr)
    body = _read_exact(fd, n)
    if body is None:
        return None
    return pickle.loads(body)


def write_msg(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HDR.pack(len(body)) + body)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)
