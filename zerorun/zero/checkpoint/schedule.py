"""The checkpoints the engine takes on its own, from the config's checkpoint section.

Used by zero/engine.py: ``claim_on_start`` and ``resume_from_config`` in ``initialize``
(``checkpoint.dir``; ``checkpoint.resume``, ``zerorun --resume``) and ``save_on_interval`` after every optimizer step
(``checkpoint.interval_steps``, ``checkpoint.on_signal``). The saving and loading themselves
are checkpoint/save.py's and checkpoint/load.py's.
"""

from __future__ import annotations

import os
import sys

import torch

from zerorun.errors import CheckpointError, RuntimeConfigError
from zerorun.zero.checkpoint import owner
from zerorun.zero.checkpoint.agreement import together
from zerorun.zero.checkpoint.load import load_checkpoint
from zerorun.zero.checkpoint.save import save_checkpoint
from zerorun.zero.comm import collectives


def claim_on_start(engine) -> None:
    """Note [refused before training] (checkpoint/owner.py): an engine that will save into
    ``checkpoint.dir`` on its own (``interval_steps``, ``on_signal``) takes the directory's owner
    lock when it starts, so an unusable directory or one a live job holds is refused before the
    first step, not at the first save after N steps of training."""
    cfg = engine.config.checkpoint
    if not cfg.dir or not (cfg.interval_steps > 0 or cfg.on_signal):
        return

    def claim() -> None:
        problem = owner.dir_problem(cfg.dir)
        if problem:
            raise CheckpointError(f"checkpoint.dir: {problem}", hint="point checkpoint.dir at a writable directory")
        from zerorun.zero.offload.scratch import job_key

        try:
            os.makedirs(cfg.dir, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint.dir: cannot create {cfg.dir!r} ({exc.strerror})",
                                  hint="point checkpoint.dir at a writable directory") from None
        owner.claim(cfg.dir, job_key())

    together(engine, claim if engine.pg.rank == 0 else None, "claiming checkpoint.dir",
             hint="nothing was trained or saved")


def resume_from_config(engine) -> None:
    """``checkpoint.resume``: load the latest checkpoint of ``checkpoint.dir`` when there is one;
    start fresh when the directory holds none or does not exist yet."""
    cfg = engine.config.checkpoint
    if not cfg.resume:
        return
    if not cfg.dir:
        raise RuntimeConfigError("checkpoint.resume is set but checkpoint.dir is not", hint="set checkpoint.dir")
    if not _exists_everywhere(engine, cfg.dir):
        # The first start of a job that always passes --resume (a requeued Slurm script, say):
        # nothing saved yet is a fresh start, not an error.
        if engine.pg.rank == 0:
            print(f"zerorun: checkpoint.resume: {cfg.dir} does not exist yet; starting from step 0",
                  file=sys.stderr, flush=True)
        return
    path, _ = load_checkpoint(engine, cfg.dir)
    if path is not None and engine.pg.rank == 0:
        print(f"zerorun: resumed from {path} at step {engine.train_state.global_step}", file=sys.stderr, flush=True)


def _exists_everywhere(engine, directory: str) -> bool:
    """Whether ``directory`` exists on every rank (one answer for all: a rank that alone went
    on to load would wait for the others at the load's collectives)."""
    here = os.path.isdir(directory)
    if engine.pg.world_size == 1:
        return here
    flag = torch.tensor([1 if here else 0], dtype=torch.int32, device=engine.pg.device)
    collectives.all_reduce(flag, group=engine.pg.group, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def save_on_interval(engine) -> None:
    """``checkpoint.interval_steps``: save after every N-th optimizer step, keeping ``keep_last``;
    ``checkpoint.on_signal``: save and stop when the launcher passed on Slurm's signal."""
    from zerorun.worker import save_on_signal

    cfg = engine.config.checkpoint
    saved = cfg.interval_steps > 0 and cfg.dir and engine.train_state.global_step % cfg.interval_steps == 0
    if saved:
        save_checkpoint(engine, cfg.dir, keep_last=cfg.keep_last)
    if cfg.on_signal and cfg.dir and save_on_signal.due(engine):
        if not saved:
            save_checkpoint(engine, cfg.dir, keep_last=cfg.keep_last)
        save_on_signal.stop(engine, cfg.dir)
