"""ZeRO++ hpZ: the engine's wiring of the secondary copies (Note [secondary copy] in
zero/unit/secondary.py) and of the hierarchical reduce-scatter (Note [hierarchical
reduce-scatter] in comm/quantized_collectives.py).

    zerorun --nproc 4 train.py   with zero: {stage: 3, hpz_partition_size: 2}
"""

from __future__ import annotations

from zerorun.zero.comm.process_group import partition_groups
from zerorun.zero.gather_pass import PassState
from zerorun.zero.param_gather import ParamGatherer
from zerorun.zero.unit.secondary import SecondaryCopy

_PHASES = {PassState.FORWARD: "forward", PassState.BACKWARD: "backward", PassState.RECOMPUTE: "backward",
           PassState.IDLE: "idle"}


def attach(gatherer: ParamGatherer, size: int, world_size: int, rank: int):
    """Give every partitioned unit its secondary copy over this rank's host group; returns
    (the host group, the group across hosts or None)."""
    within, across = partition_groups(world_size, size, rank)
    passes = gatherer.passes

    def phase() -> str:
        # Note [forward runs on into backward] (gather_prefetch.py): backward's gathers issued
        # at the end of forward are backward's; Note [next forward's gathers in the step]
        # (step_gathers.py): those the step issues are forward's.
        return gatherer.prefetcher.gathering_for or _PHASES[passes.state]

    for record in gatherer.records:
        if record.unit.partitioned:
            record.unit.secondary = SecondaryCopy(within, size, rank % size, phase)
    return within, across


def secondary_nbytes(records) -> int:
    """Bytes of the secondary copies allocated now (``memory_breakdown``'s own line)."""
    return sum(r.unit.secondary.nbytes() for r in records if r.unit.secondary is not None)
