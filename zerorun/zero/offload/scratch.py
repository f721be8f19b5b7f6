"""Where NVMe offload keeps its scratch files, and how they are cleaned up and budgeted.

Used by offload/nvme.py; the launcher's agent calls ``sweep_recorded`` after its workers
exit. Tests: tests/unit/test_offload_io.py, tests/e2e/test_nvme_faults.py.

Note [scratch names]: a rank's scratch lives in ``NVME_PATH/zerorun-<job>-<launch>-rank<R>/``.
``<job>`` says whose it is (``slurm<SLURM_JOB_ID>`` under Slurm, else a digest of the launcher's
run directory, else ``pid<pid>``); ``<launch>`` is eight random hex digits of this process, so
no two processes ever share a directory. Names used to be fixed by job and rank alone, and the
start of a process removed what an earlier one of "the same job" left: two job steps of one
Slurm allocation (or a job and its retry) with one nvme_path then deleted each other's live
files. Leftovers of dead processes are found by a lock instead of by name: each directory holds
``.lock``, locked (``fcntl.lockf``) by its process from before the directory gets its name
(it is built as ``.zerorun-new-<hex>`` and renamed), and before the lock file gets its own,
until the process ends, however it ends. A
process starting on an nvme_path removes every sibling directory of ours whose lock it can take
(its owner is dead: a SIGKILL, a crash), so a killed job's files do not accumulate (898 MB
after one killed 59M-parameter run, before any cleanup), and never touches one whose lock is
held. POSIX locks belong to the process, so this process never opens the lock file of a
directory of its own a second time (closing that descriptor would drop its lock). Each placement
takes a subdirectory (``optim0``, ``params0``, ...), so two engines of one process never share
or delete each other's files. Every rank also records its directory in the run directory
(``scratch/<launch>/rank<R>``, ``<launch>`` from ZERORUN_LAUNCH_ID: one folder per launch, so a
later launch continuing the run directory never overwrites an earlier one's records) so the
launcher can remove it at any exit it sees (``sweep_recorded``). The sweep, too, removes only a
directory whose lock it can take: never one a live process holds (Note [one launch per run
directory] in launch/run_dir.py: a second launch in one run directory used to overwrite the
records and the first one's agent then removed the second's live files).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import itertools
import os
import re
import secrets
import shutil
import sys
import threading
from pathlib import Path
from collections.abc import Iterable, Mapping

from zerorun.errors import RuntimeConfigError
from zerorun.worker.launch_env import LAUNCH_ID_ENV

_NAME = re.compile(r"zerorun-[A-Za-z0-9]+-[0-9a-f]{8}-rank[0-9]+\Z")
_NEW = re.compile(r"\.zerorun-new-[0-9a-f]{16}\Z")  # a directory not yet renamed to its name
LOCK_FILE = ".lock"
_LOCK_BEING_MADE = ".lock-new"  # the lock file until it is locked (_make_locked)
_LAUNCH_ID = re.compile(r"[0-9a-f]{1,32}\Z")
_lock = threading.RLock()  # re-entrant: a placement finalizer (remove_if_empty) can run in any allocation
_launch = secrets.token_hex(4)  # <launch> of Note [scratch names]
_held: dict[Path, int] = {}  # rank directories of this process -> descriptor of their locked .lock
_counter = itertools.count()
# Note [scratch budget]: bytes this process's placements will hold and have written, per file
# system (st_dev), so optimizer files and parameter files on one disk are checked together.
_planned: dict[int, int] = {}
_written: dict[int, int] = {}


def job_key(environ: Mapping[str, str] = os.environ) -> str:
    """``<job>`` of Note [scratch names]."""
    if environ.get("SLURM_JOB_ID", "").isalnum():
        task = environ.get("SLURM_ARRAY_TASK_ID", "")
        return f"slurm{environ['SLURM_JOB_ID']}" + (f"a{task}" if task.isalnum() else "")
    if environ.get("ZERORUN_RUN_DIR"):
        return "run" + hashlib.sha256(os.path.abspath(environ["ZERORUN_RUN_DIR"]).encode()).hexdigest()[:12]
    return f"pid{os.getpid()}"


def nvme_path_problem(nvme_path: str | os.PathLike) -> str | None:
    """Why NVMe offload could not keep its scratch under ``nvme_path`` on this machine, or None.

    Only the last component may be missing (zerorun creates it): a path whose parent does not
    exist is far more often a mistyped mount point than a wish, and creating the whole chain
    would put the offload files on the root disk without a word.
    """
    path = os.path.abspath(nvme_path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{path!r} is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path!r} is not writable"
    parent = os.path.dirname(path)
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"{parent!r} is not a directory"
    if not os.path.isdir(parent):
        return f"{path!r} does not exist and neither does its parent {parent!r} (a mistyped mount point?)"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path!r} does not exist and its parent {parent!r} is not writable"
    return None


def rank_directory(nvme_path: str | os.PathLike, rank: int, environ: Mapping[str, str] = os.environ) -> Path:
    """This process's scratch directory for ``rank`` under ``nvme_path`` (Note [scratch names])."""
    return Path(os.path.abspath(nvme_path)) / f"zerorun-{job_key(environ)}-{_launch}-rank{rank}"


def placement_directory(nvme_path: str, rank: int, kind: str, key: str) -> Path:
    """A fresh subdirectory ``kind<n>`` of this process's scratch directory for ``rank``, which
    is made (and dead processes' leftovers beside it removed) when this process has none yet
    (Note [scratch names]). ``key`` is the config key named in errors."""
    base = rank_directory(nvme_path, rank)
    problem = nvme_path_problem(nvme_path)
    if problem:
        raise RuntimeConfigError(f"{key}: {problem}",
                                 hint="point nvme_path at a directory on a local disk you can write")
    try:
        with _lock:
            if base not in _held:
                _create_nvme_path(base.parent, key, rank)
                sweep_dead(base.parent)
                _make_locked(base)
                atexit.register(remove_if_empty, base)
                _record(base, rank)
            directory = base / f"{kind}{next(_counter)}"
            directory.mkdir(mode=0o700)
    except OSError as exc:
        raise RuntimeConfigError(f"{key} {nvme_path!r} is not writable ({exc.strerror})",
                                 hint="point nvme_path at a directory on a local disk you can write") from None
    return directory


def _create_nvme_path(path: Path, key: str, rank: int) -> None:
    """Create ``nvme_path`` when it is missing: only its last component can be (nvme_path_problem).
    Run by hand there is no launcher to have said so before start, so rank 0 says it, once."""
    try:
        path.mkdir()
    except FileExistsError:
        return
    if rank == 0 and not os.environ.get("ZERORUN_RUN_DIR"):
        print(f"zerorun: note: {key}: created {path} (its parent exists)", file=sys.stderr, flush=True)


def _make_locked(base: Path) -> None:
    """Create ``base`` holding a ``.lock`` this process has locked. The lock file is made and
    locked under a name no sweeper opens (``.lock-new``) and only then named ``.lock``: a
    sweeper that opened ``.lock`` between its creation and its locking used to take the lock,
    judge the directory dead and remove it from under the rank that was making it (two ranks
    of one host starting together: "nvme_path ... is not writable (No such file or directory)").
    A process killed inside this function leaves an empty ``.zerorun-new-*`` with no ``.lock``,
    which no sweeper removes: bytes, and only on a kill at this instant."""
    new = base.parent / f".zerorun-new-{secrets.token_hex(8)}"
    new.mkdir(mode=0o700)
    fd = os.open(new / _LOCK_BEING_MADE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno != errno.ENOLCK:  # a file system without locks: nothing is ever swept there
                raise
        os.rename(new / _LOCK_BEING_MADE, new / LOCK_FILE)  # a POSIX lock is the inode's: it stays held
        os.rename(new, base)
    except OSError:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    _held[base] = fd


def sweep_dead(nvme_path: Path) -> list[str]:
    """Remove the directories of ours under ``nvme_path`` whose process is dead: its lock can
    be taken (Note [scratch names]). The paths removed; a live one is never touched."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(nvme_path))
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        if path in _held or not (_NAME.match(entry.name) or _NEW.match(entry.name)):
            continue
        if _remove_if_dead(path):
            removed.append(str(path))
    return removed


def _remove_if_dead(path: Path) -> bool:
    """Remove ``path``, a scratch directory of ours, if its lock can be taken (its process is
    dead); whether it was removed. A live one, or one without a lock file, is never touched."""
    try:
        if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
            return False
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: not ours to judge (or being removed by its owner)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # alive (or no locks on this file system: then nothing is judged dead)
    try:
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def remove_if_empty(base: Path) -> None:
    """Remove this process's rank directory once no placement uses it (its lock last)."""
    with _lock:
        try:
            if [entry.name for entry in os.scandir(base)] not in ([], [LOCK_FILE]):
                return  # another engine's files are still there; their own finalizers remove them
            (base / LOCK_FILE).unlink(missing_ok=True)
            base.rmdir()
        except OSError:
            pass
        fd = _held.pop(base, None)
        if fd is not None:
            os.close(fd)


def records_folder(run_dir: str | os.PathLike, launch: str | None) -> Path:
    """``RUN_DIR/scratch/<launch>`` (``RUN_DIR/scratch`` for a worker started without one)."""
    records = Path(run_dir) / "scratch"
    return records / launch if launch and _LAUNCH_ID.match(launch) else records


def _record(base: Path, rank: int) -> None:
    run_dir = os.environ.get("ZERORUN_RUN_DIR")
    if not run_dir or not os.path.isdir(run_dir):
        return
    records = records_folder(run_dir, os.environ.get(LAUNCH_ID_ENV))
    try:
        records.mkdir(parents=True, exist_ok=True)
        (records / f"rank{rank}").write_text(str(base) + "\n")
    except OSError:
        pass  # the start-up removal still bounds what a lost record costs


def sweep_recorded(run_dir: str | os.PathLike, ranks: Iterable[int] | None = None,
                   launch: str | None = None) -> list[str]:
    """Remove the scratch directories that ``ranks`` (default: every rank) of ``launch`` recorded
    in ``run_dir`` (for the agent of their host, after its workers exited: Note [scratch names]);
    the paths removed. Only directories named like ours whose lock no live process holds are
    touched, whatever a record says."""
    removed: list[str] = []
    records = records_folder(run_dir, launch)
    if not records.is_dir():
        return removed
    wanted = None if ranks is None else {f"rank{rank}" for rank in ranks}
    for record in sorted(records.iterdir()):
        if wanted is not None and record.name not in wanted:
            continue
        try:
            target = Path(record.read_text(errors="replace").strip())
        except OSError:
            continue
        if target.is_absolute() and _NAME.match(target.name) and target not in _held and _remove_if_dead(target):
            removed.append(str(target))
        record.unlink(missing_ok=True)
    if launch and records != Path(run_dir) / "scratch":
        try:
            records.rmdir()  # empty once every rank's record is gone
        except OSError:
            pass
    return removed


def human_bytes(n: int) -> str:
    """Bytes in the largest unit that keeps a number >= 1 (never "0.0 GiB" for 300 KiB)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def local_ranks(environ: Mapping[str, str] = os.environ) -> int:
    try:
        return max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def reserve(directory: Path, planned: int, written: int, key: str) -> None:
    """Note [scratch budget]: add ``planned`` bytes this process will hold under ``directory``,
    ``written`` of them already on disk, and raise unless the file system has room for what
    every rank of this host still has to write (ranks are alike, so this rank's share times
    LOCAL_WORLD_SIZE)."""
    device = os.stat(directory).st_dev
    with _lock:
        _planned[device] = _planned.get(device, 0) + planned
        _written[device] = _written.get(device, 0) + written
        still = (_planned[device] - _written[device]) * local_ranks()
        total = _planned[device] * local_ranks()
    free = shutil.disk_usage(directory).free
    if still > free:
        raise RuntimeConfigError(
            f"{key} {str(directory.parent.parent)!r}: its file system has {human_bytes(free)} free; the "
            f"{local_ranks()} rank(s) of this host need {human_bytes(total)} there in all, "
            f"{human_bytes(still)} of it still to write",
            hint="free space there or point nvme_path at a larger disk")


def release(directory: Path, planned: int, written: int) -> None:
    """Undo ``reserve`` when a placement's files are removed."""
    try:
        device = os.stat(directory.parent).st_dev
    except OSError:
        return
    with _lock:
        _planned[device] = max(0, _planned.get(device, 0) - planned)
        _written[device] = max(0, _written.get(device, 0) - written)
