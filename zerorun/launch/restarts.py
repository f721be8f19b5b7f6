"""``--max-restarts N`` (torchrun's ``--max_restarts``): after a worker failure the whole job is
started again, from the last complete checkpoint, up to N times, with a back-off.

Note [restart from the checkpoint]: a restart is a new start of every worker, as torchrun's is
(a static world cannot replace one rank). It is prepared afresh (a new token, a free port, its
own run directory ``RUN_DIR/restart-K``, so each attempt's logs and metrics stay apart) and,
when the config names ``checkpoint.dir``, with ``checkpoint.resume: true``: the engine loads the
latest complete checkpoint (a save cut short by the failure has no manifest and is skipped) and
a resumable script (examples/train_gpt.py) goes on from its step on the same batches, so the
losses from there equal an uninterrupted run's. Without ``checkpoint.dir`` the script starts over,
as under torchrun; it can tell the attempts apart by ``ZERORUN_RESTART_COUNT`` (also
``TORCHELASTIC_RESTART_COUNT``, torchrun's name). Only a worker's or host's failure restarts;
a stop asked for (Ctrl-C, a signal, scancel, a checkpoint-and-stop signal) never does.

Pure helpers here; the loop is in cli/run.py.
"""

from __future__ import annotations

import dataclasses
import os

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
RESTART_COUNT_VARS = ("ZERORUN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def backoff_s(restart: int) -> float:
    """Seconds to wait before restart ``restart`` (1, 2, 4, ... up to 30)."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (restart - 1))


def restartable(result) -> bool:
    """A failure of a worker or host, not a stop somebody asked for."""
    return (result.failure is not None and result.started and not result.interrupted
            and result.checkpoint_signal is None)


def restart_options(options, first_run_dir: str, restart: int, resume: bool):
    """The launch options of restart ``restart``: its own run directory, and resume from the
    checkpoint when there is a checkpoint directory to resume from."""
    overrides = dict(options.config_overrides or {})
    if resume:
        overrides["checkpoint.resume"] = True
    return dataclasses.replace(options, run_dir=os.path.join(first_run_dir, f"restart-{restart}"),
                               config_overrides=overrides)


def cause_text(failure) -> str:
    """One failure in a few words: who, and why."""
    who = f"rank {failure.rank} on host {failure.host}" if failure.rank is not None else f"host {failure.host}"
    return f"{who} failed: {failure.reason}"


def summary(causes: list[str], max_restarts: int) -> str:
    """The closing line's restart clause: how many of the allowed, and the cause of each."""
    done = f"{len(causes)} restart{'s' if len(causes) != 1 else ''} of --max-restarts {max_restarts}"
    return done + "".join(f"; restart {k} after {cause}" for k, cause in enumerate(causes, start=1))


def set_restart_count(restart: int, environ=os.environ) -> None:
    """What the workers of this attempt read (the launcher's environment is theirs)."""
    for name in RESTART_COUNT_VARS:
        environ[name] = str(restart)
