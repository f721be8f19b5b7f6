"""The ``Placement`` protocol: where one role's tensors of a unit live between uses.

    pytest tests/unit/test_placements.py tests/unit/test_layering.py

Each record holds two placements (unit/record.py): ``state_home`` for its fp32 master and
optimizer state, ``param_home`` for its stage-3 model-dtype chunk. The implementations
(``OnDevice``, ``OnHost``: offload/placements.py; ``OnFile``: offload/nvme.py) take records,
and the record holds placements; so the protocol is generic in the record type and imports no
record. The record module then depends on this protocol alone, and the implementations depend
on the record, with no import cycle between them (tests/unit/test_layering.py). The engine's
placements are ``Placement[UnitRecord]`` (``Home`` in unit/record.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

import torch

from zerorun.zero.unit.storage import FlatUnit

# Invariant: the record type appears inside ``list[...]`` arguments.
RecordT = TypeVar("RecordT")


class Placement(Protocol[RecordT]):
    """Where one role's tensors of a unit live; each method's comment says what it does."""

    location: str  # the memory_breakdown key its bytes count under: device, host, nvme
    overlaps_backward: bool  # updates run on a worker thread during the boundary backward
    updates_alone: bool  # one unit per optimizer call (else groups of units: Note [bounded update])
    host_kernels: bool  # Note [host optimizer kernels] in offload/placements.py

    def make_master(self, unit: FlatUnit) -> torch.Tensor: ...  # created once, where the state lives
    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor: ...  # Note [host shards]
    def stage_gradient(self, record: RecordT) -> torch.Tensor: ...  # the fp32 chunk, beside the master
    def publish(self, record: RecordT) -> None: ...  # the updated master into the model's chunk
    # Master and state are in memory inside (NVMe: the file read in, written back on leaving).
    def resident(self, record: RecordT, optimizer) -> AbstractContextManager[None]: ...
    def prefetch(self, record: RecordT) -> None: ...  # start making it resident early
    def settle(self, records: list[RecordT]) -> None: ...  # wait for every write behind
    def nbytes(self, records: list[RecordT], optimizer) -> dict[str, int]: ...  # masters + state by location
