"""How long a Slurm preemption lets a job save, as a worker reads it (pure but for ``os.environ``).

Note [preemption grace]: a partition with ``PreemptMode=REQUEUE`` (or CANCEL) and ``GraceTime=N``
sends a preempted job SIGTERM and kills it N seconds later. With checkpoint.on_signal every rank
saves on that SIGTERM (Note [why Slurm sent SIGTERM] in zerorun/launch/slurm.py); a save that
takes longer than N is cut off, and the requeued job resumes from the last complete checkpoint
(Note [commit order] in zerorun/zero/checkpoint/save.py keeps that one intact), losing the steps
since. The launcher reads the partition's GraceTime once at start-up, prints it, and hands it to
the workers in ``GRACE_ENV``; rank 0 compares every save's time with it and says so, once, when a
save took longer: the first interval checkpoint tells a user at the start of a job, not at the
preemption, that the grace cannot hold a save.

A save on the signal waits for the step in progress to end (the ranks agree on the step,
worker/save_on_signal.py), so what must fit in the grace is up to one step plus a save. Rank 0
also compares one step with the grace after the first steps (``CHECK_AT_STEP``: the first ones
warm up), and one step plus the save after each save, and says it once when it cannot fit; and a
requeued start's launcher, which continues the run directory, compares the previous start's step
and last save with it before anything starts (``start_up_line``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

GRACE_ENV = "ZERORUN_PREEMPT_GRACE_S"
PARTITION_ENV = "SLURM_JOB_PARTITION"
CHECK_AT_STEP = 3  # this process's third step: the first ones include warm-up
_said = False
_steps_seen = 0
_step_s: float | None = None


def grace_seconds(environ: Mapping[str, str] | None = None) -> float | None:
    """The preemption grace time the launcher found, or None (not under Slurm, no preemption,
    no grace, or no launcher)."""
    value = (os.environ if environ is None else environ).get(GRACE_ENV, "")
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds > 0 else None


def slow_save_line(save_s: float, grace_s: float, partition: str | None) -> str:
    """The one line said when a save took longer than the grace time (pure)."""
    where = f"partition {partition}'s" if partition else "the partition's"
    return (f"zerorun: this checkpoint took {save_s:.1f} s to save, longer than {where} preemption grace "
            f"time of {grace_s:g} s: a save on preemption would be cut off, and the requeued job would "
            "resume from the last complete checkpoint (ask for a longer GraceTime, or save less state)")


def no_fit_line(step_s: float, save_s: float | None, grace_s: float, partition: str | None) -> str | None:
    """The one line said when one step (plus a save, once one was timed) cannot fit in the
    grace time, else None (pure)."""
    needed = step_s + (save_s or 0.0)
    if needed <= grace_s:
        return None
    where = f"partition {partition}'s" if partition else "the partition's"
    what = (f"one step ({step_s:.1f} s) plus a save ({save_s:.1f} s)" if save_s is not None
            else f"one step ({step_s:.1f} s), before any save,")
    return (f"{what} takes longer than {where} preemption grace time of {grace_s:g} s: a save on "
            "preemption waits for the step in progress, so it would be cut off and the requeued job would "
            "resume from the last complete checkpoint (ask for a longer GraceTime, or make steps shorter)")


def note_save_time(save_s: float, environ: Mapping[str, str] | None = None) -> str | None:
    """The line to print after a save of ``save_s`` seconds, once per process; None otherwise."""
    global _said
    environ = os.environ if environ is None else environ
    grace = grace_seconds(environ)
    if _said or grace is None:
        return None
    line = (slow_save_line(save_s, grace, environ.get(PARTITION_ENV)) if save_s > grace
            else None if _step_s is None else said(no_fit_line(_step_s, save_s, grace, environ.get(PARTITION_ENV))))
    _said = line is not None
    return line


def note_step_time(step_s: float, environ: Mapping[str, str] | None = None) -> str | None:
    """After each step: the time is kept for the save's comparison, and at ``CHECK_AT_STEP`` a
    step alone is compared with the grace; the line to print (once per process) or None."""
    global _said, _steps_seen, _step_s
    environ = os.environ if environ is None else environ
    grace = grace_seconds(environ)
    if grace is None:
        return None
    _steps_seen += 1
    if _steps_seen < CHECK_AT_STEP:
        return None
    _step_s = step_s
    if _said or _steps_seen != CHECK_AT_STEP:
        return None
    line = said(no_fit_line(step_s, None, grace, environ.get(PARTITION_ENV)))
    _said = line is not None
    return line


def said(line: str | None) -> str | None:
    return None if line is None else f"zerorun: {line}"


# Rank 0's line after each save (zero/checkpoint/save.py): a requeued start reads the last one.
SAVED = re.compile(r"zerorun: checkpoint \S+ saved to .* in ([0-9.]+) s \(")


def previous_start(metrics_lines: Iterable[str], log_lines: Iterable[str]) -> tuple[float | None, float | None]:
    """(step time, save time) of an earlier start of this job (pure), from the run directory a
    requeued start continues: the median of rank 0's step times after warm-up (metrics.jsonl) and
    its last save (its log); None where there is none."""
    steps = []
    for line in metrics_lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "step" and record.get("rank") == 0:
            steps.append(record.get("step_time_s"))
    times = sorted(t for t in steps[CHECK_AT_STEP - 1:] if isinstance(t, (int, float)))
    saves = [float(m.group(1)) for m in map(SAVED.search, log_lines) if m]
    return (times[len(times) // 2] if times else None), (saves[-1] if saves else None)


def start_up_line(run_dir: str, grace_s: float, partition: str | None) -> str | None:
    """At a requeued start: whether the previous start's step plus save fits in the grace (None:
    it fits, or there is no previous start to go on)."""
    base = Path(run_dir)
    try:
        metrics = (base / "metrics.jsonl").read_text(errors="replace").splitlines()
        log = (base / "logs" / "rank0.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    step_s, save_s = previous_start(metrics, log)
    line = None if step_s is None else no_fit_line(step_s, save_s, grace_s, partition)
    return None if line is None else f"at this job's previous start, {line}"
