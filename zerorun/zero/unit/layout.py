"""Pure shard math: how a group of parameters is laid out flat and split across ranks.

No torch, no process group: plain integers in, plain data out, so it is unit-tested alone
(tests/unit/test_sharding.py) and checkpoints can re-partition by parameter name later.

Vocabulary
    unit    a list of whole parameters laid end to end in one flat buffer (a communication
            bucket in stages 0-2, one module's parameters in stage 3).
    chunk   the slice of a unit that one rank owns. Every unit is padded at its end so its
            size divides by the world size: then one reduce-scatter / all-gather over the
            unit gives each rank exactly its chunk (Note [uniform chunks]).
    shard   the concatenation of a rank's chunks of every unit of one optimizer param group;
            ``Segment`` records which parameter elements each shard position holds.

Note [uniform chunks]: DeepSpeed stages 1/2 split one big flat buffer into one contiguous
range per rank, which makes a bucket straddle owners and forces per-owner reduces. Padding
each unit instead costs at most ``world_size * alignment - 1`` elements per unit and keeps every
collective a single uniform call.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the layout sees it: its name and element count."""

    name: str
    numel: int


@dataclass(frozen=True)
class Segment:
    """``length`` elements of parameter ``name`` from ``param_offset`` sit at ``shard_offset``."""

    name: str
    param_offset: int
    shard_offset: int
    length: int


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class UnitLayout:
    """Flat layout of one unit over ``world_size`` ranks; chunks are ``alignment``-multiples."""

    params: tuple[ParamSpec, ...]
    world_size: int
    alignment: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.alignment < 1:
            raise ValueError("world_size and alignment must be >= 1")
        if any(p.numel < 0 for p in self.params):
            raise ValueError("parameter sizes must be >= 0")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter inside the unit's flat buffer."""
        starts, position = [], 0
        for spec in self.params:
            starts.append(position)
            position += spec.numel
        return tuple(starts)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def chunk_numel(self) -> int:
        return round_up(max(self.numel, 1), self.world_size * self.alignment) // self.world_size

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.world_size

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of ``rank``'s chunk inside the unit's flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return rank * self.chunk_numel, (rank + 1) * self.chunk_numel

    def segments(self, rank: int, shard_base: int = 0) -> list[Segment]:
        """Parameter pieces inside ``rank``'s chunk; shard offsets start at ``shard_base``."""
        start, end = self.chunk_range(rank)
        pieces = []
        for spec, offset in zip(self.params, self.offsets, strict=True):
            lo, hi = max(start, offset), min(end, offset + spec.numel)
            if lo < hi:
                pieces.append(Segment(spec.name, lo - offset, shard_base + lo - start, hi - lo))
        return pieces


def pack_buckets(specs: Iterable[ParamSpec], bucket_numel: int) -> list[tuple[ParamSpec, ...]]:
    """Greedy, order-preserving packing; a parameter larger than a bucket gets its own."""
    buckets: list[list[ParamSpec]] = []
    filled = 0
    for spec in specs:
        if not buckets or (filled + spec.numel > bucket_numel and filled > 0):
            buckets.append([])
            filled = 0
        buckets[-1].append(spec)
        filled += spec.numel
    return [tuple(b) for b in buckets]
