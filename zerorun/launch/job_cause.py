"""The root cause of a job that several launchers run (pure): Note [one cause under srun].

Note [one cause under srun]: under ``srun --ntasks-per-node=1 zerorun`` every node's launcher
supervises its own node's workers only (Note [one view under srun] in job_view.py), so its
supervisor's first failure is the first among *its* ranks. A rank that raises on node 1 makes
node 0's ranks fail a moment later (a collective whose peer is gone), and node 0's supervisor,
which never sees rank 1's exit, would name its own rank as the cause. So node 0 also weighs the
failures the other nodes forward (exit code, when their launcher saw it, the rank's last output
lines) and picks the job's root cause as the supervisor picks one among local ranks: the
earliest failure, unless that one's own error names another rank (watchdog.cause_named) which
failed too, and not of a stop (supervisor.STOP_CODES). The times are wall-clock times of two
machines: a cluster's clocks agree (NTP) to far less than the time a rank takes to fail after
its peer's exit (raise, traceback, interpreter exit), so the earlier time is the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerorun.launch import watchdog
from zerorun.launch.processes import describe_exit
from zerorun.launch.supervisor import STOP_CODES, Failure


@dataclass(frozen=True)
class RemoteExit:
    """A worker of another node that exited non-zero, as its launcher forwarded it."""

    node: int
    host: str
    rank: int
    returncode: int
    at: float  # wall-clock time at which its launcher saw the exit
    tail: tuple[str, ...] = ()  # its last output lines (as shown: sanitised, cut)


def remote_failure(exit: RemoteExit, step_run_dir: Path) -> Failure:
    """A Failure of another node's rank; its reason points at that node's log of the rank,
    which node 0's own logs directory does not have."""
    log = step_run_dir / f"node{exit.node}" / "logs" / f"rank{exit.rank}.log"
    reason = f"{describe_exit(exit.returncode)} (its log: {log}, and node {exit.node}'s output)"
    return Failure(exit.host, exit.rank, reason, exit.returncode, list(exit.tail))


def job_root_cause(local: tuple[float, Failure] | None, remote: Sequence[RemoteExit],
                   step_run_dir: Path) -> Failure | None:
    """The job's root cause from this node's failure (when it was decided, the failure) and the
    other nodes' failed exits (Note [one cause under srun]); None when nothing failed."""
    candidates = [] if local is None else [local]
    candidates += [(exit.at, remote_failure(exit, step_run_dir)) for exit in remote if exit.returncode != 0]
    if not candidates:
        return None
    # min() keeps the first of equal times: this node's own failure wins a tie.
    first = min(candidates, key=lambda candidate: candidate[0])[1]
    named = watchdog.cause_named(first.log_tail)
    if named is None or named == first.rank:
        return first
    for _, failure in sorted(candidates, key=lambda candidate: candidate[0]):
        if failure.rank == named and failure.returncode not in STOP_CODES:
            return failure
    return first
