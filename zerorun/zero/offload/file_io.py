"""Checked reads and writes of offload scratch files: every byte count is compared.

Used by offload/nvme.py (NVMe optimizer state and parameter files); tests:
tests/unit/test_offload_io.py. Storage fails in ordinary ways (a short read of a truncated
file, ENOSPC, EIO, a file a cleanup job removed), and a read that fills only part of a buffer
leaves the rest holding an earlier unit's values, which trains on silently. So each call here
loops until the whole count moved and raises one StorageError line naming the rank, the file
and the bytes moved of the bytes wanted, or it returns having moved them all.
"""

from __future__ import annotations

import os
from pathlib import Path

from zerorun.errors import StorageError

_HINT = "the scratch files of NVMe offload must stay untouched while the job runs: check the disk and restart from the last checkpoint"


def _fail(rank: int, what: str, path: Path, done: int, wanted: int, why: str) -> StorageError:
    return StorageError(f"rank {rank}: NVMe {what} of {str(path)!r} moved {done} of {wanted} bytes ({why})", hint=_HINT)


def read_exactly(path: Path, view: memoryview, rank: int, offset: int = 0) -> None:
    """Fill ``view`` (bytes) from ``path`` at ``offset``, or raise StorageError."""
    wanted, done = len(view), 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _fail(rank, "read", path, 0, wanted, exc.strerror or type(exc).__name__) from None
    try:
        while done < wanted:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise _fail(rank, "read", path, done, wanted, exc.strerror or type(exc).__name__) from None
            if got == 0:
                size = os.fstat(fd).st_size
                raise _fail(rank, "read", path, done, wanted, f"the file ends at {size} bytes: truncated")
            done += got
    finally:
        os.close(fd)


def write_exactly(path: Path, view: memoryview, rank: int, *, create: bool = False) -> None:
    """Write ``view`` (bytes) at the start of ``path``, or raise StorageError. ``create`` makes
    a new file (never following a symlink planted at its name); otherwise the file must exist."""
    wanted, done = len(view), 0
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise _fail(rank, "write", path, 0, wanted, exc.strerror or type(exc).__name__) from None
    try:
        while done < wanted:
            try:
                put = os.pwritev(fd, [view[done:]], done)
            except OSError as exc:
                raise _fail(rank, "write", path, done, wanted, exc.strerror or type(exc).__name__) from None
            if put == 0:
                raise _fail(rank, "write", path, done, wanted, "the file system accepted no more bytes")
            done += put
    finally:
        os.close(fd)


def check_mapped(path: Path, nbytes: int, rank: int) -> None:
    """A memory-mapped parameter file still holds its ``nbytes``: reading a page past a
    truncated end is a SIGBUS, which kills the rank without naming the file, so the file's size
    is checked before each read of the mapping (one stat). A removed file is still readable
    through its mapping (the inode lives on), so only a short one fails."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return
    if size < nbytes:
        raise _fail(rank, "read", path, 0, nbytes, f"the file ends at {size} bytes: truncated while memory-mapped")

