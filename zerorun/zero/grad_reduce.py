"""Gradient reduction during backward: one bucketed collective per unit, launched from
post-accumulate-grad hooks so communication overlaps the rest of backward.

Two policies, one mechanism (the stage picks the policy):

ALL_REDUCE (stages 0-1)  every unit keeps a persistent full-size gradient buffer and each
    parameter's ``.grad`` IS a view into it, so autograd accumulates in place (no copy).
    Micro-steps inside an accumulation window communicate nothing; the last one all-reduces.
REDUCE_SCATTER (stages 2-3)  no full gradient is kept: a unit's gradients are copied into a
    transient bucket, reduce-scattered, and only this rank's chunk is added into a persistent
    fp32 shard accumulator. This runs on every micro-step: accumulating locally would need the
    full gradient that stage 2 exists to avoid (DeepSpeed makes the same trade).

Note [lazy gradient shards]: with ``lazy_shards`` (the engine sets it at stage 3) a unit's
shard accumulator does not exist between optimizer steps. The first reduce-scatter of an
accumulation window creates it (in fp32 its output buffer simply becomes the accumulator) and
``zero()`` drops it after the step, as FSDP2 frees its sharded gradients. So during forward and
most of backward the gradient column holds only the units already reduced, and the units being
gathered for backward never have a shard beside their gathered parameters; the planner counts
this (planner/memory.py, ``unreduced_gradient_bytes``). Stage 2 keeps its accumulators: there
no gathered parameters share backward's peak, so dropping them would save nothing at the peak
and cost a fresh allocation every step.

Note [launch order]: collectives must be issued in the same order on every rank. A unit is
launched only when it is complete AND every unit before it in ``order`` has launched; whatever
is left (units with parameters unused this step) is flushed in order at the end of backward.
So the issue order is identical on every rank whatever the data did.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Callable

import torch

from zerorun.zero import collectives
from zerorun.zero.units import FlatUnit


class ReducePolicy(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"


class GradState(enum.Enum):
    """Per unit, within one backward.

    IDLE       nothing of this backward arrived (REDUCE_SCATTER: no bucket allocated).
    FILLING    some of the unit's gradients are in its buffer/bucket.
    READY      all arrived (or the end of backward says they never will); not yet issued.
    REDUCING   the collective is in flight (REDUCE_SCATTER: bucket alive until it finishes).
    """

    IDLE = "idle"
    FILLING = "filling"
    READY = "ready"
    REDUCING = "reducing"


# REDUCE_SCATTER keeps at most this many buckets in flight, so transient gradient memory
# stays a few buckets, not the whole model (the point of stage 2).
MAX_IN_FLIGHT = 2


class BucketPool:
    """Note [bucket reuse]: gradient buckets of one backward come from a few buffers sized by
    the largest unit, handed from a finished reduce-scatter to the next unit, instead of one
    fresh allocation per unit. Units of different sizes otherwise fragment the host heap
    (freed-but-resident memory on CPU). The pool is emptied when backward ends, so the
    optimizer step's temporaries never sit beside idle buckets."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, keep: int):
        self.numel, self.dtype, self.device, self.keep = numel, dtype, device, keep
        self._free: list[torch.Tensor] = []
        self.allocated = 0  # buffers alive: lent out or free

    def take(self, numel: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(buffer, view of its first ``numel`` elements); (None, a fresh tensor) when
        ``numel`` is beyond the pool's size (a lone parameter that arrived on no rank)."""
        if numel > self.numel:
            return None, torch.empty(numel, dtype=self.dtype, device=self.device)
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.allocated += 1
        return buffer, buffer[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        if len(self._free) < self.keep:
            self._free.append(buffer)
        else:
            self.allocated -= 1

    def clear(self) -> None:
        self.allocated -= len(self._free)
        self._free.clear()

    def nbytes(self) -> int:
        return self.allocated * self.numel * self.dtype.itemsize


class GradReducer:
    def __init__(
        self,
        units: list[FlatUnit],
        order: list[int],
        policy: ReducePolicy,
        group,
        *,
        on_unit_complete: Callable[[FlatUnit], None] | None = None,
        lazy_shards: bool = False,
    ):
        self.units = units
        self.order = order
        self.policy = policy
        self.group = group
        self.on_unit_complete = on_unit_complete
        self.state = [GradState.IDLE] * len(units)
        self.arrived = [0] * len(units)
        self.communicate = True
        self._next = 0
        self._in_flight: deque = deque()
        self._buckets: dict[int, torch.Tensor] = {}
        self._bucket_buffers: dict[int, torch.Tensor] = {}  # pool buffers behind _buckets
        self._pools: dict[tuple, BucketPool] = {}
        self._written: dict[int, list[bool]] = {}
        # REDUCE_SCATTER: accumulator chunks still all-zero in this window (see _launch).
        self._chunk_clean = [True] * len(units)
        self.lazy_shards = lazy_shards and policy is ReducePolicy.REDUCE_SCATTER
        self._hooks = []
        if policy is ReducePolicy.ALL_REDUCE:
            self.grad_full = [torch.zeros_like(u.full) for u in units]
            self.grad_chunks = [g[slice(*u.layout.chunk_range(u.rank))] for g, u in zip(self.grad_full, units)]
            for unit, buffer in zip(units, self.grad_full):
                for param, offset in zip(unit.params, unit.layout.offsets):
                    param.grad = buffer[offset : offset + param.numel()].view(param.shape)
        else:
            self.grad_full = []
            self.grad_chunks: list[torch.Tensor | None] = [None] * len(units)
            self._create_chunks()
            for unit in units:
                key = (unit.dtype, unit.device)
                largest = self._pools[key].numel if key in self._pools else 0
                if not self._reduces_in_place(unit):
                    largest = max(largest, unit.layout.padded_numel)
                self._pools[key] = BucketPool(largest, unit.dtype, unit.device, keep=MAX_IN_FLIGHT + 1)
        for unit in units:
            for position, param in enumerate(unit.params):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(unit, position)))

    def _hook(self, unit: FlatUnit, position: int):
        def on_grad(param: torch.Tensor) -> None:
            self._arrive(unit, position, param)

        return on_grad

    # -- during backward -------------------------------------------------------------------
    def _arrive(self, unit: FlatUnit, position: int, param: torch.Tensor) -> None:
        offset = unit.layout.offsets[position]
        numel = param.numel()
        if self.policy is ReducePolicy.ALL_REDUCE:
            view = self.grad_full[unit.index][offset : offset + numel]
            if param.grad.data_ptr() != view.data_ptr():
                # Someone replaced .grad (e.g. zero_grad(set_to_none=True)); fold it back in.
                view.add_(param.grad.reshape(-1))
                param.grad = view.view(param.shape)
            if not self.communicate:
                return
        else:
            bucket = self._buckets.get(unit.index)
            if bucket is None and self._reduces_in_place(unit):
                # A lone parameter that needs no padding (a big embedding, typically): its
                # gradient is already the bucket, so skip the copy and the second buffer.
                self._buckets[unit.index] = param.grad.reshape(-1)
                self._written[unit.index] = [True]
                param.grad = None
            elif bucket is None:
                # Not zeroed: each parameter's slot is written once per backward (autograd
                # fires the hook once per parameter); _launch zeroes the slots never written.
                bucket = self._take_bucket(unit)
                self._written[unit.index] = [False] * len(unit.params)
            if bucket is not None:
                bucket[offset : offset + numel].copy_(param.grad.reshape(-1))
                self._written[unit.index][position] = True
                param.grad = None
        if self.state[unit.index] is GradState.IDLE:
            self.state[unit.index] = GradState.FILLING
        self.arrived[unit.index] += 1
        if self.arrived[unit.index] == len(unit.params):
            self.state[unit.index] = GradState.READY
            if self.on_unit_complete is not None:
                self.on_unit_complete(unit)
            self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while self._next < len(self.order) and self.state[self.order[self._next]] is GradState.READY:
            self._launch(self.units[self.order[self._next]])
            self._next += 1

    def _launch(self, unit: FlatUnit) -> None:
        assert self.state[unit.index] is GradState.READY
        self.state[unit.index] = GradState.REDUCING
        if self.policy is ReducePolicy.ALL_REDUCE:
            handle = collectives.all_reduce(self.grad_full[unit.index], group=self.group, async_op=True)
            self._in_flight.append((unit, handle, None))
            return
        bucket = self._buckets.pop(unit.index, None)
        if bucket is None:  # nothing arrived on this rank; other ranks may still contribute
            bucket = self._take_bucket(unit)
            self._buckets.pop(unit.index)
            bucket.zero_()
        else:
            self._zero_unwritten(unit, bucket, self._written.pop(unit.index))
        chunk = self.grad_chunks[unit.index]
        if chunk is not None and self._chunk_clean[unit.index] and chunk.dtype == unit.dtype:
            out = chunk  # first contribution of the window: reduce straight into the accumulator
        else:
            out = torch.empty(unit.layout.chunk_numel, dtype=unit.dtype, device=unit.device)
        self._chunk_clean[unit.index] = False
        handle = collectives.reduce_scatter(out, bucket, group=self.group, async_op=True)
        self._in_flight.append((unit, handle, (out, bucket, self._bucket_buffers.pop(unit.index, None))))
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        unit, handle, buffers = self._in_flight.popleft()
        handle.wait()
        if buffers is not None:
            out, _bucket, pooled = buffers  # an unpooled bucket dies with this tuple
            chunk = self.grad_chunks[unit.index]
            if chunk is None:  # Note [lazy gradient shards]: the window's first contribution
                self.grad_chunks[unit.index] = out if out.dtype == torch.float32 else out.float()
            elif out.data_ptr() != chunk.data_ptr():
                chunk.add_(out)
            if pooled is not None:
                self._pools[(unit.dtype, unit.device)].give_back(pooled)
        self.state[unit.index] = GradState.IDLE
        self.arrived[unit.index] = 0

    def finish_backward(self) -> None:
        """Issue what unused parameters held back (in order), then wait for everything."""
        if self.policy is ReducePolicy.ALL_REDUCE and not self.communicate:
            return
        for index in self.order[self._next :]:
            if self.state[index] is not GradState.READY:
                if self.on_unit_complete is not None and self.state[index] is GradState.FILLING:
                    self.on_unit_complete(self.units[index])
                self.state[index] = GradState.READY
        self._launch_ready_prefix()
        while self._in_flight:
            self._complete_oldest()
        self._next = 0
        for pool in self._pools.values():
            pool.clear()

    def _take_bucket(self, unit: FlatUnit) -> torch.Tensor:
        buffer, bucket = self._pools[(unit.dtype, unit.device)].take(unit.layout.padded_numel)
        self._buckets[unit.index] = bucket
        if buffer is not None:
            self._bucket_buffers[unit.index] = buffer
        return bucket

    @staticmethod
    def _reduces_in_place(unit: FlatUnit) -> bool:
        """A lone parameter that needs no padding (a big embedding, typically): its gradient
        is already the bucket, so it needs neither a copy nor a pool buffer."""
        return len(unit.params) == 1 and unit.layout.padded_numel == unit.layout.numel

    @staticmethod
    def _zero_unwritten(unit: FlatUnit, bucket: torch.Tensor, written: list[bool]) -> None:
        """Unused parameters' slots and the padding must reduce as zeros."""
        for position, done in enumerate(written):
            if not done:
                offset = unit.layout.offsets[position]
                bucket[offset : offset + unit.params[position].numel()].zero_()
        bucket[unit.layout.numel :].zero_()

    # -- around the optimizer step ---------------------------------------------------------
    def zero(self) -> None:
        for buffer in self.grad_full:
            buffer.zero_()
        if self.policy is ReducePolicy.REDUCE_SCATTER:
            self._create_chunks()
            self._chunk_clean = [True] * len(self.units)

    def _create_chunks(self) -> None:
        """REDUCE_SCATTER: fresh all-zero fp32 accumulators, or none (Note [lazy gradient shards])."""
        if self.lazy_shards:
            self.grad_chunks = [None] * len(self.units)
            return
        for index, unit in enumerate(self.units):
            chunk = self.grad_chunks[index]
            if chunk is None:
                self.grad_chunks[index] = torch.zeros(unit.layout.chunk_numel, dtype=torch.float32, device=unit.device)
            else:
                chunk.zero_()

    def nbytes(self) -> tuple[int, int]:
        """(gradient accumulator bytes, transient bucket bytes) held right now."""
        held = self.grad_full or [t for t in self.grad_chunks if t is not None]
        persistent = sum(t.numel() * t.element_size() for t in held)
        pooled = set(self._bucket_buffers)
        transient = sum(b.numel() * b.element_size() for i, b in self._buckets.items() if i not in pooled)
        transient += sum(pool.nbytes() for pool in self._pools.values())
        return persistent, transient
