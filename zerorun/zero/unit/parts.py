"""A record's three per-pass parts, each written by one module through its own transitions.

    pytest tests/unit/test_record_parts.py

``GradientPart``  written by grad_reduce.py: the gradient buffers and one backward's bookkeeping.
``GatheringPart`` written by param_gather.py: stage 3's counts and keep plan for the unit.
``UpdatePart``    written by update.py: this window's norm piece and update.

Every other module reads them only (tests/unit/test_record_parts.py checks the calls). Each
change is a method that refuses a transition its owner never makes, with an ``InternalError``,
as ``FlatUnit`` guards its parameter state (unit/storage.py): a counter that would go negative,
a second update of a unit in one window, a gradient launched before it is complete.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from zerorun.errors import InternalError


class GradState(enum.Enum):
    """A unit's gradient within one backward.

    IDLE       nothing of this backward arrived (reduce-scatter: no bucket allocated).
    FILLING    some of the unit's gradients are in its buffer/bucket.
    READY      all arrived (or the end of backward says they never will); not yet issued.
    REDUCING   the collective is in flight (reduce-scatter: the bucket is alive until it ends).
    """

    IDLE = "idle"
    FILLING = "filling"
    READY = "ready"
    REDUCING = "reducing"


_GRAD_ALLOWED = {
    GradState.IDLE: {GradState.FILLING, GradState.READY},  # READY: nothing arrived on this rank
    GradState.FILLING: {GradState.READY},
    GradState.READY: {GradState.REDUCING},
    GradState.REDUCING: {GradState.IDLE},
}


@dataclass(eq=False)
class GradientPart:
    """The unit's gradient (grad_reduce.py). ``full``: stages 0-1's full-size buffer, each
    parameter's ``.grad`` a view into it; ``chunk``: this rank's piece of the summed gradient
    (a view of ``full``, or stages 2-3's fp32 accumulator), both only from a window's first
    backward to its update at stages 1-3 (Note [lazy gradient shards] in grad_reduce.py).
    ``bucket`` (with the pool ``buffer`` behind it and the ``written`` slots) lives from a
    backward's first arrival to its reduce-scatter's launch."""

    index: int
    full: torch.Tensor | None = None
    chunk: torch.Tensor | None = None
    clean: bool = True  # the chunk is still all-zero in this window: a reduce may write into it
    state: GradState = GradState.IDLE
    arrived: int = 0
    needed: int | None = None  # this backward's arrivals that complete the unit (set by the first)
    bucket: torch.Tensor | None = field(default=None, repr=False)
    buffer: torch.Tensor | None = field(default=None, repr=False)
    written: list[bool] | None = None

    def _move(self, new: GradState) -> None:
        if new not in _GRAD_ALLOWED[self.state]:
            raise InternalError(f"unit {self.index}: gradient state {self.state.name} -> {new.name} is not a transition")
        self.state = new

    def _expect_idle(self, doing: str) -> None:
        if self.state is not GradState.IDLE:
            raise InternalError(f"unit {self.index}: {doing} while the gradient is {self.state.name}")

    # -- the buffers, between backwards ----------------------------------------------------
    def hold_full(self, full: torch.Tensor, chunk: torch.Tensor) -> None:
        """Stages 0-1: the full buffer is made (at start, or lazily by the window's first arrival)."""
        if self.full is not None:
            raise InternalError(f"unit {self.index}: a second full gradient buffer")
        self.full, self.chunk = full, chunk

    def drop(self) -> None:
        """After the update (Note [lazy gradient shards]): no gradient until the next window."""
        self._expect_idle("gradient dropped")
        self.full = self.chunk = None

    def start_window(self, chunk: torch.Tensor | None) -> None:
        """Stages 2-3: a zeroed accumulator, or none until the first reduce (lazy)."""
        self._expect_idle("gradient window opened")
        self.chunk, self.clean = chunk, True

    # -- one backward ------------------------------------------------------------------------
    def hold_bucket(self, bucket: torch.Tensor, buffer: torch.Tensor | None, written: list[bool]) -> None:
        """A unit's first arrival of this backward takes its bucket (``buffer``: the pool's)."""
        if self.bucket is not None or self.state not in (GradState.IDLE, GradState.FILLING):
            raise InternalError(f"unit {self.index}: a second gradient bucket while {self.state.name}")
        self.bucket, self.buffer, self.written = bucket, buffer, written

    def mark_written(self, position: int) -> None:
        if self.written is None:
            raise InternalError(f"unit {self.index}: a gradient bucket without its written slots")
        self.written[position] = True

    def arrive(self, needed: int | None) -> bool:
        """One more of the unit's gradients arrived; True when it was the last. The first
        arrival of a backward fixes how many complete the unit (``needed``; Note [gradients per
        recomputation] in grad_reduce.py); None: the count never completes it (Note [expert
        gradients])."""
        if self.state is GradState.IDLE:
            self._move(GradState.FILLING)
            self.needed = needed
        elif self.state is not GradState.FILLING:
            raise InternalError(f"unit {self.index}: a gradient arrived while {self.state.name}")
        self.arrived += 1
        if self.needed is not None and self.arrived == self.needed:
            self._move(GradState.READY)
            return True
        return False

    def close_arrivals(self) -> None:
        """End of backward: what has not arrived never will (unused parameters)."""
        self._move(GradState.READY)

    def start_reduce(self, dtype: torch.dtype) -> torch.Tensor | None:
        """READY -> REDUCING. Returns the chunk when the collective may write straight into it
        (the window's first contribution, in the model dtype), else None."""
        self._move(GradState.REDUCING)
        into = self.chunk if self.chunk is not None and self.clean and self.chunk.dtype == dtype else None
        self.clean = False
        return into

    def hand_over_bucket(self) -> tuple[torch.Tensor | None, list[bool] | None, torch.Tensor | None]:
        """(bucket, written, buffer), now the collective's: the part holds none of them after."""
        if self.state is not GradState.REDUCING:
            raise InternalError(f"unit {self.index}: bucket handed over while {self.state.name}")
        handed = self.bucket, self.written, self.buffer
        self.bucket = self.written = self.buffer = None
        return handed

    def finish_reduce(self, out: torch.Tensor | None) -> None:
        """REDUCING -> IDLE; ``out`` (reduce-scatter's result) is added into the chunk, or
        becomes it (in fp32) for the window's first contribution."""
        if out is not None:
            if self.chunk is None:
                self.chunk = out if out.dtype == torch.float32 else out.float()
            elif out.data_ptr() != self.chunk.data_ptr():
                self.chunk.add_(out)
        self._move(GradState.IDLE)
        self.arrived = 0

    def nbytes(self) -> int:
        """The persistent gradient held (the full buffer, else the chunk accumulator)."""
        held = self.full if self.full is not None else self.chunk
        return 0 if held is None else held.numel() * held.element_size()


@dataclass(eq=False)
class GatheringPart:
    """Stage 3's counts and plan for the unit (param_gather.py)."""

    index: int
    in_use: int = 0  # module calls now running that need the unit gathered
    users: int = 0  # modules that gather it; more than one: Note [shared units]
    # module calls that gathered it in the forwards since the last backward (Note [gradients
    # per recomputation] in grad_reduce.py)
    calls: int = 0
    keep_after: frozenset[int] = frozenset()  # forward positions after which it stays gathered
    keep_for_backward: bool = False  # held from the end of forward into backward
    # a call of this forward read its rows instead of gathering it (Note [lookup rows first] in
    # zero/lookup_rows.py)
    rows_read: bool = False

    def add_user(self) -> None:
        self.users += 1

    def hold(self) -> None:
        self.in_use += 1

    def count_call(self) -> None:
        self.calls += 1

    def forget_calls(self) -> None:
        self.calls = 0
        self.rows_read = False

    def read_rows(self) -> None:
        self.rows_read = True

    def let_go(self) -> None:
        if self.in_use == 0:
            raise InternalError(f"unit {self.index}: let go by a call that did not hold it")
        self.in_use -= 1

    def plan(self, keep_after: frozenset[int], keep_for_backward: bool) -> None:
        """Note [kept gathered] in param_gather.py, from a newly recorded forward order."""
        self.keep_after, self.keep_for_backward = keep_after, keep_for_backward


@dataclass(eq=False)
class UpdatePart:
    """This window's update of the unit (update.py): its piece of the squared gradient norm,
    whether the update is done, and the work pending on the update thread."""

    index: int
    square: torch.Tensor | None = None
    updated: bool = False
    pending: Future | None = field(default=None, repr=False)
    # Note [gradient copies] in offload/grad_copy.py: a CUDA event on the training stream where
    # the gradient chunk became final at the boundary backward; None on the CPU or until then.
    final: object | None = field(default=None, repr=False)

    def mark_final(self, event) -> None:
        self.final = event

    def submit(self, pending: Future) -> None:
        if self.pending is not None:
            raise InternalError(f"unit {self.index}: a second early update submitted in one window")
        self.pending = pending

    def collect(self) -> None:
        """Wait for the pending work; re-raises what failed on the worker."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def set_square(self, square: torch.Tensor) -> None:
        if self.square is not None:
            raise InternalError(f"unit {self.index}: its norm piece computed twice in one window")
        self.square = square

    def mark_updated(self) -> None:
        if self.updated:
            raise InternalError(f"unit {self.index}: updated twice in one window")
        self.updated = True

    def close_window(self) -> None:
        """After the step: the next window starts with no piece and no update."""
        if self.pending is not None:
            raise InternalError(f"unit {self.index}: window closed with its early update pending")
        self.square, self.updated, self.final = None, False, None
