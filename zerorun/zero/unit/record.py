"""One record per unit: everything this rank holds of one flat unit, in one object.

A ``UnitRecord`` owns
    unit        the model-dtype storage (``FlatUnit``: the full buffer the parameters view,
                this rank's ``shard`` chunk, stage-3 gathering);
    segments    which (parameter name, element range) pieces the chunk holds, so checkpoints
                write and re-partition state by name;
    master      the fp32 chunk the optimizer steps (Note [masters]);
    gradient    the full-size buffer (stages 0-1) or the fp32 chunk accumulator (2-3), at
                stages 1-3 only from a window's first backward to its update (Note [lazy
                gradient shards] in grad_reduce.py), and one backward's bookkeeping (arrivals, the transient bucket), written by grad_reduce;
    state_home  where master and optimizer state live between updates, and
    param_home  where a stage-3 chunk lives (both a ``Placement``: offload/placements.py);
                ``state_slot`` is what the state home keeps about this unit (NVMe: its read,
                write and buffer);
    gathering   stage 3's counts and plan for this unit (param_gather.py);
    update      this window's norm piece, whether the unit was updated, and the pending
                update when it runs on a worker thread (update.py).

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

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zerorun.zero.unit.layout import Segment
from zerorun.zero.unit.storage import FlatUnit

if TYPE_CHECKING:
    from zerorun.zero.offload.placements import Placement


class GradState(enum.Enum):
    """A unit's gradient within one backward.

    IDLE       nothing of this backward arrived (reduce-scatter: no bucket allocated).
    FILLING    some of the unit's gradients are in its buffer/bucket.
    READY      all arrived (or the end of backward says they never will); not yet issued.
    REDUCING   the collective is in flight (reduce-scatter: the bucket is alive until it ends).
    """

    IDLE = "idle"
    FILLING = "filling"
    READY = "ready"
    REDUCING = "reducing"


@dataclass(eq=False)
class UnitRecord:
    unit: FlatUnit
    segments: tuple[Segment, ...]
    master: torch.Tensor
    state_home: Placement
    param_home: Placement
    state_slot: object = field(default=None, repr=False)  # owned by state_home
    # -- gradient (grad_reduce.py) ---------------------------------------------------------
    grad_full: torch.Tensor | None = None  # stages 0-1: each parameter's .grad is a view into it
    grad: torch.Tensor | None = None  # this rank's chunk of the summed gradient (see grad_reduce)
    grad_clean: bool = True  # the chunk accumulator is still all-zero in this window
    grad_state: GradState = GradState.IDLE
    arrived: int = 0
    bucket: torch.Tensor | None = None
    bucket_buffer: torch.Tensor | None = None  # the pool buffer behind ``bucket``
    written: list[bool] | None = None
    # -- stage-3 gathering (param_gather.py) ----------------------------------------------
    in_use: int = 0  # module calls now running that need the unit gathered
    users: int = 0  # modules that gather it; more than one: Note [shared units]
    keep_after: frozenset[int] = frozenset()  # forward positions after which it stays gathered
    keep_for_backward: bool = False  # held from the end of forward into backward
    # -- update (update.py) ----------------------------------------------------------------
    grad_square: torch.Tensor | None = None  # this window's piece of the squared norm
    updated: bool = False  # this window's update of the unit is done
    pending: Future | None = field(default=None, repr=False)

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

    def grad_nbytes(self) -> int:
        held = self.grad_full if self.grad_full is not None else self.grad
        return 0 if held is None else held.numel() * held.element_size()



def by_state_home(records: list[UnitRecord]) -> dict[Placement, list[UnitRecord]]:
    """Records grouped by their state home (a per-unit policy gives several)."""
    groups: dict[Placement, list[UnitRecord]] = {}
    for record in records:
        groups.setdefault(record.state_home, []).append(record)
    return groups
