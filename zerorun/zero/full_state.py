"""The whole, unsharded state dict of a live engine, gathered one stage-3 unit at a time.

``pytest tests/distributed/test_checkpoint_resume.py tests/distributed/test_checkpoint_crash.py`` runs
its tests; ``engine.full_state_dict(rank0_only=True)`` (zero/engine.py) calls it, and a checkpoint
writes and reads frozen parameters through ``host_copies`` and ``write_whole`` (stage 3 partitions
them: Note [frozen units] in unit/partition.py). The gathering is the stage-3 gatherer's
(zero/param_gather.py): ``unit.gather`` and ``unit.release``, here one unit after another in
state-dict order, outside any forward or backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from zerorun.zero.unit.storage import FlatUnit, ParamState


def _partitioned_units(engine) -> dict[int, FlatUnit]:
    """id(parameter) -> its partitioned unit, trainable or frozen."""
    return {id(p): r.unit for r in engine.records + engine.frozen_records if r.unit.partitioned for p in r.unit.params}


def in_turn(engine, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` as it is, each partitioned parameter's unit gathered while it is yielded, one
    unit alive at a time (every rank must run through it all: each gather is a collective)."""
    unit_of = _partitioned_units(engine)
    engine.updater.refresh.settle()  # exact values: Note [next forward's gathers in the step] (step_gathers.py)
    current, gathered_here = None, False

    def let_go():
        if current is not None and gathered_here:
            current.release()
            if current.pool is not None:  # Note [gather pool]: keep no unit's memory behind
                current.pool.clear()

    try:
        for key, tensor in named:
            unit = unit_of.get(id(tensor))
            if unit is not None and unit is not current:
                let_go()
                current, gathered_here = unit, unit.state is ParamState.SHARDED
                with unit.exact_gathers():  # never a quantized copy (qwZ)
                    unit.gather(engine.pg.group)
            yield key, tensor
    finally:
        let_go()


def host_copies(engine, named: Iterable[tuple[str, torch.Tensor]], *, keep: bool) -> dict[str, torch.Tensor]:
    """Host copies of the partitioned parameters among ``named``, by key (every rank runs the
    gathers, one unit at a time; only a rank that ``keep``s copies)."""
    unit_of = _partitioned_units(engine)
    copies = {}
    for key, tensor in in_turn(engine, [(k, t) for k, t in named if id(t) in unit_of]):
        if keep:
            copies[key] = tensor.detach().to("cpu", copy=True)
    return copies


def write_whole(engine, tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor.copy_(value)`` for a parameter or buffer, also one a stage-3 unit partitions:
    this rank's piece goes into its shard, with no collective."""
    unit = _partitioned_units(engine).get(id(tensor))
    if unit is None:
        with torch.no_grad():
            tensor.copy_(value)
    else:
        unit.write_param(tensor, value)  # type: ignore[arg-type]  # a partitioned tensor is a parameter


def full_state_dict(engine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict, gathered one stage-3 unit at a time (every rank must call it):
    at most one gathered unit is alive beside the copies rank 0 keeps."""
    keep = not rank0_only or engine.pg.rank == 0
    state: dict[str, torch.Tensor] = {}
    for key, tensor in in_turn(engine, engine.module.state_dict(keep_vars=True).items()):
        if keep:
            state[key] = tensor.detach().clone().cpu()
    return state
