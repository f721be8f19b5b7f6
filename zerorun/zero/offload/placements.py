"""Placements: where a unit's tensors live between uses, behind one protocol (``Placement``,
unit/placement.py, which imports no record; so this module imports the record with no cycle).

Each record holds two: ``record.state_home`` (its fp32 master and optimizer state) and
``record.param_home`` (its stage-3 model-dtype chunk). Everything that depends on offload is
a method of the protocol, and only this module asks which placement it holds.

``OnDevice`` keeps everything beside the model (no offload). ``OnHost`` is ZeRO-Offload's
optimizer offload: master and state in (pinned, when the model is on CUDA) host memory, the
update run by the host's optimizer kernels; only a unit-sized fp32 gradient is ever staged
on the host, never a full-size gradient copy. ``OnFile`` (offload/nvme.py, with the file
engine it runs on) is ZeRO-Infinity's NVMe offload: master and state in one file per unit,
read ahead into a bounded set of host buffers and written behind (Note [file buffers]).
The three share no base class: each composes what it needs of offload/master.py (the master
made where its ``location`` says, the gradient staged beside it, publishing) and of
offload/pinned.py (``HostMemory``). As a parameter home, ``OnHost`` keeps each chunk's
own host copy and ``OnFile`` a memory-mapped file per chunk. One instance serves one role
(the file names of both roles are ``unit{index}.bin``).

A per-unit policy is ``zerorun.zero.engine.initialize(state_home_for=unit -> Placement)``:
"embeddings on the device, the rest on NVMe" is one small class (zero_parity_harness.py).

On a machine without a GPU the "device" and the host are the same memory, so ``OnHost``
and ``OnFile`` run their whole path (separate masters, staged gradients, worker thread,
files) on CPU, which is what the CPU test suite exercises.

    pytest tests/unit/test_placements.py
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from zerorun.zero.offload.grad_copy import GradientCopies
from zerorun.zero.offload.master import device_gradient, make_master, master_source, memory_nbytes, publish
from zerorun.zero.offload.nvme import OnFile
from zerorun.zero.offload.pinned import HostMemory
from zerorun.zero.unit.record import Home, UnitRecord
from zerorun.zero.unit.storage import FlatUnit

# Placements and the helpers callers of this module import from it (master.py, nvme.py).
__all__ = ["OnDevice", "OnHost", "OnFile", "placement_from_config", "device_gradient", "master_source"]


class OnDevice:
    """No offload: the master sits beside the model (Note [masters] in unit/record.py)."""

    location = "device"
    overlaps_backward = False
    updates_alone = False  # groups of units per optimizer call (Note [bounded update] in update.py)
    host_kernels = False  # Note [host optimizer kernels]

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        return make_master(unit, self.location)

    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        return chunk

    def stage_gradient(self, record: UnitRecord) -> torch.Tensor:
        return device_gradient(record)

    @contextmanager
    def resident(self, record: UnitRecord, optimizer):
        yield

    def prefetch(self, record: UnitRecord) -> None:
        pass

    def settle(self, records: list[UnitRecord]) -> None:
        pass

    def publish(self, record: UnitRecord) -> None:
        publish(record)

    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]:
        """Bytes of masters and optimizer state, by where they are."""
        return memory_nbytes(records, optimizer, self.location)


class OnHost:
    """ZeRO-Offload: fp32 master and optimizer state in host memory, updated by the host."""

    location = "host"
    overlaps_backward = True
    updates_alone = True  # one unit's gradient staged on the host at a time
    # Note [host optimizer kernels]: the host update is what an offloaded step waits for, and
    # torch's fused CPU kernels (Adam, AdamW, SGD, Adagrad) run it 6x faster than the
    # per-tensor path the CPU otherwise defaults to (8M fp32 elements of AdamW: 4.4 against
    # 28.6 ms here), agreeing with it to float rounding (1.5e-8 after 10 steps). So a group
    # that left ``fused`` unset is switched to it; one that chose foreach or fused keeps it.
    # Without a GPU the device's update runs on the host too and gets the same kernels
    # (``updates_on_host`` in update.py: the 33.7M GPT's stage-3 update went from about 60 to
    # about 20 ms per step); on a GPU torch's default is already multi-tensor and the user's choice stands.
    host_kernels = True

    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory
        self.memory = HostMemory(pin_memory)  # Note [pinned arena] in offload/pinned.py
        self.copies = GradientCopies()  # Note [gradient copies] in offload/grad_copy.py

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        return make_master(unit, self.location, self.memory)

    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        host = self.memory.empty(chunk.numel(), chunk.dtype, chunk.device)
        host.copy_(chunk.reshape(-1))
        return host.view(chunk.shape)

    def stage_gradient(self, record: UnitRecord) -> torch.Tensor:
        """Note [unit-sized gradient staging]: the chunk leaves the device once, at the
        boundary, into a host tensor of this unit's size that the update consumes and drops;
        accumulation across micro-steps stays on the device, so the host never holds a
        full-size fp32 gradient beside master and state (what exhausts DeepSpeed's host).
        On a GPU, pinned and copied on a stream of its own (Note [gradient copies])."""
        return self.copies.take(record)

    def prefetch(self, record: UnitRecord) -> None:
        """The gradient is final (backward): start its copy to the host."""
        self.copies.start(record)

    # Master and state are always in memory, as OnDevice's: nothing to read in, wait for or
    # write back, and the same blocking publish (borrowed, not inherited: no base class).
    resident = OnDevice.resident
    settle = OnDevice.settle
    publish = OnDevice.publish

    def arena_slack(self) -> int:
        """Pinned bytes held but not handed out (Note [pinned arena]): host memory too."""
        return self.memory.slack()

    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]:
        found = memory_nbytes(records, optimizer, self.location)
        found["host"] += self.arena_slack()
        return found


def placement_from_config(offload, *, rank: int, role: str = "optimizer") -> Home:
    """The placement ``zero.offload_{role}`` (an OffloadConfig) names: role "optimizer" for
    master and state, "param" for stage-3 chunks."""
    if offload.device == "cpu":
        return OnHost(offload.pin_memory)
    if offload.device == "nvme":
        return OnFile(offload.nvme_path, rank, buffer_count=offload.buffer_count,
                      buffer_size=offload.buffer_size, pin_memory=offload.pin_memory, role=role)
    return OnDevice()
