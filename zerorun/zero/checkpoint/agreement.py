"""Every rank agrees on whether a step of a save or a load succeeded everywhere.

``pytest tests/distributed/test_checkpoint_failures.py`` runs its tests; checkpoint/save.py and
checkpoint/load.py call ``together`` around each step that can fail on one rank alone.
"""

from __future__ import annotations

import torch

from zerorun.errors import CheckpointError, ZerorunError
from zerorun.zero.comm import collectives


def together(engine, work, what: str, hint: str) -> None:
    """Note [failing together]: run ``work`` (None: nothing on this rank), then agree with every
    rank on whether all succeeded. A failure on one rank used to leave the others at the next
    barrier, to die of a misleading "connection closed" once it exited; now the rank that failed
    raises its own one-line error and every other rank one naming that rank."""
    failure = None
    try:
        if work is not None:
            work()
    except (ZerorunError, OSError) as exc:
        failure = exc
    if engine.pg.world_size > 1:
        flags = torch.zeros(engine.pg.world_size, dtype=torch.int32, device=engine.pg.device)
        flags[engine.pg.rank] = failure is not None
        collectives.all_reduce(flags, group=engine.pg.group)
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    else:
        failed = [0] if failure is not None else []
    if failure is not None:
        if isinstance(failure, OSError):
            raise CheckpointError(f"rank {engine.pg.rank}: {what} failed ({failure})") from None
        raise failure
    if failed:
        raise CheckpointError(f"rank {engine.pg.rank}: {what} failed on rank {failed[0]} (its error says why)", hint=hint)


