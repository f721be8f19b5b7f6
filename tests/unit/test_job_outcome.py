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


@pytest.mark.parametrize("cause, signum, in_slurm, words", [
    # What the closing line says at more length (docs/launch.md, the signal table): exit 138,
    # the job did not finish.
    (None, signal.SIGUSR1, True, "stopped for the time limit; checkpoint saved"),
    (None, signal.SIGUSR2, False, "stopped on SIGUSR2; checkpoint saved"),
    ("preempted", signal.SIGTERM, True, "preempted; checkpoint saved"),
    ("cancelled", None, True, "cancelled"),
    (None, None, False, None),  # the view's own flags say it: finished, failed or interrupted
])
def test_the_summary_header_names_a_save_on_a_signal(cause, signum, in_slurm, words):
    from zerorun.launch.outcome import summary_ending

    assert summary_ending(cause, signum, in_slurm=in_slurm) == words


def plain_view(tmp_path):
    import io

    from zerorun.ui.live import JobView

    out = io.StringIO()
    return JobView(run_dir=tmp_path, token="T", world_size=2, dashboard=False, stream=out), out


@pytest.mark.parametrize("slurm_ending, said", [
    (None, "stopped on SIGUSR1; checkpoint saved"),
    (lambda: None, "stopped for the time limit; checkpoint saved"),
])
def test_a_job_that_saved_on_sigusr1_and_stopped_is_not_called_finished(tmp_path, slurm_ending, said):
    """On main the summary of a job that every rank checkpointed on SIGUSR1 (checkpoint.on_signal)
    and stopped, exit 138, was headed "zerorun summary (finished after ...)"."""
    from zerorun.launch.plan import Target, build_plan
    from zerorun.launch.supervision_state import SaveRequest
    from zerorun.launch.supervisor import Supervisor

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir=str(tmp_path),
                      token="t", master_port=29500, local_names={"localhost"})
    view, out = plain_view(tmp_path)
    supervisor = Supervisor(plan, view, slurm_ending=slurm_ending)
    supervisor._failure = None  # as run() leaves it when every worker ended on its own
    supervisor.request_checkpoint(signal.SIGUSR1)
    supervisor._save.move(SaveRequest.PASSED_ON)
    supervisor._name_slurm_ending()
    view.stop(failed=False)
    text = " ".join(out.getvalue().split())  # a title longer than a small table wraps
    assert f"zerorun summary ({said} after" in text, text
    assert "finished" not in text


def test_a_job_that_saved_on_a_signal_after_a_restart_is_not_called_finished(tmp_path, capsys):
    """The closing lines of a CHECKPOINTED job after --max-restarts: the restarts ride on the
    save's line; on main a "the job finished; 1 restart ..." line came first."""
    from types import SimpleNamespace

    import typer

    from zerorun.cli import run

    result = JobResult(None, False, {}, str(tmp_path), checkpoint_signal=signal.SIGUSR1)
    job = SimpleNamespace(slurm=None, requeue=False, save_on_signal=True)
    with pytest.raises(typer.Exit) as ended:
        run.close_job(job, Outcome(JobState.CHECKPOINTED, result), "1 restart of --max-restarts 2")
    assert ended.value.exit_code == 138
    err = capsys.readouterr().err
    assert "finished" not in err, err
    assert ("SIGUSR1 received (a checkpoint request; not a Slurm job): every rank saved a checkpoint and stopped "
            f"(logs in {tmp_path}/logs); 1 restart of --max-restarts 2") in err, err
