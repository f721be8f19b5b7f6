"""What a launched job came to: its final state as one enum, its outcome as one value (pure).

Note [job state]: the supervisor's JobResult says what happened in flags (``started``,
``interrupted``, ``checkpoint_signal``, ``failure``), and the launcher's closing line, exit status
and requeue depend on which of them hold together, and on whether Slurm was ending the job's
steps. ``job_state`` reads them once, in one order of precedence, into one ``JobState``
(torchelastic's ``WorkerState``/``RunResult`` are the model): a signal before the start outranks
everything, a signal to the launcher outranks the failures it caused, a save on a signal is no
failure, and workers killed by Slurm are Slurm's doing, not a rank's. ``cli/run.py`` then has one
small function per state.

The end-of-run summary is drawn before that (the supervisor stops the view as its last act), so
its header is chosen from the same facts by ``summary_ending``: a job that saved on a signal and
stopped did not "finish" (it exits 128 + the signal), and one Slurm ended did not "fail".
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from enum import Enum

# Slurm's stop causes (launch/slurm.py STOP_CAUSES) as the summary's header says them.
SLURM_ENDINGS = {"cancelled": "cancelled", "preempted": "preempted", "requeued": "requeued",
                 "time limit": "ended at its time limit", "node failure": "ended by a node failure"}


class JobState(Enum):
    """How the job ended (its last attempt, after any --max-restarts)."""

    NOT_STARTED = "a stopping signal came before any worker started"
    INTERRUPTED = "the launcher was signalled (Ctrl-C, SIGTERM, SIGHUP) and stopped every worker"
    CHECKPOINTED = "every rank saved a checkpoint on a signal and stopped"
    SLURM_ENDED = "the workers died because Slurm ended the job's steps (scancel, time limit, preemption)"
    FAILED = "a worker or a host failed: the root cause is named"
    SUCCEEDED = "every worker finished"


def job_state(result, slurm_ended: bool) -> JobState:
    """The state of a supervisor's JobResult; ``slurm_ended``: Slurm says it is ending the job
    (only asked about a failed job under Slurm)."""
    if not result.started:
        return JobState.NOT_STARTED
    if result.interrupted:
        return JobState.INTERRUPTED
    if result.failure is None:
        return JobState.SUCCEEDED if result.checkpoint_signal is None else JobState.CHECKPOINTED
    return JobState.SLURM_ENDED if slurm_ended else JobState.FAILED


@dataclass(frozen=True)
class Outcome:
    """The job's state with what the closing line needs: the JobResult, and under Slurm why it
    is ending the job (``slurm_cause``, ``slurm_words``: slurm.stop_cause and it in words)."""

    state: JobState
    result: object
    slurm_cause: str | None = None
    slurm_words: str | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal for a job stopped by one (143 for Slurm's SIGTERM); 1 for a failure."""
        if self.state is JobState.SUCCEEDED:
            return 0
        if self.state is JobState.FAILED:
            return 1
        if self.state is JobState.SLURM_ENDED:
            return 128 + 15
        if self.state is JobState.CHECKPOINTED:
            return 128 + self.result.checkpoint_signal  # type: ignore[attr-defined]
        return 128 + (getattr(self.result, "signal", None) or 2)


def summary_ending(cause: str | None, checkpoint_signal: int | None, *, in_slurm: bool) -> str | None:
    """Note [job state]: the summary header's words where the view's own flags (failed,
    interrupted) would say "failed" or "finished" wrongly, else None. ``checkpoint_signal``: the
    signal every rank saved on (a CHECKPOINTED job, exit 128 + it); ``cause``: slurm.stop_cause,
    where asked. Short, as a table's title must be; the closing line says the rest."""
    if checkpoint_signal is not None:
        # signals.signal_meaning's cases: a preemption's signal, Slurm's USR1/USR2 before the
        # time limit, or outside Slurm someone's checkpoint request.
        why = ("preempted" if cause == "preempted" else "stopped for the time limit" if in_slurm
               else f"stopped on {signal.Signals(checkpoint_signal).name}")
        return f"{why}; checkpoint saved"
    return SLURM_ENDINGS.get(cause or "")
