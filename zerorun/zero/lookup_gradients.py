"""Stage 3: a tied token embedding's lookup gradient as rows, not as a dense table
(Note [lookup gradients]).

    pytest tests/distributed/test_lookup_gradients.py tests/unit/test_lookup_rows.py

Note [lookup gradients]: a token embedding tied to the output head (GPT-2, the bench GPT of
examples/gpt.py) is one parameter with two uses. Autograd sums both uses' gradients before the
parameter's hook fires, so the unit completes only when the lookup's backward runs, the last op
of backward, and its whole dense gradient (vocab x width) is reduce-scattered then, with no
compute left to hide behind: 16.8 MB sent per rank for the 33.7M GPT, 0.47 s at 300 Mbit/s,
while at backward's start the link stood idle waiting for the first block's gradient. Yet the
lookup's share of that gradient is nonzero only in the rows of the tokens looked up. With
``zero.tied_embedding_rows``:
- the lookup is recomputed by ``_Lookup`` (a forward hook that runs before the gatherer's
  own), whose backward keeps (token ids, output gradient) instead of adding into the weight's
  gradient. The weight's hook then fires with the head's share alone, right after the head's
  backward, the first of backward: the unit goes first in the reduce order (by where the head
  registers the parameter) and its dense reduce-scatter moves while the blocks' backward runs.
- at the end of backward each rank sums its rows per distinct token in fp32, counts the rows
  each peer's chunk holds (an all-gather of counts, so every rank pads alike), and sends each
  peer just those rows (one exchange of padded parts: ids, then rows in the unit's dtype).
  Each rank adds, in rank order, every rank's rows for its chunk into its chunk of the reduced
  gradient; only then is the unit reported reduced (an update may start).
Bytes per rank for the lookup share: the rows of its distinct tokens that other ranks own,
(width + 2) x 4 bytes each in fp32, instead of a reduce-scatter of vocab x width. The sum is the
dense path's sum taken in another order (per row in fp32, then across ranks), so results differ
from it in the last bits. It applies to an nn.Embedding whose weight is trained, is a unit of its
own, is registered in another module too (the tied head) and is looked up plainly (nn.Embedding's
own forward, no max_norm, scale_grad_by_freq or sparse: ``looked_up_plainly``); other embeddings
keep the dense path. When the lookup reads rows (Note [lookup rows first] in lookup_rows.py),
the weight it recomputes from is the stand-in table of those rows. A model that calls the
embedding but not the head still trains right, but its dense reduce then waits for the end of
backward and holds the other units' launches back (Note [launch order] in grad_reduce.py).
"""

from __future__ import annotations

import math
from typing import TypeGuard

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerorun.errors import InternalError
from zerorun.zero.comm import collectives
from zerorun.zero.unit.record import UnitRecord

ID_BYTES = 8  # int64 token ids on the wire


# --- the math (pure functions) ---------------------------------------------------------------


def rows_by_token(ids: torch.Tensor, grad_output: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct token ids, their gradient rows summed in fp32), the padding token left out (its
    row gets no gradient, as in F.embedding)."""
    width = grad_output.shape[-1]
    flat_ids, flat_rows = ids.reshape(-1), grad_output.reshape(-1, width)
    if padding_idx is not None:
        keep = flat_ids != padding_idx
        flat_ids, flat_rows = flat_ids[keep], flat_rows[keep]
    distinct, inverse = torch.unique(flat_ids, return_inverse=True)
    summed = torch.zeros(distinct.numel(), width, dtype=torch.float32, device=grad_output.device)
    summed.index_add_(0, inverse, flat_rows.float())
    return distinct, summed


def chunk_rows(rank: int, chunk_numel: int, width: int, rows: int) -> tuple[int, int]:
    """The table rows [first, end) that rank ``rank``'s chunk of the flat table touches (a row
    may straddle two chunks: it belongs to both)."""
    start, stop = rank * chunk_numel, min((rank + 1) * chunk_numel, rows * width)
    if start >= stop:
        return 0, 0
    return start // width, min(math.ceil(stop / width), rows)


def owned_by(ids: torch.Tensor, rank: int, chunk_numel: int, width: int, rows: int) -> torch.Tensor:
    """Which of ``ids`` touch rank ``rank``'s chunk."""
    first, end = chunk_rows(rank, chunk_numel, width, rows)
    return (ids >= first) & (ids < end)


def add_rows(chunk: torch.Tensor, rank: int, width: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Add table rows ``rows`` (at ``ids``, each touching this chunk) into ``chunk``, rank
    ``rank``'s piece of the flat table (padding past the table's end excluded)."""
    if ids.numel() == 0:
        return
    base = rank * chunk.numel()
    begin = ids * width - base  # each row's first element, relative to the chunk
    inside = (begin >= 0) & (begin + width <= chunk.numel())
    if bool(inside.all()) and base % width == 0:  # every row whole here (the usual case)
        whole = chunk[: (chunk.numel() // width) * width].view(-1, width)
        whole.index_add_(0, (begin // width), rows.to(chunk.dtype))
        return
    for offset, row in zip(begin.tolist(), rows, strict=True):  # rows cut by a chunk boundary
        low, high = max(offset, 0), min(offset + width, chunk.numel())
        chunk[low:high] += row[low - offset : high - offset].to(chunk.dtype)


# --- the autograd side -----------------------------------------------------------------------


class _Lookup(torch.autograd.Function):
    """F.embedding whose weight gradient is kept as (ids, output gradient) by ``sink``. ``anchor``
    (a 0-d leaf that requires grad) makes the output require grad although the weight passed is
    detached, so autograd never adds this use into the weight's gradient."""

    @staticmethod
    def forward(ctx, anchor, ids, weight, padding_idx, sink):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.sink = padding_idx, sink
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        ctx.sink(ids, grad_output, ctx.padding_idx)
        return None, None, None, None, None


def looked_up_plainly(module: nn.Module) -> TypeGuard[nn.Embedding]:
    """An ``nn.Embedding`` that computes ``F.embedding(ids, weight, padding_idx)`` and nothing
    else, the lookup ``_Lookup`` recomputes: its forward is nn.Embedding's own, neither a
    subclass's (BART's scaled word embedding multiplies its rows) nor one set on the instance (a
    wrapper's), and it takes none of the options that lookup leaves out."""
    return (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
            and "forward" not in vars(module) and module.max_norm is None
            and not module.scale_grad_by_freq and not module.sparse)


def tied_lookups(model: nn.Module, records: list[UnitRecord]) -> dict[nn.Embedding, UnitRecord]:
    """The embeddings whose weight takes the sparse path (Note [lookup gradients]): trained, a
    unit of its own, registered elsewhere too, looked up plainly."""
    registrations: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        registrations[id(param)] = registrations.get(id(param), 0) + 1
    lone = {id(r.unit.params[0]): r for r in records if r.unit.partitioned and len(r.unit.params) == 1}
    found: dict[nn.Embedding, UnitRecord] = {}
    for module in model.modules():
        if not looked_up_plainly(module):
            continue
        weight = module.weight
        if weight.requires_grad and id(weight) in lone and registrations.get(id(weight), 0) > 1:
            found[module] = lone[id(weight)]
    return found


def reduce_order(order: list[int], records: list[UnitRecord], model: nn.Module, lookup_units: set[int]) -> list[int]:
    """Note [lookup gradients]: a tied unit's dense share arrives from its last registration
    (the head), so it is ordered by that one; the others keep their place."""
    last: dict[int, int] = {}
    for position, (_, param) in enumerate(model.named_parameters(remove_duplicate=False)):
        last[id(param)] = position
    first: dict[int, int] = {}
    for position, (_, param) in enumerate(model.named_parameters()):
        first.setdefault(id(param), position)

    def registered(index: int) -> int:
        params = records[index].unit.params
        return last[id(params[0])] if index in lookup_units else min(first[id(p)] for p in params)

    return sorted(order, key=lambda index: -registered(index))


class LookupGradients:
    """The rows each tied lookup's backward kept in this backward, per unit, and their exchange
    at backward's end (Note [lookup gradients])."""

    def __init__(self, lookups: dict[nn.Embedding, UnitRecord], group):
        self.group = group
        self.units = frozenset(record.index for record in lookups.values())
        self._records = sorted({r.index: r for r in lookups.values()}.values(), key=lambda r: r.index)
        self._kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {r.index: [] for r in self._records}
        self._anchor: torch.Tensor | None = None
        for module, record in lookups.items():
            # before the gatherer's release; eager under torch.compile, as the gatherer's own hooks
            # (Note [hooks outside the graph] in param_gather.py)
            hook = torch.compiler.disable(self._hook(record.index), recursive=True)
            module.register_forward_hook(hook, prepend=True)

    def _hook(self, index: int):
        def recompute(module: nn.Embedding, args, output):
            if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
                return None
            if self._anchor is None:
                self._anchor = torch.zeros((), device=args[0].device, requires_grad=True)

            def sink(ids, grad_output, padding_idx):
                self._kept[index].append(rows_by_token(ids, grad_output, padding_idx))

            return _Lookup.apply(self._anchor, args[0], module.weight.detach(), module.padding_idx, sink)
        return recompute

    def finish(self) -> list[UnitRecord]:
        """End of backward, after every reduce-scatter is in: add every rank's rows into this
        rank's chunks. Returns the records now final."""
        for record in self._records:
            kept, self._kept[record.index] = self._kept[record.index], []
            self._exchange(record, kept)
        return self._records

    def _exchange(self, record: UnitRecord, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        unit = record.unit
        chunk = record.gradient.chunk
        if chunk is None:
            raise InternalError(f"unit {record.index}: no reduced chunk to add lookup rows into")
        table = unit.params[0]
        rows_total, width = table.shape
        device = chunk.device
        if kept:
            ids = torch.cat([k[0] for k in kept])
            distinct, inverse = torch.unique(ids, return_inverse=True)
            rows = torch.zeros(distinct.numel(), width, dtype=torch.float32, device=device)
            rows.index_add_(0, inverse, torch.cat([k[1] for k in kept]))
        else:
            distinct = torch.empty(0, dtype=torch.int64, device=device)
            rows = torch.empty(0, width, dtype=torch.float32, device=device)
        size, rank = collectives.group_size(self.group), dist.get_rank(self.group)
        chunk_numel = unit.layout.chunk_numel
        masks = [owned_by(distinct, peer, chunk_numel, width, rows_total) for peer in range(size)]
        counts = torch.tensor([int(m.sum()) for m in masks], dtype=torch.int64, device=device)
        everyone = torch.empty(size * size, dtype=torch.int64, device=device)
        collectives.all_gather(everyone, counts, group=self.group, unit=unit.collective_id)
        matrix = everyone.view(size, size).tolist()  # [from][to]
        received: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * size
        most = max((matrix[a][b] for a in range(size) for b in range(size) if a != b), default=0)
        if most > 0:
            received = self._send_rows(unit, distinct, rows, masks, matrix, most, size, rank)
        for source in range(size):  # rank order: every rank sums its chunk alike
            if source == rank:
                add_rows(chunk, rank, width, distinct[masks[rank]], rows[masks[rank]])
            else:
                part = received[source]
                if part is not None:
                    add_rows(chunk, rank, width, *part)

    def _send_rows(self, unit, distinct, rows, masks, matrix, most, size, rank):
        """One exchange of equal parts (``most`` rows each, padded), ids then rows."""
        width, dtype = rows.shape[1], unit.dtype
        row_bytes = width * dtype.itemsize
        part = -(-(most * (ID_BYTES + row_bytes)) // ID_BYTES) * ID_BYTES
        send = torch.zeros(size * part, dtype=torch.uint8, device=rows.device)
        for peer in range(size):
            count = matrix[rank][peer]
            if peer == rank or count == 0:
                continue
            slot = send[peer * part : (peer + 1) * part]
            slot[: count * ID_BYTES].view(torch.int64).copy_(distinct[masks[peer]])
            start = most * ID_BYTES
            slot[start : start + count * row_bytes].view(dtype).view(count, width).copy_(rows[masks[peer]])
        into = torch.empty_like(send)
        collectives.exchange("lookup_rows", send, into, part, group=self.group, unit=unit.collective_id)
        received: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * size
        for source in range(size):
            count = matrix[source][rank]
            if source == rank or count == 0:
                continue
            slot = into[source * part : (source + 1) * part]
            start = most * ID_BYTES
            received[source] = (slot[: count * ID_BYTES].view(torch.int64).clone(),
                                slot[start : start + count * row_bytes].view(dtype).view(count, width).float())
        return received
