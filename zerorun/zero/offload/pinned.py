"""Pinned host memory for one placement, carved from a few large blocks (Note [pinned arena]).

    pytest tests/unit/test_device_contract.py -k arena

Note [pinned arena]: torch's pinned-memory allocator rounds every request up to a power of two
and keeps the rounded block, so pinning each unit's master, host shard and buffer on its own
costs up to twice their size in host memory, and nothing counts the excess. A placement
instead takes its pinned tensors from its own arena: blocks whose sizes are powers of two
(nothing lost to rounding), each a quarter of what the arena has handed out so far (at least
``FIRST_BLOCK``, at most ``LARGEST_BLOCK`` bytes), carved into aligned pieces in order. A
request larger than that gets a block of its own rounded size, whose tail later requests use.
Simulated over unit sizes that are not powers of two (700 KiB to 40 MiB, 50 to 2,000 units)
the arena pins 1.04-1.30x what it hands out where pinning each piece costs 1.33-1.60x; for
units of 100 MiB and more both cost the same (each such unit is its own rounded block). What is
pinned but not handed out (the tail of each block left when the next request did not fit)
is ``slack()``, counted with the placement's host bytes (``memory_breakdown``). Pieces are
never returned one by one: a placement's masters, shards and buffers live as long as it does.

Only a worker on CUDA pins (pinned memory exists only with CUDA, and a CPU worker must never
touch it): elsewhere ``empty`` is plain ``torch.empty`` and the arena holds nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

ALIGNMENT = 512  # bytes: every piece starts aligned for DMA and for any dtype's view
FIRST_BLOCK = 4 << 20
LARGEST_BLOCK = 256 << 20


def _power_of_two_at_least(nbytes: int) -> int:
    return 1 << max(0, (nbytes - 1).bit_length())


def carve(used: int, capacity: int, nbytes: int, handed_out: int) -> tuple[int, int]:
    """Where a piece of ``nbytes`` goes (pure): (offset, new block size), the new block size 0
    when it fits in the current block (``used`` of ``capacity`` bytes taken), offset 0 in a
    new block otherwise. A new block is a quarter of what was handed out so far, rounded down
    to a power of two within FIRST_BLOCK..LARGEST_BLOCK (so the last block's unused tail stays
    a fraction of the whole), or the request's own rounded size when that is larger."""
    start = -(-used // ALIGNMENT) * ALIGNMENT
    if capacity and start + nbytes <= capacity:
        return start, 0
    quarter = handed_out // 4
    grown = min(LARGEST_BLOCK, max(FIRST_BLOCK, 1 << (quarter.bit_length() - 1) if quarter else 0))
    return 0, max(grown, _power_of_two_at_least(nbytes))


def reserved_for(sizes: Iterable[int]) -> int:
    """Pinned bytes an arena reserves for pieces of ``sizes`` bytes asked for in that order
    (pure): the blocks ``carve`` makes, as ``HostArena.empty`` takes them. The planner's
    host rows count the arena with it (``pinned_host_bytes`` in planner/memory.py)."""
    used = capacity = reserved = handed_out = 0
    for nbytes in sizes:
        offset, new_block = carve(used, capacity, nbytes, handed_out)
        if new_block:
            capacity, reserved = new_block, reserved + new_block
        used, handed_out = offset + nbytes, handed_out + nbytes
    return reserved


class HostArena:
    """Pinned host tensors for one placement, on a CUDA worker; plain ones elsewhere."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._block: torch.Tensor | None = None
        self._used = 0
        self.reserved = 0  # pinned bytes held
        self.handed_out = 0  # bytes of the pieces handed out
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin:
            return torch.empty(numel, dtype=dtype)
        nbytes = numel * dtype.itemsize
        with self._lock:
            capacity = self._block.numel() if self._block is not None else 0
            offset, new_block = carve(self._used, capacity, nbytes, self.handed_out)
            if new_block:
                self._block = torch.empty(new_block, dtype=torch.uint8, pin_memory=True)
                self.reserved += new_block
            if self._block is None:
                raise RuntimeError("the pinned arena carved a piece without a block")
            self._used = offset + nbytes
            self.handed_out += nbytes
            return self._block[offset:offset + nbytes].view(dtype)

    def slack(self) -> int:
        """Pinned bytes not handed out: counted with the placement's host bytes."""
        return self.reserved - self.handed_out


class HostMemory:
    """A placement's host memory: pinned pieces from its own arena when the model is on CUDA
    (made at the first such request), plain host tensors otherwise. ``pin`` is the config's
    ``pin_memory``; a CPU worker never pins whatever it says (pinned memory exists only with CUDA)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.arena: HostArena | None = None

    def empty(self, numel: int, dtype: torch.dtype, model_device: torch.device) -> torch.Tensor:
        if not (self.pin and model_device.type == "cuda"):
            return torch.empty(numel, dtype=dtype)
        if self.arena is None:
            self.arena = HostArena(pin=True)
        return self.arena.empty(numel, dtype)

    def slack(self) -> int:
        """Pinned bytes held but not handed out (Note [pinned arena]): host memory too."""
        return self.arena.slack() if self.arena is not None else 0
