"""One live launch per run directory: a lock the launcher holds while it lives.

Used by launch/prepare.py (``_run_dir`` chooses, ``write_run_dir`` takes); tests:
tests/unit/test_run_dir_lock.py, tests/e2e/test_shared_run_dir.py.

Note [one launch per run directory]: two launches sharing a run directory (the same explicit
``--run-dir``, or every start of a requeued Slurm job, which continue ``zerorun-runs/slurm-JOB``)
appended to the same rank logs and metrics.jsonl, overwrote each other's config.json and
plan.json, and the first to end removed the NVMe scratch the other's ranks had recorded there,
killing the survivor (``NVMe read ... moved 0 of 3168 bytes``). Now the launcher takes
``RUN_DIR/.zerorun-launch`` with ``fcntl.lockf`` before it writes anything there and keeps it
until it exits (the kernel drops it however the launcher ends, as with Note [checkpoint owner],
whose locking this shares). Before that, ``prepare`` asks who holds it:

- nobody, or a dead launch (its stale file): the directory is this launch's (a requeued Slurm
  job continues its directory this way);
- a live launch, when this is a requeued Slurm start (SLURM_RESTART_COUNT > 0): the previous
  start may still be tearing down, so it waits up to ``REQUEUE_WAIT_S`` for it to end;
- a live launch still: an explicit ``--run-dir`` is refused in one line before any worker
  starts; a default directory is replaced by a fresh one beside it, with a note.

Scratch records are per launch besides (``scratch/<launch>/rank<R>``, offload/scratch.py), and
the agent's sweep never removes a directory whose lock a live process holds.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.zero.checkpoint.owner import Held, live_holder, lock_and_sign

LOCK_FILE = ".zerorun-launch"
REQUEUE_WAIT_S = 60.0
_held: dict[str, int] = {}  # realpath of a run directory -> descriptor of its locked file
_lock = threading.Lock()


def launch_id(token: str) -> str:
    """A name for this launch that reveals nothing of its token (scratch records' folder)."""
    return hashlib.sha256(f"zerorun-launch:{token}".encode()).hexdigest()[:12]


def holder(run_dir: str | os.PathLike) -> str | None:
    """The live launch holding ``run_dir`` (one phrase), or None (also when this process holds it)."""
    if os.path.realpath(run_dir) in _held:
        return None
    return live_holder(run_dir, LOCK_FILE)


def wait_for_end(run_dir: str | os.PathLike, seconds: float, clock=time.monotonic, sleep=time.sleep) -> str | None:
    """``holder`` once the holder ended or ``seconds`` passed (Note [one launch per run directory])."""
    deadline = clock() + seconds
    while (held := holder(run_dir)) is not None and clock() < deadline:
        sleep(0.5)
    return held


def take(run_dir: str | os.PathLike, label: str) -> None:
    """Create ``run_dir`` and hold its lock for the rest of this process, or raise LaunchError
    naming the live launch that holds it."""
    key = os.path.realpath(run_dir)
    with _lock:
        if key in _held:
            return
        try:
            Path(key).mkdir(parents=True, exist_ok=True)
            _held[key] = lock_and_sign(Path(key) / LOCK_FILE, label)
        except Held as held:
            raise LaunchError(f"run directory {key} is in use by {held.holder}",
                              hint="wait for that launch to end, or pass another --run-dir "
                                   "(without --run-dir each launch gets its own)") from None
        except OSError as exc:
            raise LaunchError(f"cannot lock run directory {key} ({exc.strerror})",
                              hint="pass a --run-dir on a writable file system with POSIX locks") from None
