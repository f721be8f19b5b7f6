"""pytest tests/unit/test_job_outcome.py — Note [job state] in zerorun/launch/outcome.py: the flags of a
JobResult read once into one state, in one order of precedence, and the exit status of each."""

from __future__ import annotations

import signal

import pytest

from zerorun.launch.outcome import JobState, Outcome, job_state
from zerorun.launch.supervisor import Failure, JobResult

FAILED = Failure("h", 1, "exit code 1")


@pytest.mark.parametrize("result, slurm_ended, state, code", [
    (JobResult(None, True, {}, "r", signal=signal.SIGTERM, started=False), False, JobState.NOT_STARTED, 143),
    # A signal to the launcher outranks the failures its stop caused.
    (JobResult(FAILED, True, {}, "r", signal=signal.SIGINT), True, JobState.INTERRUPTED, 130),
    (JobResult(None, False, {}, "r", checkpoint_signal=signal.SIGUSR1), False, JobState.CHECKPOINTED, 138),
    (JobResult(FAILED, False, {}, "r"), True, JobState.SLURM_ENDED, 143),
    (JobResult(FAILED, False, {}, "r"), False, JobState.FAILED, 1),
    (JobResult(None, False, {}, "r"), False, JobState.SUCCEEDED, 0),
    # A save asked for but never passed on: the job ended on its own.
    (JobResult(None, False, {}, "r", checkpoint_signal=None), True, JobState.SUCCEEDED, 0),
])
def test_each_result_has_one_state_and_its_exit_status(result, slurm_ended, state, code):
    assert job_state(result, slurm_ended) is state
    assert Outcome(state, result).exit_code == code


def test_the_launcher_closes_every_state():
    from zerorun.cli import run

    closers = {name for name in dir(run) if name.startswith("close_") and name != "close_job"}  # one per state
    assert len(closers) == len(JobState)
