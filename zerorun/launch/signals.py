"""What a signal to the launcher means and what Slurm says about it: Note [Slurm signals].

The pure part (``signal_plan``, ``signal_meaning``) words what each signal does and did; the
rest asks Slurm (``scontrol``) why it is ending the job, which nodes are down, how long a
preemption's grace time is, and requeues the job. The handlers that act on the signals are
installed by ``run_job.execute``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable, Mapping

from zerorun.launch import slurm

# Note [Slurm signals]: Slurm talks to a job with signals. scancel, the time limit and
# preemption send SIGTERM (then SIGKILL after KillWait); ``--signal=B:USR1@N`` sends SIGUSR1 to
# the batch script N seconds before the time limit; a closed salloc/terminal session sends
# SIGHUP. The launcher handles all of them: TERM, HUP and INT stop every worker (grace, then
# KILL) and end with 128+signal; with checkpoint.on_signal, USR1/USR2 instead ask every worker
# to save a checkpoint (agent -> SIGUSR1 to each worker; the ranks agree on the step,
# worker/save_on_signal.py) and stop, and with checkpoint.requeue the launcher then runs
# ``scontrol requeue`` so the next start resumes (``checkpoint.resume``). Without on_signal,
# USR1/USR2 stop the job like TERM. The last message says what the signal meant, asking
# Slurm for the job's record where SIGTERM alone cannot tell (``signal_meaning``, Note [why
# Slurm sent SIGTERM] in slurm.py).

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
CHECKPOINT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def signal_plan(save_on_signal: bool, requeue: bool) -> list[str]:
    """What each signal will do, for --dry-run and ``zerorun env`` (pure)."""
    usr = "stop every worker (checkpoint.on_signal: true saves a checkpoint first)"
    if save_on_signal:
        usr = "every rank saves a checkpoint at the next step, then stops" + (
            "; then scontrol requeue (the next start resumes)" if requeue else "")
    term = "signals: SIGTERM (scancel, time limit, preemption) and SIGHUP stop every worker, exit 128+signal"
    if save_on_signal:
        term = ("signals: SIGTERM of a preemption (the job's record says so) saves like SIGUSR1; SIGTERM of "
                "scancel or the time limit, and SIGHUP, stop every worker, exit 128+signal")
    return [term, f"signals: SIGUSR1/SIGUSR2 (sbatch --signal=B:USR1@SECONDS): {usr}"]


def signal_meaning(signum: int, cause: str | None = None, in_slurm: bool = False) -> str:
    """What a signal that stopped the job meant, in words (pure); ``cause`` from
    ``slurm.stop_cause`` (Note [why Slurm sent SIGTERM] in slurm.py)."""
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return "interrupted (Ctrl-C)"
    if signum == signal.SIGHUP:
        return "hung up (SIGHUP: the session went away)"
    if cause == "preempted":
        return f"preempted ({name})"  # SIGTERM, or USR1 with preempt_send_user_signal
    if signum in CHECKPOINT_SIGNALS:
        # Outside Slurm nothing has a time limit: someone (a user, a scheduler) asked for a save.
        return f"time limit near ({name})" if in_slurm else f"{name} received (a checkpoint request; not a Slurm job)"
    if cause == "time limit":
        return f"time limit ({name})"
    if cause == "node failure":
        return f"node failure ({name})"
    if cause == "requeued":
        return f"preempted or requeued ({name}; Slurm requeued the job)"
    if cause == "cancelled":
        return f"cancelled ({name}, scancel)"
    if in_slurm:
        return f"signalled ({name}) while Slurm still runs the job (scancel --signal or kill)"
    return f"interrupted ({name})"  # outside Slurm: someone (kill, a supervisor) stopped it


def scontrol_show(kind: str, name: str, timeout_s: float = 3.0) -> str | None:
    """``scontrol -o show KIND NAME`` (one line per entity), or None when it cannot be asked."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "-o", "show", kind, name], capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def slurm_job_record(job_id: int, timeout_s: float = 3.0) -> dict[str, str] | None:
    """The job's record as ``scontrol -o show job`` prints it, or None when it cannot be asked."""
    text = scontrol_show("job", str(job_id), timeout_s)
    return None if text is None else slurm.parse_job_record(text)


def slurm_stop_cause(ctx: slurm.SlurmContext | None) -> str | None:
    """Why Slurm is ending this job now (asks scontrol; None outside Slurm or when it is not)."""
    if ctx is None:
        return None
    record = slurm_job_record(ctx.job_id)
    ending = record is not None and record.get("JobState", "").upper() not in ("RUNNING", "")
    down = slurm_down_nodes(ctx.job_nodes) if ending else []
    cause = slurm.stop_cause(record, ctx.restart_count, end_time=ctx.end_time, now=time.time(), down=down)
    if cause == "requeued":
        # A node that failed and came straight back is no longer down: accounting still says so.
        cause = slurm.requeue_cause(sacct_states(ctx.job_id)) or cause
    return cause


def sacct_states(job_id: int, timeout_s: float = 5.0) -> list[str]:
    """The state of every run of the job, oldest first (``sacct -D -X``); [] without accounting."""
    import subprocess

    try:
        done = subprocess.run(["sacct", "-j", str(job_id), "-D", "-X", "-n", "-P", "-o", "State"],
                              capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


def slurm_down_nodes(nodes: Iterable[str], timeout_s: float = 3.0) -> list[str]:
    """Which of ``nodes`` Slurm has marked down or not responding ([] when it cannot be asked)."""
    names = ",".join(nodes)
    text = scontrol_show("node", names, timeout_s) if names else None
    return [] if text is None else slurm.down_nodes(text)


def read_partition_grace(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """(partition, grace seconds) of this job's partition, asking scontrol once (Note [preemption
    grace] in zerorun/worker/preemption_grace.py); None outside Slurm, without a grace time, or
    when scontrol cannot answer (the run goes on without)."""
    partition = environ.get("SLURM_JOB_PARTITION", "")
    if not environ.get("SLURM_JOB_ID") or not partition or "," in partition:
        return None
    text = scontrol_show("partition", partition, timeout_s=10)
    grace = None if text is None else slurm.partition_grace(slurm.parse_job_record(text))
    return None if grace is None else (partition, grace)


def requeue_slurm_job(job_id: int) -> str | None:
    """``scontrol requeue JOB``; None when done, else why not (one line)."""
    import subprocess

    try:
        done = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue failed: {err}"
    if done.returncode != 0:
        return "scontrol requeue failed: " + (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return None
