"""Stage 3: a tied embedding's lookup reads the rows it looks up, not the gathered table
(Note [lookup rows first]).

    pytest tests/unit/test_lookup_rows.py tests/distributed/test_lookup_gradients.py

Note [lookup rows first]: a forward's first call is usually the token embedding, and with the
table tied to the output head that unit is the largest of the model (33.5 MB of the 33.7M GPT's
134.9). Its gather was the forward's first wait: 16.8 MB per rank, 0.14 s at 1 Gbit/s and 0.45
s at 300 Mbit/s, with only the update to move behind (Note [next forward's gathers in the step]
in step_gathers.py). Yet the lookup reads only the rows of the batch's tokens, and the table is
needed whole only at the head, the forward's last call. With ``zero.tied_embedding_rows``
(whose backward, Note [lookup gradients] in lookup_gradients.py, needs no table either), a
lookup whose unit is not gathered nor in flight when it is called reads rows instead:
- every rank's distinct token ids are all-gathered (their counts first, so every rank pads
  alike) and their union taken, sorted: the same rows on every rank;
- each rank sends the pieces of those rows that its chunk of the flat table holds, in the
  union's order (``rows_piece``), one padded all-gather; laid end to end in rank order the
  pieces are the union's rows, whole (``piece_sizes``: a row cut by a chunk boundary is the
  tail of one piece and the head of the next);
- the rows are copied into a table of the full shape, allocated but untouched elsewhere, which
  stands in for the weight during this call (the module's own ``F.embedding`` reads only rows of
  the union); the parameter is back once the call returns.
The values are the shards' own, so the lookup's output is bit-equal to the gathered table's.
The unit is not gathered for this call: the forward's window reaches it at the head, as any
other unit, and the step no longer issues the first call's gathers for it. Bytes: the union's
rows (the 33.7M GPT: at most 2 x 512 of 16,384 rows) and the ids, against a chunk of the table.
When the union holds more than half the table's rows the gather is cheaper and is done instead
(every rank sees the same union, so all choose alike). It applies where a plain gather would
move the shard as it is: not with qwZ (the gathered copy is rounded) nor hpZ (the secondary
copy is forward's), nor with the shard away from the model's device (parameters offloaded off a
GPU) or memory-mapped (NVMe offload), nor in a compiled model. On the link bench (the 33.7M GPT,
docs/benchmarks.md, 2026-12-02) the forward's first wait fell from 0.1 s to 0.005 s at 1 Gbit/s
and from 0.44 s at 300 Mbit/s, and the update, which no longer issues the table's gather, from
about 105 to 70 ms.
"""

from __future__ import annotations

import torch
from torch import nn

from zerorun.zero.comm import collectives
from zerorun.zero.refresh_ahead import compiled
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import FlatUnit, ParamState

ROWS_FRACTION = 0.5  # above this share of the table's rows, a gather moves fewer bytes per row


# --- the math (pure functions) ---------------------------------------------------------------


def _overlaps(union: torch.Tensor, rank: int, chunk_numel: int, width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``union``, the flat element range [low, high) it shares with ``rank``'s chunk
    (empty where high <= low); padding past the table's end holds no row."""
    start, stop = rank * chunk_numel, min((rank + 1) * chunk_numel, rows * width)
    low = (union * width).clamp(min=start, max=max(start, stop))
    high = ((union + 1) * width).clamp(min=start, max=max(start, stop))
    return low, high


def piece_sizes(union: torch.Tensor, world: int, chunk_numel: int, width: int, rows: int) -> list[int]:
    """Elements of ``union``'s rows that each rank's chunk holds."""
    sizes = []
    for rank in range(world):
        low, high = _overlaps(union, rank, chunk_numel, width, rows)
        sizes.append(int((high - low).sum()))
    return sizes


def rows_piece(shard: torch.Tensor, rank: int, union: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    """The elements of ``union``'s rows (sorted, distinct) that ``shard`` (rank ``rank``'s chunk of
    the flat table) holds, in row order: whole rows by one index_select, the at most two rows the
    chunk's ends cut apart as slices."""
    chunk_numel = shard.numel()
    base = rank * chunk_numel
    low, high = _overlaps(union, rank, chunk_numel, width, rows)
    touched = high > low
    low, high, ids = low[touched], high[touched], union[touched]
    if ids.numel() == 0:
        return shard[:0]
    whole = (high - low) == width
    pieces = []
    if not bool(whole[0]):  # the row the chunk's start (or, for a chunk shorter than a row, both ends) cuts
        pieces.append(shard[int(low[0]) - base : int(high[0]) - base])
    inner = ids[whole]
    if inner.numel():
        first = int(inner[0]) * width - base  # every whole row starts at first + k * width
        span = (chunk_numel - first) // width
        table = shard[first : first + span * width].view(span, width)
        pieces.append(table.index_select(0, inner - inner[0]).reshape(-1))
    if ids.numel() > 1 and not bool(whole[-1]):  # the row the chunk's end cuts
        pieces.append(shard[int(low[-1]) - base : int(high[-1]) - base])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


# --- the engine side -------------------------------------------------------------------------


class RowsFirst:
    """Note [lookup rows first] for the tied lookups of one engine: ``serve`` at a lookup's call,
    ``restore`` when it returns."""

    def __init__(self, lookups: dict[nn.Embedding, UnitRecord], group, model: nn.Module):
        self.lookups = lookups
        self.group = group
        self.model = model
        self._standing: dict[nn.Embedding, tuple[nn.Parameter, UnitRecord]] = {}  # calls reading rows now
        self.fraction = ROWS_FRACTION
        self.served = self.gathered = 0  # calls that read rows, and that gathered after the union (tests read them)

    def would_serve(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` with its unit sharded reads rows (the step leaves its
        gather to it): the unit's gather would move the shard as it is."""
        record = self.lookups.get(module)  # type: ignore[call-overload]
        # compiled: standing a tensor in for a parameter would cost dynamo a guard and a recompile
        return record is not None and _plain_gather(record.unit) and not compiled(self.model)

    def serve(self, module: nn.Module, args) -> UnitRecord | None:
        """At ``module``'s call in forward: when it is a tied lookup whose unit no one gathered,
        fetch the rows of every rank's tokens and stand a table holding them in for the weight.
        Returns the record served, or None (the caller gathers as usual). Collective: every rank
        calls it at the same call, with its own ids."""
        if not self.would_serve(module) or not args or not torch.is_tensor(args[0]):
            return None
        record = self.lookups[module]  # type: ignore[index]
        unit = record.unit
        if unit.state is not ParamState.SHARDED or record.gathering.in_use:
            return None
        weight = unit.params[0]
        rows, width = weight.shape
        union = self._union(args[0], unit)
        if union.numel() == 0 or union.numel() > self.fraction * rows:  # every rank sees the same union
            self.gathered += 1
            return None
        table = torch.empty(rows, width, dtype=unit.dtype, device=unit.device)
        table.index_copy_(0, union, self._fetch(unit, union, rows, width).view(-1, width))
        self._standing[module] = (weight, record)  # type: ignore[index]
        module._parameters["weight"] = table  # type: ignore[assignment]  # this call's weight
        self.served += 1
        return record

    def restore(self, module: nn.Module) -> UnitRecord | None:
        """The call returned: if it read rows, the parameter is the module's weight again, and the
        record it served is returned; else None."""
        standing = self._standing.pop(module, None)  # type: ignore[call-overload]
        if standing is None:
            return None
        module._parameters["weight"] = standing[0]
        return standing[1]

    def _union(self, ids: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
        """The sorted distinct ids of every rank's call."""
        device = unit.device  # NCCL moves device tensors only
        mine = torch.unique(ids.reshape(-1).to(device=device, dtype=torch.int64))
        world = collectives.group_size(self.group)
        counts = torch.empty(world, dtype=torch.int64, device=device)
        collectives.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.int64, device=device),
                               group=self.group, unit=unit.collective_id)
        sizes = counts.tolist()
        if max(sizes) == 0:  # no rank looks anything up: nothing to gather (the caller falls back)
            return mine
        return torch.unique(self._end_to_end(mine, sizes, unit))

    def _fetch(self, unit: FlatUnit, union: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """The union's rows, flat, from every rank's chunk."""
        sizes = piece_sizes(union, collectives.group_size(self.group), unit.layout.chunk_numel, width, rows)
        return self._end_to_end(rows_piece(unit.shard, unit.rank, union, width, rows).to(unit.dtype), sizes, unit)

    def _end_to_end(self, mine: torch.Tensor, sizes: list[int], unit: FlatUnit) -> torch.Tensor:
        """Every rank's ``mine`` (``sizes[r]`` elements on rank r) laid end to end in rank order:
        one all-gather, each rank's part padded to the largest."""
        most = max(sizes)
        padded = torch.zeros(most, dtype=mine.dtype, device=unit.device)
        padded[: mine.numel()] = mine
        everyone = torch.empty(len(sizes) * most, dtype=mine.dtype, device=unit.device)
        collectives.all_gather(everyone, padded, group=self.group, unit=unit.collective_id)
        return torch.cat([everyone[r * most : r * most + size] for r, size in enumerate(sizes)])


def _plain_gather(unit: FlatUnit) -> bool:
    """The unit's gather moves its shard's values as they are: no qwZ rounding, no hpZ secondary
    copy to keep, the shard beside the model (a cast of an fp32 shard rounds as the gather's does)."""
    return (unit.quantize_block is None and unit.secondary is None and unit.shard.device == unit.device
            and getattr(unit.shard, "zerorun_mapped_file", None) is None and unit.layout.world_size > 1)
