"""The worker's side of checkpoint.on_signal: save a checkpoint when Slurm's warning signal comes.

The launcher (or Slurm itself, through the agent) sends each worker SIGUSR1 shortly before the
time limit (Note [Slurm signals] in zerorun/launch/signals.py). ``arm`` installs a handler that
only records the request: saving from inside a signal handler would run collectives at an
arbitrary point of a step. At every optimizer-step boundary ``due`` asks all ranks at once (one
1-element all-reduce, MAX) whether any rank got the signal, so every rank saves at the same step
even though the signal reaches them at slightly different moments. The engine then saves and the
worker exits 0 (``stop``). The all-reduce runs only in workers that were armed
(ZERORUN_SAVE_ON_SIGNAL=1, set by the launcher for checkpoint.on_signal).

Note [a worker's SIGTERM under Slurm]: Slurm signals every process of a step, so a preemption
SIGTERMs the workers of each agent step directly, at the same moment as their agent; by default
they would die at once and the checkpoint the grace time allows would be lost. So an armed
worker inside a Slurm job does not die of its first SIGTERM: it waits ``TERM_WAIT_S`` for the
launcher's verdict (Note [why Slurm sent SIGTERM] in zerorun/launch/slurm.py), which comes as
SIGUSR1 (a preemption: save and stop) or as the agent's own stop (another TERM, then KILL). With
no verdict in that time it ends as SIGTERM would have. A SIGTERM is never a save request by
itself: a ``scancel`` must not write a checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

ENV_NAME = "ZERORUN_SAVE_ON_SIGNAL"
# Seconds an armed worker in a Slurm job outlives its first SIGTERM, waiting for the verdict.
TERM_WAIT_S = 10.0
_armed = False
_requested = False
_term_timer: threading.Timer | None = None


def arm(environ=None) -> bool:
    """Install the SIGUSR1 handler where the launcher asked for it; True when armed."""
    global _armed
    environ = os.environ if environ is None else environ
    if environ.get(ENV_NAME) != "1" or _armed:
        return _armed
    signal.signal(signal.SIGUSR1, _note_request)
    # The agent starts workers with SIGUSR1 blocked (agent._die_with_parent): one that came
    # before this handler was pending all along and is delivered now, not lost and not fatal.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    if environ.get("SLURM_JOB_ID"):
        signal.signal(signal.SIGTERM, _await_verdict)  # Note [a worker's SIGTERM under Slurm]
    _armed = True
    return True


def _await_verdict(_signum, _frame) -> None:
    """First SIGTERM: SIGTERM gets its default action back (a second one, the agent's stop, ends
    the worker at once) and, unless SIGUSR1 (save) comes within TERM_WAIT_S, the worker ends as
    if this one had. Runs in the main thread, the only one that may set a handler."""
    global _term_timer
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _term_timer = threading.Timer(TERM_WAIT_S, lambda: None if _requested else os.kill(os.getpid(), signal.SIGTERM))
    _term_timer.daemon = True
    _term_timer.start()


def _note_request(_signum, _frame) -> None:
    global _requested
    _requested = True


def due(engine) -> bool:
    """At a step boundary: did any rank get the signal? Every rank must call it (a collective)."""
    if not _armed:
        return False
    import torch

    from zerorun.zero.comm import collectives

    flag = torch.tensor([1.0 if _requested else 0.0], device=engine.pg.device)
    collectives.all_reduce(flag, group=engine.group, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)


def stop(engine, saved_dir: str) -> None:
    """After the save: say so once and end this worker cleanly (exit 0: the launcher knows why)."""
    if engine.rank == 0:
        print(f"zerorun: checkpoint saved in {saved_dir} at step {engine.global_step} on the launcher's "
              "signal; stopping", file=sys.stderr, flush=True)
    raise SystemExit(0)
