"""One job at a time per checkpoint directory: an owner lock held while the job lives.

Used by checkpoint/save.py (rank 0, at its first save into a directory); tests:
tests/unit/test_checkpoint_safety.py.

Note [checkpoint owner]: two jobs saving into one directory (the realistic case: a requeued
job while the old one is still alive) replace each other's tags and race on ``latest``. So
rank 0 takes ``DIR/.zerorun-owner`` with ``fcntl.lockf`` before its first save there and keeps
it until the process ends. The kernel holds the lock (POSIX record locks also work over
NFSv4), so a job that died, however it died, holds nothing: its leftover file is taken over
with no liveness guessing, and a live holder is refused with one line naming it (job, host,
pid and since when, from the file's contents). POSIX locks belong to the process, so every
engine of one process shares the lock, and the file is never opened twice by it (closing
any descriptor of the file would drop the lock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from zerorun.errors import CheckpointError

OWNER_FILE = ".zerorun-owner"
_held: dict[str, int] = {}  # realpath of a directory -> descriptor of its locked owner file
_lock = threading.Lock()


def _describe(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"job {holder['job']} (pid {holder['pid']} on {holder['host']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another live process"


def claim(directory: Path, job: str) -> None:
    """Take (or keep) the owner lock of ``directory`` for this process, or raise CheckpointError
    naming the live holder (Note [checkpoint owner])."""
    key = os.path.realpath(directory)
    with _lock:
        if key in _held:
            return
        path = Path(key) / OWNER_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise CheckpointError(f"cannot create {str(path)!r} ({exc.strerror})",
                                  hint="checkpoint.dir must be a writable directory shared by every rank") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # ENOLCK: the file system has no locks
                os.close(fd)
                raise CheckpointError(f"cannot lock {str(path)!r} ({exc.strerror})",
                                      hint="put checkpoint.dir on a file system with POSIX locks "
                                           "(a local disk, NFSv4, Lustre mounted with flock)") from None
            holder = _describe(fd)
            os.close(fd)
            raise CheckpointError(f"checkpoint directory {key!r} is in use by {holder}",
                                  hint="stop that job first, or save this one to another checkpoint.dir") from None
        record = json.dumps({"job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        _held[key] = fd
