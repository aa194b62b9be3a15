"""Files in and out of a sandbox's working directory, from the host side, without trusting it.

A program owns /work while it runs and may leave anything there (symlinks to host paths, FIFOs,
directories where files are expected, deep trees). So `place_files` writes request files through
directory fds with O_NOFOLLOW (never through a link, never blocking on a FIFO), `read_back` reads
only regular files reached without a link, size-capped, and `clear_dir` removes without following
links. Not covered here: mounting or resetting /work (Slot in sandbox/executor.py).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat


def place_files(workdir: str, files: dict[str, bytes], owner: int | None) -> None:
    """Writes request files into /work without following links or blocking on FIFOs that an
    earlier step of a sequence may have left (OSError says which path). `owner`: the uid that gets
    the new directories and files (None: left as created)."""
    if not files:
        return
    root_fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for rel, content in files.items():
            parts = rel.split("/")
            dfd = os.dup(root_fd)
            try:
                for comp in parts[:-1]:
                    try:
                        os.mkdir(comp, 0o755, dir_fd=dfd)
                        if owner is not None:
                            os.chown(comp, owner, owner, dir_fd=dfd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
                    os.close(dfd)
                    dfd = nfd
                try:
                    ffd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                                  | os.O_NOCTTY | os.O_CLOEXEC, 0o644, dir_fd=dfd)
                except OSError as e:
                    raise OSError(e.errno, f"{rel}: {e.strerror}") from None
                try:
                    if not stat.S_ISREG(os.fstat(ffd).st_mode):
                        raise OSError(errno.EEXIST, f"{rel}: exists and is not a regular file")
                    os.ftruncate(ffd, 0)
                    view = memoryview(content)
                    while view:
                        n = os.write(ffd, view)
                        view = view[n:]
                    if owner is not None:
                        os.fchown(ffd, owner, owner)
                finally:
                    os.close(ffd)
            except OSError as e:
                if rel in str(e):
                    raise
                raise OSError(e.errno, f"{rel}: {e.strerror}") from None
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)


def read_back(workdir: str, paths: list[str], limit: int) -> tuple[dict[str, bytes], list[str]]:
    """Reads files from the work dir: no symlink is followed, only regular files, size-capped."""
    out: dict[str, bytes] = {}
    notes: list[str] = []
    for rel in paths:
        parts = rel.split("/")
        fds = []
        try:
            fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            fds.append(fd)
            for comp in parts[:-1]:
                fd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                fds.append(fd)
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY,
                         dir_fd=fd)
            fds.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                notes.append(f"{rel}: not a regular file")
                continue
            data = os.read(fd, limit + 1) if limit >= 0 else b""
            chunks = [data]
            total = len(data)
            while data and total <= limit:
                data = os.read(fd, limit + 1 - total)
                chunks.append(data)
                total += len(data)
            blob = b"".join(chunks)
            if len(blob) > limit:
                notes.append(f"{rel}: truncated to {limit} bytes")
                blob = blob[:limit]
            out[rel] = blob
        except OSError as e:
            if e.errno == errno.ELOOP or e.errno == errno.ENOTDIR:
                notes.append(f"{rel}: symlink or non-directory in path, not followed")
            elif e.errno != errno.ENOENT:
                notes.append(f"{rel}: {e.strerror}")
        finally:
            for f in reversed(fds):
                os.close(f)
    return out, notes


def clear_dir(path: str) -> None:
    """Removes everything inside `path` without following symlinks (fd-based rmtree)."""
    with os.scandir(path) as it:
        entries = list(it)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)
