"""Running a prepared job: pre-flight, the run directory, the view, the supervisor, and the
launcher's signal handlers (Note [Slurm signals] in signals.py) from start to end.

``execute`` is what ``zerorun`` runs after ``prepare.prepare``; it returns the supervisor's
JobResult. Signals that came before it (Note [signals from the first instant] in
early_signals.py) are acted on here.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.launch import signals
from zerorun.launch.prepare import PreparedJob, write_run_dir


class ForgivingStream:
    """stdout for the view, which outlives the reader going away (``zerorun ... | head``).

    The job is not the terminal's: when the reader closes the pipe the job runs on (its logs
    get everything) and exits with its own status. Later writes are dropped, and fd 1 is
    pointed at /dev/null so the interpreter's own flush at exit cannot fail either.
    """

    def __init__(self, stream):
        self._stream = stream
        self.closed_by_reader = False

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_gone()

    def _reader_gone(self) -> None:
        self.closed_by_reader = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, AttributeError, ValueError):
            pass

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def step_view(job: PreparedJob, default, extra: dict):
    """Under ``srun ... zerorun`` on several nodes: node 0's view shows every node's ranks and
    the others forward theirs to it (Note [one view under srun] in job_view.py)."""
    role = job.step_role
    if role is None or len(role.nodes) < 2:
        return default
    from zerorun.launch import job_view

    extra.update(nodes=role.nodes, per_node=len(job.plan.nodes[0].workers))
    if role.node_rank == 0:
        return job_view.JobWideView
    extra["node_rank"] = role.node_rank
    return job_view.NodeView


def execute(job: PreparedJob, view_factory=None):
    """Pre-flight, write the run dir, start and supervise; returns a JobResult."""
    from zerorun.launch import early_signals
    from zerorun.launch.preflight import preflight
    from zerorun.launch.supervisor import JobResult

    # Note [signals from the first instant] (early_signals.py): what came before now, and during
    # the pre-flight, is acted on here; a stopping signal means nothing starts at all.
    early: list[int] = []

    def stopped_before_start() -> JobResult | None:
        early.extend(early_signals.take())
        signum = early_signals.first_stop(early, job.save_on_signal)
        if signum is None:
            return None
        return JobResult(None, True, {}, job.plan.run_dir, signal=signum, started=False)

    if (result := stopped_before_start()) is not None:
        return result
    try:
        preflight(job.plan, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options)
    except LaunchError:
        if (result := ended_by_slurm_before_start(job)) is not None:
            return result
        raise
    if (result := stopped_before_start()) is not None:
        return result
    write_run_dir(job)
    supervisor = _supervisor(job, _view(job, view_factory))
    return _supervise(job, supervisor, early)


def ended_by_slurm_before_start(job: PreparedJob):
    """A pre-flight that failed because Slurm is ending the job (scancel under salloc kills the
    probe steps: "Job ... has expired") is no pre-flight problem: the JobResult of a job stopped
    before any worker started, which says why (run.py words it), else None."""
    from zerorun.launch.supervisor import JobResult

    if job.slurm is None or signals.slurm_stop_cause(job.slurm) is None:
        return None
    return JobResult(None, True, {}, job.plan.run_dir, signal=signal.SIGTERM, started=False)


def _view(job: PreparedJob, view_factory):
    """The job's view: ``view_factory``'s, else the dashboard or plain lines on stdout (under
    srun, node 0's job-wide view or another node's, ``step_view``)."""
    extra = {}
    if view_factory is None:
        from zerorun.ui.live import JobView as view_factory

        extra["stream"] = ForgivingStream(sys.stdout)
        view_factory = step_view(job, view_factory, extra)
    return view_factory(
        run_dir=Path(job.plan.run_dir), token=job.token, world_size=job.plan.world_size,
        dashboard=job.options.dashboard, **extra,
    )


def _supervisor(job: PreparedJob, view):
    from zerorun.launch.supervisor import Supervisor

    return Supervisor(
        job.plan, view, grace_s=job.options.grace_s, ssh_port=job.options.ssh_port, ssh_options=job.ssh_options,
        files={f"{job.plan.run_dir}/config.json": job.config_json}, token=job.token,
        hang_timeout_s=job.hang_timeout_s, hang_warn_s=job.hang_warn_s, startup_timeout_s=job.startup_timeout_s,
        # Note [why Slurm sent SIGTERM]: with on_signal a preemption's SIGTERM saves, as USR1 does.
        is_preemption=(lambda: signals.slurm_stop_cause(job.slurm) == "preempted")
        if job.save_on_signal and job.slurm is not None else None,
        slurm_ending=(lambda: signals.slurm_stop_cause(job.slurm)) if job.slurm is not None else None,
        preempted_already=(lambda: signals.slurm_stop_cause(job.slurm) == "preempted") if job.slurm is not None else None,
    )


def _supervise(job: PreparedJob, supervisor, early: list[int]):
    """Run the supervisor with the launcher's signal handlers installed (Note [Slurm signals]),
    after acting on the signals that came before (``early``); the previous handlers after."""
    from zerorun.launch import early_signals

    def on_signal(signum, _frame):
        if signum in signals.CHECKPOINT_SIGNALS and job.save_on_signal:
            supervisor.request_checkpoint(signum)
        elif signum == signal.SIGTERM:
            supervisor.judge_term(signum)  # stops, unless Slurm says it is a preemption (on_signal)
        else:
            supervisor.interrupt(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in signals.HANDLED_SIGNALS}
    for signum in early + early_signals.take():
        on_signal(signum, None)  # a checkpoint signal from before the start: saved at the first step
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
