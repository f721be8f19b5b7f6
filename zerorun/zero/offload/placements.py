"""Placements: where a unit's tensors live between uses, behind one protocol (``Placement``).

Each record holds two: ``record.state_home`` (its fp32 master and optimizer state) and
``record.param_home`` (its stage-3 model-dtype chunk). Everything that depends on offload is
a method of the protocol, and only this module asks which placement it holds.

``OnDevice`` keeps everything beside the model (no offload). ``OnHost`` is ZeRO-Offload's
optimizer offload: master and state in (pinned, when the model is on CUDA) host memory, the
update run by the host's optimizer kernels; only a unit-sized fp32 gradient is ever staged
on the host, never a full-size gradient copy. ``OnFile`` is ZeRO-Infinity's NVMe offload:
master and state in one file per unit, read ahead into a bounded set of host buffers and
written behind (Note [file buffers]). As a parameter home, ``OnHost`` keeps each chunk's
own host copy and ``OnFile`` a memory-mapped file per chunk. One instance serves one role
(the file names of both roles are ``unit{index}.bin``).

A per-unit policy is ``zerorun.zero.engine.initialize(state_home_for=unit -> Placement)``:
"embeddings on the device, the rest on NVMe" is one small class (zero_parity_harness.py).

On a machine without a GPU the "device" and the host are the same memory, so ``OnHost``
and ``OnFile`` run their whole path (separate masters, staged gradients, worker thread,
files) on CPU, which is what the CPU test suite exercises.
"""

from __future__ import annotations

import shutil
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from zerorun.errors import RuntimeConfigError
from zerorun.zero.offload import scratch
from zerorun.zero.offload.file_io import read_exactly, write_exactly
from zerorun.zero.offload.pinned import HostArena
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import FlatUnit

HOST = torch.device("cpu")


def _pin(tensor: torch.Tensor, model_device: torch.device, pin: bool) -> torch.Tensor:
    """Pinned host memory makes device<->host copies asynchronous and about 3x faster; it only
    exists with CUDA, and a CPU worker must never touch CUDA (docs/launch.md, device contract)."""
    if pin and model_device.type == "cuda":
        return tensor.pin_memory()
    return tensor


def device_gradient(record: UnitRecord) -> torch.Tensor:
    """The unit's fp32 gradient chunk where the reduction left it (the accumulator itself when
    it is fp32); zeros for a lazy shard that no backward created this window."""
    grad = record.grad
    if grad is None:
        return torch.zeros(record.unit.layout.chunk_numel, dtype=torch.float32, device=record.unit.device)
    return grad if grad.dtype == torch.float32 else grad.float()


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


class Placement(Protocol):
    """Where one role's tensors of a unit live; each method's comment says what it does."""

    location: str  # the memory_breakdown key its bytes count under: device, host, nvme
    overlaps_backward: bool  # updates run on a worker thread during the boundary backward
    updates_alone: bool  # one unit per optimizer call (else groups of units: Note [bounded update])
    host_kernels: bool  # Note [host optimizer kernels]

    def make_master(self, unit: FlatUnit) -> torch.Tensor: ...  # created once, where the state lives
    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor: ...  # Note [host shards]
    def stage_gradient(self, record: UnitRecord) -> torch.Tensor: ...  # the fp32 chunk, beside the master
    def publish(self, record: UnitRecord) -> None: ...  # the updated master into the model's chunk
    # Master and state are in memory inside (NVMe: the file read in, written back on leaving).
    def resident(self, record: UnitRecord, optimizer) -> AbstractContextManager[None]: ...
    def prefetch(self, record: UnitRecord) -> None: ...  # start making it resident early
    def settle(self, records: list[UnitRecord]) -> None: ...  # wait for every write behind
    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]: ...  # masters + state by location


class OnDevice:
    """No offload: the master sits beside the model (Note [masters] in unit/record.py)."""

    location = "device"
    overlaps_backward = False
    updates_alone = False  # groups of units per optimizer call (Note [bounded update] in update.py)
    host_kernels = False  # Note [host optimizer kernels]

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        source = master_source(unit.dtype, unit.partitioned, unit.shard_beside_model, unit.shard.device, unit.device)
        if source == "shard":
            return unit.shard
        if source == "fp32 shard":
            return unit.keep_shard_in_fp32()  # one copy per shard: Note [fp32 shard] in unit/storage.py
        return unit.shard.detach().to(unit.device, torch.float32, copy=True)

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
        """Copy an updated master into the model's chunk (in the model's dtype). Blocking on
        purpose: an offloaded master's buffer is reused or rewritten right after (Note [file
        buffers]), so an asynchronous host-to-device copy from it could read changed values."""
        if not record.master_is_model_storage:
            record.unit.shard.copy_(record.master)

    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]:
        """Bytes of masters and optimizer state, by where they are."""
        own = sum(r.master.numel() * 4 for r in records if not r.master_is_model_storage)
        state = sum(t.numel() * t.element_size() for r in records for t in r.state_tensors(optimizer).values())
        return {"device": 0, "host": 0, "nvme": 0} | {self.location: own + state}


class OnHost(OnDevice):
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
        self._arena: HostArena | None = None  # Note [pinned arena] in offload/pinned.py

    def _host_empty(self, numel: int, dtype: torch.dtype, model_device: torch.device) -> torch.Tensor:
        """A host tensor, pinned from this placement's arena when the model is on CUDA."""
        if not (self.pin_memory and model_device.type == "cuda"):
            return torch.empty(numel, dtype=dtype, device=HOST)
        if self._arena is None:
            self._arena = HostArena(pin=True)
        return self._arena.empty(numel, dtype)

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        # Always a tensor of its own, even in fp32 on a CPU host: the model's chunk is published
        # from it, as it would be across the PCIe bus.
        master = self._host_empty(unit.layout.chunk_numel, torch.float32, unit.device)
        master.copy_(unit.shard)
        return master

    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        host = self._host_empty(chunk.numel(), chunk.dtype, chunk.device)
        host.copy_(chunk.reshape(-1))
        return host.view(chunk.shape)

    def arena_slack(self) -> int:
        """Pinned bytes held but not handed out (Note [pinned arena]): host memory too."""
        return self._arena.slack() if self._arena is not None else 0

    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]:
        found = super().nbytes(records, optimizer)
        found["host"] += self.arena_slack()
        return found

    def stage_gradient(self, record: UnitRecord) -> torch.Tensor:
        """Note [unit-sized gradient staging]: the chunk leaves the device once, at the
        boundary, into a host tensor of this unit's size that the update consumes and drops;
        accumulation across micro-steps stays on the device, so the host never holds a
        full-size fp32 gradient beside master and state (what exhausts DeepSpeed's host)."""
        grad = record.grad
        if grad is None:
            return torch.zeros(record.unit.layout.chunk_numel, dtype=torch.float32)
        return grad.to(HOST, dtype=torch.float32)


class BufferPool:
    """``count`` host buffers of ``numel`` fp32 elements; ``take`` blocks while all are lent.

    Note [pool on failure]: once a read or write of the placement failed, ``close`` ends the
    pool: every ``take`` then raises that error at once instead of waiting for a buffer that
    will never come back, so no thread (the reader, the update worker) is left blocked and the
    process can exit (a blocked non-daemon thread would keep it alive forever)."""

    def __init__(self, count: int, numel: int, model_device: torch.device, pin: bool, allocate=None):
        self.numel = numel
        # ``allocate(numel)``: the placement's (Note [pinned arena]); else each buffer on its own
        if allocate is None:
            allocate = lambda n: _pin(torch.empty(n, dtype=torch.float32), model_device, pin)
        self._free = [allocate(numel) for _ in range(count)]
        self._changed = threading.Condition()
        self._failure: BaseException | None = None
        self.count = count

    def take(self) -> torch.Tensor:
        with self._changed:
            self._changed.wait_for(lambda: self._free or self._failure is not None)
            if self._failure is not None:
                raise self._failure
            return self._free.pop()

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._changed:
            self._free.append(buffer)
            self._changed.notify()

    def check(self) -> None:
        """Raise the failure that closed the pool, if any."""
        with self._changed:
            if self._failure is not None:
                raise self._failure

    def close(self, failure: BaseException) -> None:
        with self._changed:
            if self._failure is None:
                self._failure = failure
            self._changed.notify_all()

    @property
    def available(self) -> int:
        with self._changed:
            return len(self._free)

    def nbytes(self) -> int:
        return self.count * self.numel * 4


@dataclass(eq=False)
class FileSlot:
    """What OnFile keeps on a record (``record.state_slot``): its read ahead, its write behind,
    the buffer it is resident in, and the names of the state tensors its file holds."""

    read: Future | None = None
    write: Future | None = None
    buffer: torch.Tensor | None = None
    state_names: list[str] = field(default_factory=list)


def _slot(record: UnitRecord) -> FileSlot:
    slot = record.state_slot
    if slot is None:
        slot = record.state_slot = FileSlot()
    if not isinstance(slot, FileSlot):  # UnitRecord types it as object: owned by the state home
        raise TypeError(f"a unit's state slot is a {type(slot).__name__}, not OnFile's FileSlot")
    return slot


class OnFile(OnHost):
    """ZeRO-Infinity: master and optimizer state in one file per unit under ``nvme_path``.

    Note [file buffers]: a unit's file holds its master followed by each state tensor of the
    master's size (Adam's two moments), ``slots`` chunks in all. To update a unit, one host
    buffer from a pool of ``buffer_count`` x ``buffer_size`` elements is taken, the file is
    read into it on the reader thread (read-ahead: units are read as soon as their update is
    queued, as far as free buffers allow), master and state become views of the buffer, the
    optimizer steps them, and the writer thread writes the buffer back and returns it to the
    pool (write-behind). Host memory for master and state is therefore the pool, whatever the
    model's size. Between updates the master's ``.data`` is an empty tensor and each state
    entry an empty placeholder, so the optimizer object keeps its keys and per-step scalars.
    Reads and writes never wait on each other (separate threads), so a full pool only stalls
    the reader until a write finishes. O_DIRECT is not used: the page cache keeps a recently
    written unit readable at memory speed, and torch buffers are not guaranteed 4 KiB-aligned.
    """

    location = "nvme"

    def __init__(self, nvme_path: str, rank: int, *, buffer_count: int, buffer_size: int,
                 pin_memory: bool = True, slots: int = 3, role: str = "optimizer"):
        super().__init__(pin_memory)
        self.rank = rank
        # Note [scratch names] (offload/scratch.py): a subdirectory of the rank's fixed directory.
        self._config_key = f"zero.offload_{role}.nvme_path"
        self.directory = scratch.placement_directory(nvme_path, rank, "optim" if role == "optimizer" else "params",
                                                     self._config_key)
        self._budget = {"planned": 0, "written": 0}
        # Slots whose read ahead is queued or running: what a failure must cancel or hand back.
        self._reading: set[FileSlot] = set()
        # The files are scratch space of this process: gone when the placement is (or at exit).
        weakref.finalize(self, _remove_scratch, self.directory, self._budget)
        self.buffer_count, self.buffer_size, self.slots = buffer_count, buffer_size, slots
        self._largest = 0  # elements of the largest unit's master + state
        self._model_device = torch.device("cpu")
        self._pool_lock = threading.Lock()
        self.pool: BufferPool | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zerorun-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zerorun-nvme-write")

    def _path(self, record: UnitRecord) -> Path:
        return self.directory / f"unit{record.index}.bin"

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        need = self.slots * unit.layout.chunk_numel
        if need > self.buffer_size:
            raise RuntimeConfigError(
                f"zero.offload_optimizer.buffer_size={self.buffer_size} is smaller than one unit's "
                f"master and optimizer state ({need} elements)",
                hint=f"set buffer_size to at least {need}, or shrink the units (reduce_bucket_size / allgather_bucket_size)")
        master = unit.shard.detach().to(HOST, dtype=torch.float32, copy=True)
        scratch.reserve(self.directory, need * 4, 0, self._config_key)
        self._budget["planned"] += need * 4
        self._largest = max(self._largest, need)
        self._model_device = unit.device
        write_exactly(self.directory / f"unit{unit.index}.bin", _bytes_of(master), self.rank, create=True)
        scratch.reserve(self.directory, 0, master.numel() * 4, self._config_key)
        self._budget["written"] += master.numel() * 4
        master.data = torch.empty(0, dtype=torch.float32)
        return master

    def _buffer_pool(self) -> BufferPool:
        """The pool, made at the first read, when every unit is known: buffers no larger than
        the largest unit needs (a small model does not pin buffer_size elements it never uses)."""
        with self._pool_lock:
            if self.pool is None:
                size = min(self.buffer_size, self._largest)
                self.pool = BufferPool(self.buffer_count, size, self._model_device, self.pin_memory,
                                       allocate=lambda n: self._host_empty(n, torch.float32, self._model_device))
            return self.pool

    def _made_pool(self) -> BufferPool:
        """The pool, which prefetch made before any read, write or put-away could need it."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("OnFile's buffer pool is used before the first prefetch made it")
        return pool

    def place_shard(self, chunk: torch.Tensor, index: int) -> torch.Tensor:
        """Note [host shards]: the chunk lives in a file of its own, memory-mapped
        (``torch.from_file(shared=True)``), so a gather reads it from the file and an update's
        publish writes through to it. Which pages stay in memory is the page cache's choice."""
        path = self.directory / f"unit{index}.bin"
        host = chunk.detach().to(HOST).contiguous()
        nbytes = host.numel() * host.element_size()
        scratch.reserve(self.directory, nbytes, 0, self._config_key)
        self._budget["planned"] += nbytes
        write_exactly(path, _bytes_of(host), self.rank, create=True)
        scratch.reserve(self.directory, 0, nbytes, self._config_key)
        self._budget["written"] += nbytes
        return torch.from_file(str(path), shared=True, size=chunk.numel(), dtype=chunk.dtype)

    def prefetch(self, record: UnitRecord) -> None:
        """Start reading ``record``'s file into a pool buffer (read-ahead)."""
        self._buffer_pool()
        slot = _slot(record)
        if slot.read is None:
            slot.read = self._reader.submit(self._read, record)
            self._reading.add(slot)

    def _read(self, record: UnitRecord) -> torch.Tensor:
        """Note [pool on failure]: the buffer goes back on every error path, and the first
        failure ends the pool, so nothing waits on it afterwards."""
        slot = _slot(record)
        try:
            write, slot.write = slot.write, None
            if write is not None:
                write.result()  # the previous update of this unit must be on disk first
            pool = self._made_pool()
            buffer = pool.take()
        except BaseException as exc:
            self._failed(exc)
            raise
        try:
            n = record.unit.layout.chunk_numel
            slots = 1 + len(slot.state_names)
            read_exactly(self._path(record), _bytes_of(buffer[: slots * n]), self.rank)
            pool.check()  # a failure elsewhere meanwhile: nobody will consume this read
        except BaseException as exc:
            pool.give_back(buffer)
            self._failed(exc)
            raise
        return buffer

    def _failed(self, exc: BaseException) -> None:
        if self.pool is not None and isinstance(exc, Exception):
            self.pool.close(exc)

    @contextmanager
    def resident(self, record: UnitRecord, optimizer):
        """Master and state as views of a pool buffer while inside; written behind on leaving."""
        self.prefetch(record)
        held = _slot(record)
        read, held.read = held.read, None
        self._reading.discard(held)
        if read is None:  # prefetch above started one unless one was already waiting
            raise RuntimeError(f"no read of unit {record.index}'s file was started")
        try:
            buffer = read.result()
        except BaseException:
            self._drop_reads()
            raise
        held.buffer = buffer
        n = record.unit.layout.chunk_numel
        record.master.data = buffer[:n]
        state = optimizer.state.get(record.master)
        for slot, name in enumerate(held.state_names, start=1):
            state[name] = buffer[slot * n : (slot + 1) * n]
        try:
            yield
        finally:
            self._put_away(record, optimizer)

    def _put_away(self, record: UnitRecord, optimizer) -> None:
        n = record.unit.layout.chunk_numel
        held = _slot(record)
        buffer, held.buffer = held.buffer, None
        if buffer is None:
            raise RuntimeError(f"unit {record.index} is put away but is not resident")
        state = optimizer.state.get(record.master, {})
        names = [k for k, v in state.items() if torch.is_tensor(v) and v.numel() == n]
        if len(names) + 1 > self.slots:
            self._made_pool().give_back(buffer)  # the unit's values stay as the file has them
            record.master.data = torch.empty(0, dtype=torch.float32)
            raise RuntimeConfigError(f"{type(optimizer).__name__} keeps {len(names)} state tensors per "
                                     f"parameter; NVMe offload has room for {self.slots - 1}")
        for slot, name in enumerate(names, start=1):
            target = buffer[slot * n : (slot + 1) * n]
            if state[name].data_ptr() != target.data_ptr():  # created by this (first) step
                target.copy_(state[name])
            # A placeholder of the right size and no memory: the optimizer keeps its key, and
            # whoever lists the state (a checkpoint) sees a per-element tensor.
            state[name] = torch.empty(n, dtype=state[name].dtype, device="meta")
        held.state_names = names
        record.master.data = torch.empty(0, dtype=torch.float32)
        held.write = self._writer.submit(self._write, record, buffer, (1 + len(names)) * n)

    def _write(self, record: UnitRecord, buffer: torch.Tensor, numel: int) -> None:
        try:
            write_exactly(self._path(record), _bytes_of(buffer[:numel]), self.rank)
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            self._made_pool().give_back(buffer)

    def _drop_reads(self) -> None:
        """After a failure: reads still queued are cancelled, finished ones hand their buffers
        back, so the pool is whole again whatever the caller does next."""
        for slot in list(self._reading):
            read = slot.read
            if read is not None and (read.cancel() or read.done()):
                slot.read = None
                self._reading.discard(slot)
                if not read.cancelled() and read.exception() is None:
                    self._made_pool().give_back(read.result())

    def settle(self, records: list[UnitRecord]) -> None:
        """Wait for every write behind (before a checkpoint reads the files)."""
        for record in records:
            slot = record.state_slot
            if isinstance(slot, FileSlot) and slot.write is not None:
                slot.write.result()

    def nbytes(self, records: list[UnitRecord], optimizer) -> dict[str, int]:
        on_disk = sum(r.unit.layout.chunk_numel * (1 + len(_slot(r).state_names)) * 4 for r in records)
        host = self._buffer_pool().nbytes() if self._largest else 0
        return {"device": 0, "host": host + self.arena_slack(), "nvme": on_disk}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it is a buffer on every version.
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _remove_scratch(directory: Path, budget: dict) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    scratch.release(directory, budget["planned"], budget["written"])
    scratch.remove_if_empty(directory.parent)  # the last placement of the rank takes its directory


def placement_from_config(offload, *, rank: int, role: str = "optimizer") -> Placement:
    """The placement ``zero.offload_{role}`` (an OffloadConfig) names: role "optimizer" for
    master and state, "param" for stage-3 chunks."""
    if offload.device == "cpu":
        return OnHost(offload.pin_memory)
    if offload.device == "nvme":
        return OnFile(offload.nvme_path, rank, buffer_count=offload.buffer_count,
                      buffer_size=offload.buffer_size, pin_memory=offload.pin_memory, role=role)
    return OnDevice()
