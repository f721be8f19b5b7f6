"""Flat units: whole parameters laid end to end in one buffer, split into per-rank chunks.

A ``FlatUnit`` owns the storage of its parameters' values. Every parameter becomes a view into
the unit's padded flat buffer (``full``), so one collective moves a whole unit and the
optimizer's update of a chunk is visible to the module without a copy.

Note [freeing by storage resize]: in stage 3 the full buffer's *storage* is resized to zero
bytes between uses instead of dropping the tensor. The parameter views (and any views that
autograd saved in forward) keep pointing at the same storage, so after the unit is gathered
again for backward those saved views read the gathered values (the technique FSDP uses).

Note [gather pool]: on a CPU host a freed storage goes back to glibc, and the next gather of
the unit takes fresh memory: above glibc's 32 MiB mmap ceiling every gather page-faults in
(2-3 us per 4 KiB page on the 2-core VM, a fault cost that showed as most of stage 3's extra
step time), and below it the gathers interleave with activations in the heap and fragment it.
So on CPU the memory moves instead of being freed: ``GatherPool`` keeps released buffers by
size, and a gather swaps a pooled buffer's memory into the unit's own storage object
(``UntypedStorage._swap_data_ptr_``), which keeps the identity the saved views rely on. The
pool holds at most what was gathered at once (the running module, the prefetched one and any
unit kept for reuse), reported as communication buffers, gives back what the rest of the pass
will not gather (Note [pools follow backward] below) and is emptied at every optimizer step,
before the update: between steps a unit is its shard alone, as with FSDP2 (the first gathers
of each forward take memory again; issue 20). Large buffers are mappings of their own, so
what the pool gives back leaves the process (Note [own mappings] in zero/host_memory.py). On
CUDA the caching allocator already reuses memory, so units resize their storage as before; so
does a torch without the swap.

Note [host shards]: with stage-3 parameter offload (``zero.offload_param.device``) the owned
chunk is kept where its placement's ``place_shard`` puts it (offload/placements.py: cpu, host memory,
pinned when the model is on CUDA; nvme, a memory-mapped file) and copied onto the device right
before its all-gather when it is not there already, on a copy stream (Note [copy stream] in
unit/staging.py); the staged
copy lives until the gather is waited for (the collective reads it), then is dropped, so the device holds only gathered units. The optimizer
publishes updates straight into the host chunk. On a CPU host the chunk is simply a tensor of
its own and the staging is skipped.

Note [fp32 shard]: in bf16/fp16 with the optimizer state and the chunk both beside the model
(no offload), the owned chunk is kept in fp32 and IS the optimizer's master
(``OnDevice.make_master`` calls ``keep_shard_in_fp32``): one copy per shard, 4 bytes per element
instead of a model-dtype chunk (2) beside an fp32 master (4), as FSDP2's mixed precision keeps
it. A gather casts this rank's chunk into its slot of the model-dtype ``full`` buffer and
all-gathers in place, so the other ranks' chunks arrive in the model dtype, each rounded once
from its fp32 master: the same values a publish into a model-dtype chunk gave, so training is
bit-for-bit what it was with two copies. The cast needs no buffer beyond ``full`` itself.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable

import torch
from torch import nn

from zerorun.errors import InternalError
from zerorun.zero.comm import collectives, quantized_collectives
from zerorun.zero.host_memory import host_buffer
from zerorun.zero.unit import staging
from zerorun.zero.unit.layout import ParamSpec, UnitLayout
from zerorun.zero.unit.secondary import SecondaryCopy


# The group index of a frozen unit: in no optimizer group (Note [frozen units] in unit/partition.py).
FROZEN_GROUP = -1


class ParamState(enum.Enum):
    """Which value buffers of a unit are alive.

    REPLICATED  ``full`` is allocated and valid on every rank; ``shard`` is a view of it
                (stages 0-2, and stage 3's persistent parameters).
    SHARDED     only ``shard`` (this rank's chunk) is allocated; ``full`` has 0-byte storage.
    GATHERING   ``full`` is allocated and an all-gather into it is in flight.
    GATHERED    ``full`` is allocated and valid; ``shard`` is still the owned copy.
    """

    REPLICATED = "replicated"
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


_ALLOWED = {
    ParamState.SHARDED: {ParamState.GATHERING, ParamState.GATHERED},
    ParamState.GATHERING: {ParamState.GATHERED},
    ParamState.GATHERED: {ParamState.SHARDED},
    ParamState.REPLICATED: set(),
}


class GatherPool:
    """Released gather buffers of a CPU host, by byte size (Note [gather pool]); large ones in
    mappings of their own (Note [own mappings] in zero/host_memory.py).

    Note [pools follow backward]: along a recorded forward and backward the gatherer tells the
    pool how many gathers of each size the rest of the pass will still make (``expect``, from
    ``gathers_still_wanted`` in param_gather.py); a released buffer beyond that is dropped
    instead of kept, and a large one's memory leaves the process at once. On the 33.7M GPT
    stage 3 peaked on a CPU host at the end of backward (the embedding's dense gradient and its
    shard arriving beside idle pools); now the blocks' buffers go once forward has no block
    left to gather, before the head's logits, and again after the first block's backward, and the
    output head's 33.5 MB buffer right after the head's backward. The peak moved to the loss
    and went down by 40-60 MiB per rank. Off the recorded order (the first forward, or one that
    leaves it) the pool keeps everything (``expect(None)``): a wrong guess would only cost a
    fresh allocation, never correctness.
    """

    SUPPORTED = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._wanted: dict[int, int] | None = None  # None: keep everything released

    def take(self, nbytes: int) -> torch.UntypedStorage:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        return host_buffer(nbytes).untyped_storage()

    def give_back(self, storage: torch.UntypedStorage) -> None:
        free = self._free.setdefault(storage.nbytes(), [])
        if self._wanted is None or len(free) < self._wanted.get(storage.nbytes(), 0):
            free.append(storage)

    def expect(self, wanted: dict[int, int] | None) -> None:
        """Keep at most ``wanted[nbytes]`` idle buffers of each size from now on (None: all)."""
        self._wanted = wanted
        if wanted is not None:
            for nbytes, free in self._free.items():
                del free[wanted.get(nbytes, 0):]

    def clear(self) -> None:
        self._free.clear()

    def nbytes(self) -> int:
        return sum(s.nbytes() for free in self._free.values() for s in free)


class FlatUnit:
    """One unit's parameter storage; ``index`` is its position in the engine's unit list."""

    def __init__(
        self,
        index: int,
        group_index: int,
        named_params: list[tuple[str, nn.Parameter]],
        shard_world: int,
        shard_rank: int,
        *,
        partition_params: bool,
        alignment: int = 1,
        shard_home=None,
    ):
        self.index = index
        self.group_index = group_index
        # What its collectives say they gather (Note [collective agreement] in comm/agreement.py):
        # (engine number, index), the engine number set by the engine that owns the unit.
        self.collective_id: tuple[int, int] = (-1, index)
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.layout = UnitLayout(
            tuple(ParamSpec(n, p.numel()) for n, p in named_params), shard_world, alignment
        )
        self.rank = shard_rank
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        lo, hi = self.layout.chunk_range(shard_rank)
        self.partitioned = partition_params
        # The chunk stays on the compute device (no parameter offload): Note [fp32 shard].
        self.shard_beside_model = shard_home is None or shard_home.location == "device"
        if partition_params:
            # Note [chunk-only construction]: a partitioned unit never holds its whole buffer
            # while it is built: ``full`` gets its shape with no memory, and each parameter's
            # piece of this rank's chunk is copied straight into the shard. Building a model
            # unit by unit (construct.py) then costs the shards plus one unit's parameters,
            # without a unit-sized buffer beside them whose freed memory the host heap keeps.
            self.full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)  # untouched
            self.shard = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for param, offset in zip(self.params, self.layout.offsets, strict=True):
                    start, end = max(lo, offset), min(hi, offset + param.numel())
                    if start < end:
                        self.shard[start - lo : end - lo].copy_(param.detach().reshape(-1)[start - offset : end - offset])
                    param.data = self.full[offset : offset + param.numel()].view(param.shape)
            self.full_nbytes = self.full.untyped_storage().nbytes()
            self.full.untyped_storage().resize_(0)
            if shard_home is not None:  # a Placement (Note [host shards])
                self.shard = shard_home.place_shard(self.shard, index)
            self.state = ParamState.SHARDED
        else:
            self.full = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            self.full_nbytes = self.full.untyped_storage().nbytes()
            with torch.no_grad():
                for param, offset in zip(self.params, self.layout.offsets, strict=True):
                    view = self.full[offset : offset + param.numel()]
                    view.copy_(param.detach().reshape(-1))
                    param.data = view.view(param.shape)
            self.shard = self.full[lo:hi]
            self.state = ParamState.REPLICATED
        self._gather_handle: collectives.Issued | quantized_collectives.QuantizedHandle | None = None
        # Elements per int8 block when this unit's gathers are quantized (ZeRO++ qwZ: Note
        # [quantized collectives] in comm/quantized_collectives.py); None: exact gathers.
        self.quantize_block: int | None = None
        # ZeRO++ hpZ's host-local copy (Note [secondary copy] in unit/secondary.py), None: off;
        # whether the gather in flight refreshes it.
        self.secondary: SecondaryCopy | None = None
        self._keep_secondary = False
        self._staged_shard: torch.Tensor | None = None  # Note [host shards]
        self.pool: GatherPool | None = None  # set by the stage-3 gatherer on CPU
        self._lent: torch.UntypedStorage | None = None  # the pool's (now empty) storage object
        # Called after every state change (DeepSpeed's ds_status: unit/ds_params.py; the class of
        # a partitioned parameter: zero/param_access.py).
        self.state_listeners: list[Callable[[FlatUnit], None]] = []

    @property
    def frozen(self) -> bool:
        """A unit of frozen parameters: gathered for use, never reduced or stepped."""
        return self.group_index == FROZEN_GROUP

    def write_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set one parameter's values from the whole ``value``: this rank's piece of it into the
        shard, and all of it into ``full`` while that is valid (a checkpoint's frozen tensors)."""
        position = next(i for i, p in enumerate(self.params) if p is param)
        offset, numel = self.layout.offsets[position], param.numel()
        flat = value.reshape(-1)
        if self.secondary is not None:
            self.secondary.invalidate()
        with torch.no_grad():
            if self.state is not ParamState.SHARDED:
                self.full[offset : offset + numel].copy_(flat)
            if self.partitioned:
                lo, hi = self.layout.chunk_range(self.rank)
                start, end = max(lo, offset), min(hi, offset + numel)
                if start < end:
                    self.shard[start - lo : end - lo].copy_(flat[start - offset : end - offset])

    def _allocate_full(self) -> None:
        storage = self.full.untyped_storage()
        if self.pool is None:
            storage.resize_(self.full_nbytes)
        else:
            self._lent = self.pool.take(self.full_nbytes)
            storage._swap_data_ptr_(self._lent)  # type: ignore[attr-defined]  # private; GatherPool.SUPPORTED

    def _free_full(self) -> None:
        storage = self.full.untyped_storage()
        if self._lent is None:
            storage.resize_(0)
            return
        if self.pool is None:
            raise InternalError(f"unit {self.index}: a pooled gather buffer without its pool")
        storage._swap_data_ptr_(self._lent)  # type: ignore[attr-defined]  # private; GatherPool.SUPPORTED
        self.pool.give_back(self._lent)
        self._lent = None

    # -- stage 3 gathering ------------------------------------------------------------
    def _move(self, new: ParamState) -> None:
        if new not in _ALLOWED[self.state]:
            raise InternalError(f"unit {self.index}: parameter state {self.state.name} -> {new.name} is not a transition")
        self.state = new
        for listener in self.state_listeners:
            listener(self)

    def start_gather(self, group) -> None:
        """Allocate ``full`` and issue the all-gather (async); no-op unless SHARDED."""
        if self.state is not ParamState.SHARDED:
            return
        mapped = getattr(self.shard, "zerorun_mapped_file", None)
        if mapped is not None:  # a memory-mapped NVMe chunk: a truncated file would be a SIGBUS
            from zerorun.zero.offload.file_io import check_mapped

            check_mapped(*mapped)
        self._allocate_full()
        secondary = self.secondary
        kept = secondary.serves() if secondary is not None else None
        if secondary is not None and kept is not None:  # backward: within the host
            self._keep_secondary = False
            self._gather_handle = collectives.all_gather(self.full, kept, group=secondary.group,
                                                         async_op=True, unit=self.collective_id)
            self._move(ParamState.GATHERING)
            return
        self._keep_secondary = secondary is not None and secondary.keeps()
        source = self.shard
        if source.dtype != self.dtype:  # Note [fp32 shard]: cast into this rank's slot
            lo, hi = self.layout.chunk_range(self.rank)
            source = self.full[lo:hi]
            source.copy_(self.shard)
        elif source.device != self.device:  # a host shard: Note [copy stream] in unit/staging.py
            source = self._staged_shard = staging.stage(source, self.device)
        if self.quantize_block is None:
            self._gather_handle = collectives.all_gather(self.full, source, group=group, async_op=True,
                                                         unit=self.collective_id)
        else:  # the shard stays exact; only the gathered copy forward/backward read is rounded
            self._gather_handle = quantized_collectives.quantized_all_gather(
                self.full, source, group=group, block=self.quantize_block, async_op=True, unit=self.collective_id)
        self._move(ParamState.GATHERING)

    @contextlib.contextmanager
    def exact_gathers(self):
        """Gathers issued inside are never quantized (qwZ): a full state dict, a
        GatheredParameters block, which may write the gathered values back to the masters."""
        block, self.quantize_block = self.quantize_block, None
        secondary, self.secondary = self.secondary, None  # an exact copy is not forward's values
        try:
            yield
        finally:
            self.quantize_block, self.secondary = block, secondary
            if secondary is not None:  # the block may have written the masters
                secondary.invalidate()

    def gather(self, group) -> None:
        """Make ``full`` valid (waiting for a prefetch if one is in flight)."""
        if self.state is ParamState.SHARDED:
            self.start_gather(group)
        self._finish_gather()

    def _finish_gather(self) -> None:
        if self.state is ParamState.GATHERING:
            if self._gather_handle is None:
                raise InternalError(f"unit {self.index}: gathering without a collective in flight")
            self._gather_handle.wait()
            self._gather_handle = self._staged_shard = None  # the collective has read the staged copy
            if self._keep_secondary and self.secondary is not None:
                self.secondary.keep(self.full)
                self._keep_secondary = False
            self._move(ParamState.GATHERED)

    def release(self, *, detach: bool = False) -> None:
        """Drop ``full`` (stage 3); waits for an in-flight gather first.

        ``detach``: Note [detached release]."""
        self._finish_gather()
        if self.state is ParamState.GATHERED:
            if detach:
                self._detach_full()
            else:
                self._free_full()
            self._move(ParamState.SHARDED)

    def _detach_full(self) -> None:
        """Note [detached release]: a tensor read from a parameter inside a
        ``GatheredParameters`` block (``p.data``, and on a CPU ``p.data.cpu()``, which is the same
        tensor) shares the unit's storage; freeing that storage would empty it. So the gathered
        storage is left to whatever still references it (freed with the last reference; a
        pooled buffer is not given back) and the parameters move to a new, empty ``full``."""
        self._lent = None
        self.full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)  # untouched
        with torch.no_grad():  # views first: a view of an empty storage cannot be taken
            for param, offset in zip(self.params, self.layout.offsets, strict=True):
                param.data = self.full[offset : offset + param.numel()].view(param.shape)
        self.full.untyped_storage().resize_(0)

    def keep_shard_in_fp32(self) -> torch.Tensor:
        """Note [fp32 shard]: the owned chunk becomes an fp32 tensor, returned as the master."""
        if not (self.partitioned and self.shard_beside_model and self.state is ParamState.SHARDED):
            raise InternalError(f"unit {self.index}: only an owned chunk beside the model can be kept in fp32")
        self.shard = self.shard.float()
        return self.shard

    # -- after an optimizer step ---------------------------------------------------------
    def start_refresh(self, group):
        """Stages 1-2: spread every rank's updated chunk to all ranks (in place, async)."""
        if self.state is not ParamState.REPLICATED:
            raise InternalError(f"unit {self.index}: refresh of a {self.state.name} unit (only replicated units refresh)")
        if self.layout.world_size == 1:
            return collectives.DONE
        return collectives.all_gather(self.full, self.shard, group=group, async_op=True, unit=self.collective_id)

    def param_nbytes(self) -> int:
        """This rank's own parameter bytes: its shard (stage 3), or the whole unit."""
        if self.partitioned:
            return self.shard.numel() * self.shard.element_size()
        return self.full.untyped_storage().nbytes()

    def gathered_nbytes(self) -> int:
        """Stage 3: the bytes of the gathered copy alive now (in flight or gathered), else 0."""
        return self.full.untyped_storage().nbytes() if self.partitioned else 0
