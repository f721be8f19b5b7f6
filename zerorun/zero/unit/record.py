"""One record per unit: everything this rank holds of one flat unit, in one object.

A ``UnitRecord`` owns
    unit        the model-dtype storage (``FlatUnit``: the full buffer the parameters view,
                this rank's ``shard`` chunk, stage-3 gathering);
    segments    which (parameter name, element range) pieces the chunk holds, so checkpoints
                write and re-partition state by name;
    master      the fp32 chunk the optimizer steps (Note [masters]);
    state_home  where master and optimizer state live between updates, and
    param_home  where a stage-3 chunk lives (both a ``Placement``: the protocol in
                unit/placement.py, the placements in offload/placements.py and nvme.py);
                ``state_slot`` is what the state home keeps about this unit (NVMe: its read,
                write and buffer), written by the state home alone;
and three parts (unit/parts.py), each written by one module through its own transitions:
    gradient    the full-size buffer (stages 0-1) or the fp32 chunk accumulator (2-3), at
                stages 1-3 only from a window's first backward to its update (Note [lazy
                gradient shards] in grad_reduce.py), and one backward's bookkeeping (its
                arrivals, state and transient bucket): written by grad_reduce.py;
    gathering   stage 3's counts and keep plan for this unit: written by param_gather.py;
    update      this window's norm piece, whether the unit was updated, and the pending
                update when it runs on a worker thread: written by update.py.
Unit, segments, master and the two homes are set once, when the engine builds the record.

Every pass (gather, reduce, update, checkpoint, memory breakdown) takes records, and the engine
holds the one list of them (``engine.records``, in unit index order).

The optimizer state of a unit is the user's optimizer's ``state[record.master]``: the user's
optimizer object is the one that steps (update.py), so a scheduler or user code holding it
keeps working.

Note [masters]: in fp32 with the state on the compute device, a master IS the parameter
storage (``unit.shard``: a view into the full buffer at stages 0-2, the owned chunk at stage 3),
so an update lands in the model with no copy and no extra memory. So is it at stage 3 in
bf16/fp16 with the state and the chunk on the device: the owned chunk is then kept in fp32 and
cast by each gather (Note [fp32 shard] in unit/storage.py). Otherwise (bf16/fp16 at stages
0-2 or for stage 3's whole-kept units, or an offloaded optimizer) the master is its own fp32
tensor wherever the placement puts it, and publishing an update copies it into ``unit.shard``
in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerorun.zero.unit.layout import Segment
from zerorun.zero.unit.parts import GatheringPart, GradientPart, UpdatePart
from zerorun.zero.unit.placement import Placement
from zerorun.zero.unit.storage import FlatUnit

# A record's placements: the protocol, for this record type (unit/placement.py says why generic).
Home = Placement["UnitRecord"]


@dataclass(eq=False)
class UnitRecord:
    unit: FlatUnit
    segments: tuple[Segment, ...]
    master: torch.Tensor
    state_home: Home
    param_home: Home
    state_slot: object = field(default=None, repr=False)  # owned by state_home
    # Each part is written by one module only, through its methods (unit/parts.py).
    gradient: GradientPart = field(init=False)  # grad_reduce.py
    gathering: GatheringPart = field(init=False)  # param_gather.py
    update: UpdatePart = field(init=False)  # update.py

    def __post_init__(self) -> None:
        index = self.unit.index
        self.gradient, self.gathering, self.update = GradientPart(index), GatheringPart(index), UpdatePart(index)

    @property
    def index(self) -> int:
        return self.unit.index

    @property
    def master_is_model_storage(self) -> bool:
        """Note [masters]: the update writes the model's own storage."""
        return self.master.data_ptr() == self.unit.shard.data_ptr()

    def state_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This unit's optimizer state (Adam's moments, SGD's momentum ...) as named tensors."""
        state = optimizer.state.get(self.master, {})
        return {k: v for k, v in state.items() if torch.is_tensor(v)}


def by_state_home(records: list[UnitRecord]) -> dict[Home, list[UnitRecord]]:
    """Records grouped by their state home (a per-unit policy gives several)."""
    groups: dict[Home, list[UnitRecord]] = {}
    for record in records:
        groups.setdefault(record.state_home, []).append(record)
    return groups
