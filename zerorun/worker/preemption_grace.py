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
"""

from __future__ import annotations

import os
from collections.abc import Mapping

GRACE_ENV = "ZERORUN_PREEMPT_GRACE_S"
PARTITION_ENV = "SLURM_JOB_PARTITION"
_said = False


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


def note_save_time(save_s: float, environ: Mapping[str, str] | None = None) -> str | None:
    """The line to print after a save of ``save_s`` seconds, once per process; None otherwise."""
    global _said
    environ = os.environ if environ is None else environ
    grace = grace_seconds(environ)
    if _said or grace is None or save_s <= grace:
        return None
    _said = True
    return slow_save_line(save_s, grace, environ.get(PARTITION_ENV))
