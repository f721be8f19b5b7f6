"""A unit's fp32 master between the model and its placement: where it is made, the gradient
it steps with, how an update reaches the model, and the bytes it holds.

    pytest tests/unit/test_placements.py tests/unit/test_device_contract.py -k "master or placement"

Shared by the placements (offload/placements.py: ``OnDevice``, ``OnHost``; offload/nvme.py:
``OnFile``), each of which composes these instead of inheriting another's methods. Only
``make_master`` reads the placement's ``location``: it puts the master there.
"""

from __future__ import annotations

import torch

from zerorun.zero.offload.pinned import HostMemory
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import FlatUnit

HOST = torch.device("cpu")


def master_source(dtype: torch.dtype, partitioned: bool, shard_beside_model: bool, shard_device: torch.device,
                  model_device: torch.device) -> str:
    """Where a master kept beside the model comes from (pure): "shard" (an fp32 shard is its own
    master), "fp32 shard" (Note [fp32 shard] in unit/storage.py) or "copy" (a new fp32 tensor on
    the model's device). A shard offloaded to the host (``offload_param`` without
    ``offload_optimizer``) is always copied: the gradient is on the model's device, and the
    optimizer refuses a gradient on another device than its parameter."""
    if shard_device != model_device:
        return "copy"
    if dtype == torch.float32:
        return "shard"
    return "fp32 shard" if partitioned and shard_beside_model else "copy"


def make_master(unit: FlatUnit, location: str, memory: HostMemory | None = None) -> torch.Tensor:
    """The unit's fp32 master, made once, where ``location`` (a placement's) says:

    device  beside the model (Note [masters] in unit/record.py): the shard itself, its kept fp32
            copy or a new tensor, as ``master_source`` decides;
    host    a host tensor of its own from ``memory`` (pinned when the model is on CUDA), even in
            fp32 on a CPU host: the model's chunk is published from it, as across the PCIe bus;
    nvme    a plain host copy, never pinned, which the placement writes to the unit's file and
            then empties (Note [file buffers] in offload/nvme.py)."""
    if location == "device":
        source = master_source(unit.dtype, unit.partitioned, unit.shard_beside_model, unit.shard.device, unit.device)
        if source == "shard":
            return unit.shard
        if source == "fp32 shard":
            return unit.keep_shard_in_fp32()  # one copy per shard: Note [fp32 shard] in unit/storage.py
        return unit.shard.detach().to(unit.device, torch.float32, copy=True)
    if location == "host":
        if memory is None:
            raise RuntimeError("a master in host memory needs the placement's HostMemory")
        master = memory.empty(unit.layout.chunk_numel, torch.float32, unit.device)
        master.copy_(unit.shard)
        return master
    if location == "nvme":
        return unit.shard.detach().to(HOST, dtype=torch.float32, copy=True)
    raise ValueError(f"no master location {location!r} (device, host, nvme)")


def device_gradient(record: UnitRecord) -> torch.Tensor:
    """The unit's fp32 gradient chunk where the reduction left it (the accumulator itself when
    it is fp32); zeros for a lazy shard that no backward created this window."""
    grad = record.gradient.chunk
    if grad is None:
        return torch.zeros(record.unit.layout.chunk_numel, dtype=torch.float32, device=record.unit.device)
    return grad if grad.dtype == torch.float32 else grad.float()


def publish(record: UnitRecord) -> None:
    """Copy an updated master into the model's chunk (in the model's dtype). Blocking on
    purpose: an offloaded master's buffer is reused or rewritten right after (Note [file
    buffers] in offload/nvme.py), so an asynchronous host-to-device copy from it could read
    changed values."""
    if not record.master_is_model_storage:
        record.unit.shard.copy_(record.master)


def memory_nbytes(records: list[UnitRecord], optimizer, location: str) -> dict[str, int]:
    """Bytes of masters (those that are not the model's storage) and optimizer state held in
    memory at ``location``, by location."""
    own = sum(r.master.numel() * 4 for r in records if not r.master_is_model_storage)
    state = sum(t.numel() * t.element_size() for r in records for t in r.state_tensors(optimizer).values())
    return {"device": 0, "host": 0, "nvme": 0} | {location: own + state}
