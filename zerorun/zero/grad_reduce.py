"""Gradient reduction during backward: one bucketed collective per unit, launched from
post-accumulate-grad hooks so communication overlaps the rest of backward.

Three policies, one mechanism (the stage picks the policy):

ALL_REDUCE (stage 0)  every unit keeps a persistent full-size gradient buffer and each
    parameter's ``.grad`` IS a view into it, so autograd accumulates in place (no copy).
    Micro-steps inside an accumulation window communicate nothing; the last one all-reduces.
SCATTER_AT_BOUNDARY (stage 1)  the same full buffer and ``.grad`` views through the window, and
    the same silent micro-steps; the boundary's backward reduce-scatters each unit's buffer, so
    this rank receives only the chunk its optimizer partition updates (Note [scatter in place]).
    With the all-gather of the updated parameters after the step, a step moves one all-reduce's
    bytes, as DDP does: an all-reduce there sent 1.5x DDP's (docs/benchmarks.md, bench_link).
REDUCE_SCATTER (stages 2-3)  no full gradient is kept: a unit's gradients are copied into a
    transient bucket, reduce-scattered, and only this rank's chunk is added into a persistent
    fp32 shard accumulator. This runs on every micro-step: accumulating locally would need the
    full gradient that stage 2 exists to avoid (DeepSpeed makes the same trade).

Note [lazy gradient shards]: with ``lazy_gradients`` (the engine sets it at stages 1-3) no
gradient state exists between optimizer steps, as ``zero_grad(set_to_none=True)`` leaves torch.
REDUCE_SCATTER: the first reduce-scatter of an accumulation window creates a unit's fp32 shard
accumulator (in fp32 its output buffer simply becomes the accumulator) and ``zero()`` drops it
after the step, as FSDP2 frees its sharded gradients. So during forward and most of backward
the gradient column holds only the units already reduced, and at stage 3 the units being
gathered for backward never have a shard beside their gathered parameters; the planner counts
this (planner/memory.py, ``unreduced_gradient_bytes``). SCATTER_AT_BOUNDARY (stage 1): a unit's full
buffer is allocated at the first arrival of one of its gradients in the window (that first
gradient is added in; the others accumulate into the buffer's views in place) and dropped
after the step. Stage 0 keeps its buffers, as DDP keeps its buckets.

Note [scatter in place]: SCATTER_AT_BOUNDARY reduce-scatters a unit's full buffer into that
buffer's own chunk (``record.gradient.chunk`` is a view of it), as NCCL allows in place and as
both CPU transports do (the ring keeps a receive slice of its own, the host channel copies its
own part before it writes), so no output buffer exists beside the full one. After the reduction
the rest of the buffer holds only this rank's unreduced sum, which nothing may read as a
gradient: every ``.grad`` view of the unit is dropped then (``.grad`` is None from the boundary's
backward to the next window, as at stages 2-3; ``get_global_grad_norm()`` is the norm of the
reduced chunks), and the buffer itself goes after the step (Note [lazy gradient shards]).

Note [launch order]: collectives must be issued in the same order on every rank. A unit is
launched only when it is complete AND every unit before it in ``order`` has launched; whatever
is left (units with parameters unused this step) is flushed in order at the end of backward.
So the issue order is identical on every rank whatever the data did.

Note [expert gradients]: the order of the reduces alone is not enough at stage 3, where backward
also all-gathers units: the reduces must fall at the same place among the gathers. A unit that
completes when its last gradient arrives does so wherever that happens, and an expert block (a
leaf unit, Note [expert blocks] in unit/leaf.py) whose experts this rank's tokens skipped never
gets their gradients: it completed mid-backward on a rank that ran every expert and only at the
end on the other, which meanwhile gathered the next block (Switch Transformers, every module its
own unit: "reduce_scatter of unit 7 ... all_gather of unit 2"). So a leaf unit is completed by
an event every rank sees at the same point, never by its count: the end of its module's last
call's backward (``close_unit``, from the gatherer's ``AfterBackward`` on the module's inputs),
or else the end of backward.

Note [gradients per recomputation]: a parameter's gradient hook fires once per backward when one
autograd graph holds all its uses. A reentrant checkpoint (``use_reentrant=True``, as Hugging
Face's ``gradient_checkpointing_enable`` may ask) runs each region's backward as a graph of its
own, so a module called in several regions of one forward (DORY's recurrent layers, run once per
loop) has each of its parameters arrive once per region: the first region's arrivals completed
the unit and launched its reduce-scatter, and the next region's found it REDUCING (the fine zoo's
DORY: "unit 11: a second gradient bucket while REDUCING"). So the first arrival of a backward
fixes how many complete the unit: its parameters times ``arrivals_per_param`` (the gatherer's
answer: the calls that gathered the unit in forward when the arrival comes from a graph nested in
backward's own, else 1), and a parameter's later arrivals add into its bucket slot, as autograd
adds into ``.grad``. When fewer come (two calls in one region), the end of backward completes
the unit, as it does a unit with unused parameters; the count is the same on every rank, since
the forward's calls are (the prefetch relies on that too). A unit used both inside a reentrant
region and outside any in one forward is not counted right when its first arrival comes from
backward's own graph (once, it says); a later region's arrival is then refused with an
InternalError, at the latest when backward ends, before the step could use a partial sum.
"""

from __future__ import annotations

import enum
import functools
from collections import deque
from collections.abc import Callable

import torch

from zerorun.errors import InternalError
from zerorun.zero.comm import collectives, quantized_collectives
from zerorun.zero.host_memory import host_buffer
from zerorun.zero.lookup_gradients import LookupGradients
from zerorun.zero.unit.parts import GradState
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import FlatUnit


class ReducePolicy(enum.Enum):
    ALL_REDUCE = "all_reduce"
    SCATTER_AT_BOUNDARY = "scatter_at_boundary"
    REDUCE_SCATTER = "reduce_scatter"

    @property
    def keeps_full(self) -> bool:
        """A full gradient buffer per unit, accumulated locally through the window."""
        return self is not ReducePolicy.REDUCE_SCATTER

    @classmethod
    def for_stage(cls, stage: int) -> ReducePolicy:
        return {0: cls.ALL_REDUCE, 1: cls.SCATTER_AT_BOUNDARY}.get(stage, cls.REDUCE_SCATTER)


# A reduce-scatter policy keeps at most this many buckets in flight, so transient gradient memory
# stays a few buckets, not the whole model (the point of stage 2; at stage 1, the CPU ring's
# receive slices).
#
# Note [in flight by events]: a reduce-scatter is in flight until it is known finished, not until
# a host call returned. On the CPU that is its wait(): the oldest is waited for (the host blocks)
# when a launch would leave more than MAX_IN_FLIGHT out, exactly as before. On a GPU's
# communication stream (Note [streams] in comm/collectives.py) wait() returns at once, so it
# cannot tell; there each launch first retires, oldest first, those whose end event says the GPU
# finished them (a query, no blocking: their buckets go back to the pool and their units' updates
# may start at once), and only beyond MAX_IN_FLIGHT still running does the oldest get waited for,
# which makes the compute stream, not the host, wait for it. Memory stays bounded by the host's
# count either way: buckets and output chunks are allocated on the compute stream and reused only
# by work queued after that wait (Note [buffers across streams]).
MAX_IN_FLIGHT = 2


class BucketPool:
    """Note [bucket reuse]: gradient buckets of one backward come from a few buffers sized by
    the largest unit, handed from a finished reduce-scatter to the next unit, instead of one
    fresh allocation per unit. Units of different sizes otherwise fragment the host heap
    (freed-but-resident memory on CPU). On a CPU host each buffer is a mapping of its own
    (Note [own mappings] in zero/host_memory.py).

    Note [pools follow backward] (as the gather pool, unit/storage.py): every unit reduced
    through a bucket takes exactly one per backward, so the pool knows how many takes are left
    (``takes_left``) and keeps no more idle buffers than that: after the last such unit (the
    first block of a GPT) its buffers are gone before the embedding's dense gradient arrives.
    The pool is emptied when backward ends, so the optimizer step's temporaries never sit
    beside idle buckets."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, keep: int, users: int):
        self.numel, self.dtype, self.device, self.keep, self.users = numel, dtype, device, keep, users
        self._free: list[torch.Tensor] = []
        self.allocated = 0  # buffers alive: lent out or free
        self.takes_left = users  # in this backward

    def take(self, numel: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(buffer, view of its first ``numel`` elements); (None, a fresh tensor) when
        ``numel`` is beyond the pool's size (a lone parameter that arrived on no rank)."""
        if numel > self.numel:
            return None, torch.empty(numel, dtype=self.dtype, device=self.device)
        self.takes_left = max(self.takes_left - 1, 0)
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = (host_buffer(self.numel * self.dtype.itemsize).view(self.dtype) if self.device.type == "cpu"
                      else torch.empty(self.numel, dtype=self.dtype, device=self.device))
            self.allocated += 1
        return buffer, buffer[:numel]

    def give_back(self, buffer: torch.Tensor) -> None:
        if len(self._free) < min(self.keep, self.takes_left):
            self._free.append(buffer)
        else:
            self.allocated -= 1

    def clear(self) -> None:
        """End of backward: drop the idle buffers; the next backward takes afresh."""
        self.allocated -= len(self._free)
        self._free.clear()
        self.takes_left = self.users

    def nbytes(self) -> int:
        return self.allocated * self.numel * self.dtype.itemsize


class GradReducer:
    """Writes each record's gradient part (``record.gradient``, unit/parts.py) and tells two listeners about a record:
    ``on_unit_complete`` when all its gradients arrived (stage 3 may release the unit) and
    ``on_unit_reduced`` when its chunk is final for this backward, so an update can start
    while backward goes on (update.py, Note [update while backward runs])."""

    def __init__(
        self,
        records: list[UnitRecord],
        order: list[int],
        policy: ReducePolicy,
        group,
        *,
        on_unit_complete: Callable[[UnitRecord], None] | None = None,
        on_unit_reduced: Callable[[UnitRecord], None] | None = None,
        lazy_gradients: bool = False,
        closed_by_module: frozenset[int] = frozenset(),
        arrivals_per_param: Callable[[UnitRecord], int] | None = None,
    ):
        self.records = records
        # Note [expert gradients]: units complete when their module's backward is over.
        self.closed_by_module = closed_by_module
        # Note [gradients per recomputation]: how many times each parameter of a unit arrives in
        # this backward, asked at its first arrival (stage 3's gatherer knows); None: once.
        self.arrivals_per_param = arrivals_per_param
        self.order = order
        self.policy = policy
        self.group = group
        self.on_unit_complete = on_unit_complete
        self.on_unit_reduced = on_unit_reduced
        self.communicate = True
        # Elements per int8 block of a quantized reduce-scatter (ZeRO++ qgZ: Note [quantized
        # collectives] in comm/quantized_collectives.py); None: exact.
        self.quantize_block: int | None = None
        # ZeRO++ hpZ's (host group, group across hosts): exact reduce-scatters run as two, within
        # the host then across (Note [hierarchical reduce-scatter] in comm/quantized_collectives.py);
        # None: flat.
        self.hierarchy: tuple | None = None
        # Note [lookup gradients] in lookup_gradients.py: tied embeddings whose lookup rows are
        # added after their dense reduce-scatter; None: none.
        self.lookups: LookupGradients | None = None
        self._next = 0
        self._in_flight: deque = deque()
        self._pools: dict[tuple, BucketPool] = {}
        self.lazy_gradients = lazy_gradients  # Note [lazy gradient shards]
        if policy.keeps_full:
            if not lazy_gradients:
                for record in records:
                    self._create_full(record)
        else:
            self._create_chunks()
            self._pools = self._bucket_pools(records)
        for record in records:  # the hooks live as long as the parameters
            for position, param in enumerate(record.unit.params):
                param.register_post_accumulate_grad_hook(functools.partial(self._arrive, record, position))

    @classmethod
    def _bucket_pools(cls, records: list[UnitRecord]) -> dict[tuple, BucketPool]:
        """REDUCE_SCATTER: one pool per (dtype, device), its buffers the size of the largest
        unit that needs a bucket (Note [bucket reuse])."""
        largest: dict[tuple, int] = {}
        users: dict[tuple, int] = {}
        for record in records:
            unit = record.unit
            key = (unit.dtype, unit.device)
            largest.setdefault(key, 0)
            users.setdefault(key, 0)
            if not cls._reduces_in_place(unit):
                largest[key] = max(largest[key], unit.layout.padded_numel)
                users[key] += 1
        return {(dtype, device): BucketPool(numel, dtype, device, keep=MAX_IN_FLIGHT + 1, users=users[(dtype, device)])
                for (dtype, device), numel in largest.items()}

    # -- during backward -------------------------------------------------------------------
    def _arrive(self, record: UnitRecord, position: int, param: torch.Tensor) -> None:
        unit = record.unit
        offset = unit.layout.offsets[position]
        numel = param.numel()
        grad = param.grad
        if grad is None:
            raise InternalError(f"unit {record.index}: a gradient hook fired for a parameter without .grad")
        gradient = record.gradient
        if self.policy.keeps_full:
            full = gradient.full
            if full is None:  # Note [lazy gradient shards]: the window's first arrival
                full = self._create_full(record, arriving=position)
            view = full[offset : offset + numel]
            if grad.data_ptr() != view.data_ptr():
                # Someone replaced .grad (e.g. zero_grad(set_to_none=True)); fold it back in.
                view.add_(grad.reshape(-1))
                param.grad = view.view(param.shape)
            if not self.communicate:
                return
        else:
            bucket = gradient.bucket
            if bucket is None and self._reduces_in_place(unit):
                gradient.hold_bucket(grad.reshape(-1), None, [True])
                param.grad = None
            elif bucket is None:
                # Not zeroed: each parameter's slot is written at its first arrival in this
                # backward; _launch zeroes the slots never written.
                buffer, bucket = self._pool_of(unit).take(unit.layout.padded_numel)
                gradient.hold_bucket(bucket, buffer, [False] * len(unit.params))
            if bucket is not None:
                slot = bucket[offset : offset + numel]
                written = gradient.written
                if written is not None and written[position]:
                    slot.add_(grad.reshape(-1))  # another region's (Note [gradients per recomputation])
                else:
                    slot.copy_(grad.reshape(-1))
                    gradient.mark_written(position)
                param.grad = None
        if gradient.arrive(self._needed(record) if gradient.state is GradState.IDLE else None):
            if self.on_unit_complete is not None:
                self.on_unit_complete(record)
            self._launch_ready_prefix()

    def _needed(self, record: UnitRecord) -> int | None:
        """The arrivals that complete ``record``'s unit in this backward (at its first)."""
        if record.index in self.closed_by_module:
            return None  # Note [expert gradients]
        per_param = 1 if self.arrivals_per_param is None else self.arrivals_per_param(record)
        return per_param * len(record.unit.params)

    def close_unit(self, record: UnitRecord) -> None:
        """Note [expert gradients]: ``record``'s module finished its backward on every rank;
        whatever of its gradients has not arrived on this rank will not."""
        if record.gradient.state not in (GradState.IDLE, GradState.FILLING):
            return
        record.gradient.close_arrivals()
        if self.on_unit_complete is not None:
            self.on_unit_complete(record)
        self._launch_ready_prefix()

    def _launch_ready_prefix(self) -> None:
        while self._next < len(self.order) and self.records[self.order[self._next]].gradient.state is GradState.READY:
            self._launch(self.records[self.order[self._next]])
            self._next += 1

    def _launch(self, record: UnitRecord) -> None:
        gradient = record.gradient
        into = gradient.start_reduce(record.unit.dtype)  # READY -> REDUCING, or InternalError
        unit = record.unit
        if self.policy.keeps_full:
            full = gradient.full
            if full is None:  # nothing arrived on this rank; other ranks may contribute
                full = self._create_full(record)
            if self.policy is ReducePolicy.ALL_REDUCE:
                handle = collectives.all_reduce(full, group=self.group, async_op=True, unit=unit.collective_id)
                self._in_flight.append((record, handle, None))
                return
            chunk = gradient.chunk
            if chunk is None:
                raise InternalError(f"unit {record.index}: a full gradient buffer without its chunk")
            # Note [scatter in place]: this rank's chunk of the sum lands in the buffer's own chunk.
            handle = collectives.reduce_scatter(chunk, full, group=self.group, async_op=True, unit=unit.collective_id)
            self._in_flight.append((record, handle, None))
            self._retire_beyond_limit()
            return
        bucket, written, buffer = gradient.hand_over_bucket()
        if bucket is None:  # nothing arrived on this rank; other ranks may still contribute
            buffer, bucket = self._pool_of(unit).take(unit.layout.padded_numel)
            bucket.zero_()
        elif written is not None:
            self._zero_unwritten(unit, bucket, written)
        # The window's first contribution reduces straight into the accumulator.
        out = into if into is not None else torch.empty(unit.layout.chunk_numel, dtype=unit.dtype, device=unit.device)
        if self.quantize_block is None and self.hierarchy is not None:
            handle = quantized_collectives.hierarchical_reduce_scatter(
                out, bucket, within=self.hierarchy[0], across=self.hierarchy[1], async_op=True, unit=unit.collective_id)
        elif self.quantize_block is None:
            handle = collectives.reduce_scatter(out, bucket, group=self.group, async_op=True, unit=unit.collective_id)
        else:
            handle = quantized_collectives.quantized_reduce_scatter(out, bucket, group=self.group,
                                                                    block=self.quantize_block, async_op=True,
                                                                    unit=unit.collective_id)
        self._in_flight.append((record, handle, (out, bucket, buffer)))
        self._retire_beyond_limit()

    def _retire_beyond_limit(self) -> None:
        """Note [in flight by events]"""
        while self._in_flight and (len(self._in_flight) > MAX_IN_FLIGHT or self._in_flight[0][1].finished_on_device()):
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        record, handle, buffers = self._in_flight.popleft()
        handle.wait()
        out, pooled = None, None
        if buffers is not None:
            out, _bucket, pooled = buffers  # an unpooled bucket dies with this tuple
        # Note [lazy gradient shards]: the window's first contribution becomes the chunk.
        record.gradient.finish_reduce(out)
        if self.policy is ReducePolicy.SCATTER_AT_BOUNDARY:
            for param in record.unit.params:  # Note [scatter in place]: no view shows a partial sum
                param.grad = None
        if pooled is not None:
            self._pool_of(record.unit).give_back(pooled)
        if self.on_unit_reduced is not None and self.communicate and (self.lookups is None
                                                                       or record.index not in self.lookups.units):
            self.on_unit_reduced(record)

    def finish_backward(self) -> None:
        """Issue what unused parameters held back (in order), then wait for everything."""
        if self.policy.keeps_full and not self.communicate:
            return
        for index in self.order[self._next :]:
            record = self.records[index]
            state = record.gradient.state
            if state is not GradState.READY:
                if self.on_unit_complete is not None and state is GradState.FILLING:
                    self.on_unit_complete(record)
                record.gradient.close_arrivals()
        self._launch_ready_prefix()
        while self._in_flight:
            self._complete_oldest()
        if self.lookups is not None:  # Note [lookup gradients]: the rows, then the unit is final
            for record in self.lookups.finish():
                if self.on_unit_reduced is not None:
                    self.on_unit_reduced(record)
        self._next = 0
        for pool in self._pools.values():
            pool.clear()
        late = [record.index for record in self.records if record.gradient.state is not GradState.IDLE]
        if late:  # Note [gradients per recomputation]: refused before the step uses a partial sum
            raise InternalError(
                f"unit {late[0]}: a gradient arrived after the unit's reduction in this backward",
                hint="a module used both inside a reentrant checkpoint region and outside it in one forward: "
                     "checkpoint it with use_reentrant=False")

    @staticmethod
    def _create_full(record: UnitRecord, arriving: int | None = None) -> torch.Tensor:
        """ALL_REDUCE, SCATTER_AT_BOUNDARY: the unit's zeroed full gradient buffer (returned); every parameter's
        ``.grad`` but the ``arriving`` one's (added in by the caller) becomes a view into it."""
        unit = record.unit
        full = torch.zeros_like(unit.full)
        record.gradient.hold_full(full, full[slice(*unit.layout.chunk_range(unit.rank))])
        for position, (param, offset) in enumerate(zip(unit.params, unit.layout.offsets, strict=True)):
            if position != arriving:
                param.grad = full[offset : offset + param.numel()].view(param.shape)
        return full

    def _pool_of(self, unit: FlatUnit) -> BucketPool:
        return self._pools[(unit.dtype, unit.device)]

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
        for record in self.records:
            full = record.gradient.full
            if full is None:
                continue
            if not self.lazy_gradients:
                full.zero_()
                continue
            record.gradient.drop()  # Note [lazy gradient shards]
            for param in record.unit.params:
                param.grad = None
        if self.policy is ReducePolicy.REDUCE_SCATTER:
            self._create_chunks()

    def _create_chunks(self) -> None:
        """REDUCE_SCATTER: fresh all-zero fp32 accumulators, or none (Note [lazy gradient shards])."""
        for record in self.records:
            chunk = record.gradient.chunk
            if self.lazy_gradients:
                chunk = None
            elif chunk is None:
                chunk = torch.zeros(record.unit.layout.chunk_numel, dtype=torch.float32, device=record.unit.device)
            else:
                chunk.zero_()
            record.gradient.start_window(chunk)

    def nbytes(self) -> tuple[int, int]:
        """(gradient accumulator bytes, transient bucket bytes) held right now."""
        persistent = sum(r.gradient.nbytes() for r in self.records)
        transient = sum(r.gradient.bucket.numel() * r.gradient.bucket.element_size() for r in self.records
                        if r.gradient.bucket is not None and r.gradient.buffer is None)
        transient += sum(pool.nbytes() for pool in self._pools.values())
        return persistent, transient
