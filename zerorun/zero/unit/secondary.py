"""ZeRO++ hpZ: a second, host-local partition of each stage-3 unit (its slices pure, its copy small).

    pytest tests/unit/test_secondary.py

Note [secondary copy]: with ``zero.hpz_partition_size`` = h > 1 (DeepSpeed's
``zero_hpz_partition_size``), the ranks form groups of h consecutive ranks, each group on one
host (config/rules.check_hpz refuses any other layout before training). After a unit's gather
in forward (over the whole world, from the primary shards) completes, each rank copies its
slice of the gathered flat buffer for its place in its group, ``padded_numel / h`` elements at
``index * padded_numel / h`` (the layout pads to a multiple of the world size, so of h too).
In backward, and in a recomputation inside backward, the unit is gathered from those slices
over the group alone: backward's all-gathers never leave the host.

The copy holds exactly the values forward computed with: the gathered buffer itself, in the
gather dtype; with qwZ the dequantized values (so backward sees forward's rounding, not a second
one), and it is gathered exactly. It is valid from that forward gather until the shards change:
every optimizer step and checkpoint load (``ParamGatherer.release_all``), and any exact gather
(``FlatUnit.exact_gathers``: a ``GatheredParameters`` block may write the masters back). A
backward gather without a valid copy (a unit no forward gathered since the last step, or
gathered only when the copy could not be taken) gathers over the world instead. Every rank
makes the same decision: validity changes only at collectives and at calls every rank makes in
the same order, and the ranks check it anyway (Note [collective agreement] in comm/agreement.py).

The copy's memory is allocated at the first keep and kept for the run (as DeepSpeed keeps its
secondary tensor): ``padded_numel / h`` elements per partitioned unit, about Ψ/h per rank,
reported by ``memory_breakdown()`` as ``secondary_parameters`` and counted by ``zerorun
estimate`` (planner/memory.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def secondary_range(padded_numel: int, size: int, index: int) -> tuple[int, int]:
    """The elements [lo, hi) of a unit's padded flat buffer that member ``index`` of a group of
    ``size`` keeps."""
    if size < 1 or padded_numel % size or not 0 <= index < size:
        raise ValueError(f"a buffer of {padded_numel} elements has no slice {index} of {size}")
    step = padded_numel // size
    return index * step, (index + 1) * step


def partition_groups(world_size: int, size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(the groups of ``size`` consecutive ranks, the groups of ranks at the same place in them)."""
    if size < 1 or world_size % size:
        raise ValueError(f"{world_size} ranks do not split into groups of {size}")
    within = [tuple(range(start, start + size)) for start in range(0, world_size, size)]
    across = [tuple(range(index, world_size, size)) for index in range(size)]
    return within, across


class SecondaryCopy:
    """One unit's secondary slice and whether it holds the current values."""

    __slots__ = ("group", "size", "index", "_phase", "slice", "valid")

    def __init__(self, group, size: int, index: int, phase: Callable[[], str]):
        self.group, self.size, self.index = group, size, index
        # "forward", "backward" (a recomputation too) or "idle": the gatherer's pass (Note
        # [pass state] in gather_pass.py), the same on every rank at every gather.
        self._phase = phase
        self.slice: torch.Tensor | None = None
        self.valid = False

    def serves(self) -> torch.Tensor | None:
        """The slice a gather issued now gathers from over the group, or None (over the world)."""
        return self.slice if self.valid and self._phase() == "backward" else None

    def keeps(self) -> bool:
        """Whether a world gather issued now refreshes the copy (forward's gathers)."""
        return self._phase() == "forward"

    def keep(self, full: torch.Tensor) -> None:
        lo, hi = secondary_range(full.numel(), self.size, self.index)
        if self.slice is None:
            self.slice = torch.empty(hi - lo, dtype=full.dtype, device=full.device)
        self.slice.copy_(full[lo:hi])
        self.valid = True

    def invalidate(self) -> None:
        self.valid = False

    def nbytes(self) -> int:
        return 0 if self.slice is None else self.slice.numel() * self.slice.element_size()
