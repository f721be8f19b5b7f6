"""The whole, unsharded state dict of a live engine, gathered one stage-3 unit at a time.

``pytest tests/distributed/test_checkpoint_resume.py tests/distributed/test_checkpoint_crash.py`` runs
its tests; ``engine.full_state_dict(rank0_only=True)`` (zero/engine.py) calls it. The gathering is
the stage-3 gatherer's (zero/param_gather.py): ``unit.gather`` and ``unit.release``, here one unit
after another in state-dict order, outside any forward or backward.
"""

from __future__ import annotations

import torch

from zerorun.zero.unit.storage import ParamState


def full_state_dict(engine, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict, gathered one stage-3 unit at a time (every rank must call it):
    at most one gathered unit is alive beside the copies rank 0 keeps."""
    keep = not rank0_only or engine.pg.rank == 0
    unit_of = {id(p): r.unit for r in engine.records if r.unit.partitioned for p in r.unit.params}
    state: dict[str, torch.Tensor] = {}
    current, gathered_here = None, False

    def let_go():
        if current is not None and gathered_here:
            current.release()
            if current.pool is not None:  # Note [gather pool]: keep no unit's memory behind
                current.pool.clear()

    try:
        for key, tensor in engine.module.state_dict(keep_vars=True).items():
            unit = unit_of.get(id(tensor))
            if unit is not None and unit is not current:
                let_go()
                current, gathered_here = unit, unit.state is ParamState.SHARDED
                with unit.exact_gathers():  # never a quantized copy (qwZ)
                    unit.gather(engine.pg.group)
            if keep:
                state[key] = tensor.detach().clone().cpu()
    finally:
        let_go()
    return state
