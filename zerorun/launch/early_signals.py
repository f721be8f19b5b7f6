"""Signals that reach the launcher before it supervises anything: remembered, never fatal.

Note [signals from the first instant]: Slurm may send ``--signal=B:USR1@N`` up to a minute
early, so within the first second of a short job, and a preemption or ``scancel`` can come at any
time. Until the launcher installs its handlers the default actions apply: SIGUSR1 kills the
process (the batch step then ends FAILED 0:10, no message, no requeue) and SIGTERM ends it with
nothing said. So the first thing ``zerorun`` does (cli/main.py, before typer is even imported)
is ``install()``: the handler here only records the signal. The launcher takes the record over
when it starts the job (``run_job.execute``): a stopping signal (TERM, HUP; USR1/USR2 without
checkpoint.on_signal) that came before any worker started ends the run there, with its meaning
and nothing started; a checkpoint signal is handed to the supervisor, which asks for the save
as soon as every rank has made a step (Note [save request waits for training]). Commands other
than a launch get the default actions back (``release``), and a signal recorded meanwhile is
raised again, so ``zerorun estimate`` still dies of SIGTERM as any program does.
"""

from __future__ import annotations

import signal

EARLY_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
CHECKPOINT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

_pending: list[int] = []
_previous: dict[int, object] = {}


def _remember(signum, _frame) -> None:
    _pending.append(signum)


def install() -> None:
    """Record EARLY_SIGNALS from now on (main thread only; a no-op elsewhere)."""
    for sig in EARLY_SIGNALS:
        try:
            previous = signal.signal(sig, _remember)
        except ValueError:  # not the main thread (an embedding program): leave its handlers alone
            return
        _previous.setdefault(sig, previous)


def take() -> list[int]:
    """The signals recorded so far, oldest first, and forget them."""
    taken = list(_pending)
    del _pending[: len(taken)]
    return taken


def first_stop(taken: list[int], save_on_signal: bool) -> int | None:
    """The signal among ``taken`` that stops the job before it starts, or None (pure)."""
    for signum in taken:
        if signum not in CHECKPOINT_SIGNALS or not save_on_signal:
            return signum
    return None


def release(raise_pending: bool) -> None:
    """Give the handlers back. With ``raise_pending`` (a command that launches nothing) any signal
    recorded meanwhile is raised again and takes its ordinary effect; after a launch the
    launcher has acted on every signal it saw, and the process is ending anyway."""
    for sig, previous in _previous.items():
        signal.signal(sig, previous)  # type: ignore[arg-type]
    _previous.clear()
    taken = take()
    for signum in taken if raise_pending else ():
        signal.raise_signal(signum)
