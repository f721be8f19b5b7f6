"""The names the host channel gives its files in /dev/shm, and who removes them (stdlib only:
the launcher's agent imports it without torch).

Used by comm/host_channel.py and launch/agent.py; tests: tests/distributed/test_cpu_collectives.py,
tests/e2e/test_faults.py.

Note [shm cleanup]: a rank's outbox and inbox exist, linked, only while its group opens the
channel: created after every rank of the group has reached its first collective (a barrier, so
a rank that fails earlier leaves its peers waiting with nothing created), unlinked once every
rank has opened them, and unlinked on every error path in between. What remains is a SIGKILL
inside that window of milliseconds, so the names carry the owner's pid
(``zerorun-outbox-p<pid>-<random>``) and two others remove them: the agent, once its workers
have exited, removes the names of its workers' pids (and its guardian does the same when the
agent itself was killed); and any rank opening a channel removes names whose pid is no longer
a live process, left more than STALE_S ago by a job that had neither.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable

from zerorun.errors import RuntimeConfigError

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"zerorun-(?:outbox|inbox)-p([0-9]+)-[A-Za-z0-9_]+\Z")
STALE_S = 60.0  # older than any open window: never a live job's file in another pid namespace


def channel_wanted(environ) -> bool:
    """``ZERORUN_HOST_CHANNEL``: 1 (the default) uses the channel where it can, 0 never. The
    launcher checks it before start (and each rank again, for scripts started by hand)."""
    raw = environ.get("ZERORUN_HOST_CHANNEL", "1").strip()
    if raw not in ("0", "1"):
        raise RuntimeConfigError(f"ZERORUN_HOST_CHANNEL is {raw!r}; it must be 1 (shared memory between "
                                 "ranks on one host, the default) or 0 (gloo's TCP ring)")
    return raw == "1"


def outbox_prefix(pid: int | None = None) -> str:
    return f"zerorun-outbox-p{os.getpid() if pid is None else pid}-"


def inbox_path(outbox_path: str) -> str:
    directory, name = os.path.split(outbox_path)
    return os.path.join(directory, name.replace("zerorun-outbox-", "zerorun-inbox-", 1))


def _ours(shm_dir: str) -> Iterable[tuple[str, int]]:
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return
    for entry in entries:
        match = _NAME.match(entry.name)
        if match:
            yield entry.path, int(match.group(1))


def remove_files_of(pids: Iterable[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the channel files of processes ``pids`` (they have exited); the paths removed."""
    wanted = set(pids)
    removed = []
    for path, pid in _ours(shm_dir):
        if pid in wanted:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def remove_stale(shm_dir: str = SHM_DIR, now: float | None = None) -> list[str]:
    """Unlink channel files of ours whose pid is not a live process and that are older than
    STALE_S (Note [shm cleanup]); the paths removed."""
    now = time.time() if now is None else now
    removed = []
    for path, pid in _ours(shm_dir):
        try:
            info = os.lstat(path)
            if info.st_uid != os.getuid() or now - info.st_mtime < STALE_S or os.path.exists(f"/proc/{pid}"):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
