"""One job at a time per checkpoint directory: an owner lock held while the job lives.

Used by checkpoint/save.py (rank 0, at its first save into a directory), checkpoint/schedule.py
(rank 0, when an engine with ``checkpoint.dir`` starts) and the launcher (``dir_problem`` and
``live_holder`` before any worker starts); tests: tests/unit/test_checkpoint_safety.py,
tests/unit/test_run_dir_lock.py.

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
        return f"{holder['job']} (pid {holder['pid']} on {holder['host']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another live process"


# Note [refused before training]: file systems no checkpoint can be written to. A checkpoint.dir
# that is an existing file, or under one of these, used to be refused only at the first save,
# after the steps before it had run.
_PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")


def dir_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` can never hold checkpoints, or None (pure but for stat calls)."""
    path = os.path.abspath(directory)
    real = os.path.realpath(path)
    for pseudo in _PSEUDO_FILE_SYSTEMS:
        if real == pseudo or real.startswith(pseudo + "/"):
            return f"{path!r} is under {pseudo}, a kernel file system that holds no files of ours"
    probe = Path(path)
    while not probe.exists():  # the nearest existing ancestor must be a writable directory
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is an existing file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    return None


def live_holder(directory: str | os.PathLike, name: str = OWNER_FILE) -> str | None:
    """The live job holding ``directory``'s lock file ``name`` ("job ... (pid ... on ..., since
    ...)"), or None when there is none. The lock is tested and released at once, never kept, and
    no file is created (the launcher asks this before any worker starts; rank 0 then claims it)."""
    key = os.path.realpath(directory)
    if key in _held and name == OWNER_FILE:
        return None
    try:
        fd = os.open(Path(key) / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return _describe(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)  # drops the lock if it was taken
    return None


class Held(Exception):
    """A live process holds the lock; ``holder`` says who (job, pid, host, since when)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def lock_and_sign(path: Path, job: str) -> int:
    """Open (creating) ``path``, take its lock and write who holds it (``job``: "job slurm777",
    "launch 0123abcd"); the descriptor, to keep
    open while the lock is wanted. Held when a live process holds it; OSError when the file
    cannot be made or the file system has no locks (ENOLCK)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _describe(fd)
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise Held(holder) from None
        raise
    record = json.dumps({"job": job, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode(), 0)
    return fd


def claim(directory: Path, job: str) -> None:
    """Take (or keep) the owner lock of ``directory`` for this process, or raise CheckpointError
    naming the live holder (Note [checkpoint owner])."""
    key = os.path.realpath(directory)
    with _lock:
        if key in _held:
            return
        path = Path(key) / OWNER_FILE
        try:
            _held[key] = lock_and_sign(path, f"job {job}")
        except Held as held:
            raise CheckpointError(f"checkpoint directory {key!r} is in use by {held.holder}",
                                  hint="stop that job first, or save this one to another checkpoint.dir") from None
        except OSError as exc:
            if exc.errno == errno.ENOLCK or os.path.exists(path):
                raise CheckpointError(f"cannot lock {str(path)!r} ({exc.strerror})",
                                      hint="put checkpoint.dir on a file system with POSIX locks "
                                           "(a local disk, NFSv4, Lustre mounted with flock)") from None
            raise CheckpointError(f"cannot create {str(path)!r} ({exc.strerror})",
                                  hint="checkpoint.dir must be a writable directory shared by every rank") from None
