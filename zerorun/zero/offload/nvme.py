"""ZeRO-Infinity's NVMe offload: ``OnFile``, the placement that keeps a unit's master and
optimizer state (or its stage-3 chunk) in one file per unit, and the engine it runs on: a
bounded pool of host buffers (``BufferPool``), a reader thread that reads ahead and a writer
thread that writes behind (Note [file buffers]).

    pytest tests/unit/test_placements.py tests/unit/test_offload_io.py tests/e2e/test_nvme_faults.py

``OnFile`` is one of the placements of offload/placements.py (the ``Placement`` protocol of
unit/placement.py); it composes the pieces it shares with the others (offload/master.py: the
master, host staging, publishing; offload/pinned.py: its host memory) instead of inheriting
them. Every read and write checks its byte count (offload/file_io.py); the files are this
process's scratch (offload/scratch.py).
"""

from __future__ import annotations

import shutil
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerorun.errors import RuntimeConfigError
from zerorun.zero.offload import scratch
from zerorun.zero.offload.file_io import read_exactly, write_exactly
from zerorun.zero.offload.grad_copy import GradientCopies
from zerorun.zero.offload.master import HOST, make_master, publish
from zerorun.zero.offload.pinned import HostMemory
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import FlatUnit


def _pin(tensor: torch.Tensor, model_device: torch.device, pin: bool) -> torch.Tensor:
    """Pinned host memory makes device<->host copies asynchronous and about 3x faster; it only
    exists with CUDA, and a CPU worker must never touch CUDA (docs/launch.md, device contract)."""
    if pin and model_device.type == "cuda":
        return tensor.pin_memory()
    return tensor


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


class OnFile:
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
    overlaps_backward = True  # like OnHost: updated by the host, during the boundary backward
    updates_alone = True  # one pool buffer per unit
    host_kernels = True  # Note [host optimizer kernels] in offload/placements.py

    def __init__(self, nvme_path: str, rank: int, *, buffer_count: int, buffer_size: int,
                 pin_memory: bool = True, slots: int = 3, role: str = "optimizer"):
        self.pin_memory = pin_memory
        self.memory = HostMemory(pin_memory)  # the pool's buffers: Note [pinned arena]
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
        self.copies = GradientCopies()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zerorun-nvme-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zerorun-nvme-write")

    def _path(self, record: UnitRecord) -> Path:
        return self.directory / f"unit{record.index}.bin"

    def make_master(self, unit: FlatUnit) -> torch.Tensor:
        """The master goes to the unit's file; the tensor the optimizer holds stays empty
        between updates (Note [file buffers])."""
        need = self.slots * unit.layout.chunk_numel
        if need > self.buffer_size:
            raise RuntimeConfigError(
                f"zero.offload_optimizer.buffer_size={self.buffer_size} is smaller than one unit's "
                f"master and optimizer state ({need} elements)",
                hint=f"set buffer_size to at least {need}, or shrink the units (reduce_bucket_size / allgather_bucket_size)")
        master = make_master(unit, self.location)
        self._largest = max(self._largest, need)
        self._model_device = unit.device
        self._create(unit.index, master, planned=need * 4)  # room for the state its updates add
        master.data = torch.empty(0, dtype=torch.float32)
        return master

    def stage_gradient(self, record: UnitRecord) -> torch.Tensor:
        # Note [unit-sized gradient staging] in offload/placements.py; on a GPU pinned, on a
        # copy stream, issued here (Note [gradient copies]: prefetch is the file's read-ahead).
        return self.copies.take(record)

    def publish(self, record: UnitRecord) -> None:
        publish(record)

    def arena_slack(self) -> int:
        return self.memory.slack()

    def _create(self, index: int, host: torch.Tensor, planned: int) -> Path:
        """A new file ``unit{index}.bin`` holding ``host``: the ``planned`` bytes it may grow to
        are reserved first, the bytes written counted after (Note [scratch budget] in
        offload/scratch.py)."""
        path = self.directory / f"unit{index}.bin"
        scratch.reserve(self.directory, planned, 0, self._config_key)
        self._budget["planned"] += planned
        written = host.numel() * host.element_size()
        write_exactly(path, _bytes_of(host), self.rank, create=True)
        scratch.reserve(self.directory, 0, written, self._config_key)
        self._budget["written"] += written
        return path

    def _buffer_pool(self) -> BufferPool:
        """The pool, made at the first read, when every unit is known: buffers no larger than
        the largest unit needs (a small model does not pin buffer_size elements it never uses)."""
        with self._pool_lock:
            if self.pool is None:
                size = min(self.buffer_size, self._largest)
                self.pool = BufferPool(self.buffer_count, size, self._model_device, self.pin_memory,
                                       allocate=lambda n: self.memory.empty(n, torch.float32, self._model_device))
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
        host = chunk.detach().to(HOST).contiguous()
        nbytes = host.numel() * host.element_size()
        path = self._create(index, host, planned=nbytes)
        mapped = torch.from_file(str(path), shared=True, size=chunk.numel(), dtype=chunk.dtype)
        # What a gather checks before reading the mapping (file_io.check_mapped).
        mapped.zerorun_mapped_file = (path, nbytes, self.rank)  # type: ignore[attr-defined]
        return mapped

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
