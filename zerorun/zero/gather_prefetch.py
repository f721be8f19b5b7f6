"""Stage 3: the gathers the gatherer (param_gather.py) issues ahead of their use, along the
recorded orders of forward and backward, and what the host pool hears that a pass will still
gather (Note [pools follow backward] in unit/storage.py).

    pytest tests/distributed/test_prefetch_budget.py tests/unit/test_host_pools.py tests/distributed/test_hpz.py

The prefetcher reads the records the gatherer plans (``records_of``: a module's units, the
gatherer's plan as it is now) and starts their gathers; it changes no record's part, so the
gatherer stays the one writer of each record's gathering part (unit/parts.py).

Note [execution order]: the prefetch order is recorded from the first forward and re-recorded
whenever the order changes, so a wrong guess costs one wasted gather, never correctness.
Forward prefetches the module that starts next. Backward's hooks fire in the reverse of the
order in which modules *finished* their forward: a block's output hook fires before its MLP's,
although the block's own parameters (attention, norms) are read only after the MLP's backward.
So backward follows that reversed finishing order, and prefetches BACKWARD_PREFETCH modules
ahead: the block's hook then finds its units already gathered, and its MLP's (the next hook,
fired at once) too. With one ahead, every block's unit was gathered synchronously in backward
(a 4 MB all-gather per block of the 33.7M GPT, 2-3% of its step). Modules whose backward reads
no parameters (an Embedding) are left out, so a tied embedding is not gathered again at the
very end of backward.

Note [prefetch budget]: that fixed lookahead (one module in forward, BACKWARD_PREFETCH in
backward) is the least prefetched. ``prefetch_bucket_size`` (DeepSpeed's
stage3_prefetch_bucket_size, in elements) lets it reach further along the recorded order: more
modules while the elements of their units (gathered, in flight or not yet asked for) add up to
at most that many, so no more than that is held ahead of its use (0, zerorun's default, adds
none: the least memory, as FSDP2's one-module lookahead). Between hosts a deeper window
keeps the link busy through modules whose compute is shorter than their gather. No gather is
issued early past ``max_live_parameters`` (DeepSpeed's stage3_max_live_parameters) elements
gathered or in flight at once; a module's own gather when it runs is never held back. Every
rank computes the same window from the same order and unit states, so the collectives stay
paired. The units held from the end of forward into backward anyway (the last call's: Note
[kept gathered] in param_gather.py) are not counted: prefetching decides nothing about them.

Note [forward runs on into backward]: backward's first modules are forward's last ones, and
the recorded backward is known from the second step on. Between hosts, the link used to stand
idle at the turn: forward's last gather had landed, the output head, the loss and the first
blocks' backward computed, and backward's windows had nothing left to issue until its first
gradients were reduced (0.45-0.75 s of a 6 s step of the 33.7M GPT at 300 Mbit/s with
``prefetch_bucket_size`` 6e6; traces in docs/benchmarks.md). So, in a forward that follows its
recorded order with autograd on:
- the window runs past forward's last module into the recorded backward, within the same
  budget. A unit it reaches there is not released after its forward call nor at the end of
  forward (``held_for_backward``): releasing the last blocks only to gather them again at
  backward's start moved their bytes twice;
- at forward's last call, backward gets its own window: the gathers of the next
  ``turn_prefetch_bucket_size`` elements of backward's modules past those held (the budget
  again when unset) are issued then, and the link moves them while the head and the loss
  compute. So at the turn up to the budget plus that many elements are held ahead of their
  use (zerorun estimate counts it), never past ``max_live_parameters``. The two are apart
  because the turn is set by the model, not the link: the 33.7M GPT's tied output head is a
  quarter of its compute, and at 300 Mbit/s one budget's gathers (12e6) had moved 0.1-0.45 s
  before backward's first reduce-scatter; 18e6 at the turn (backward's every remaining gather)
  kept the link busy through it, 4% off the step (docs/benchmarks.md).
These gathers are backward's: with hpZ they read the host's secondary copy. With the default
budget (0) forward's window stops at forward's last module, as before: nothing more is held.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerorun.zero.gather_plan import gathers_still_wanted, prefetch_window
from zerorun.zero.unit.plan import BACKWARD_PREFETCH
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import GatherPool, ParamState


class Prefetcher:
    """The prefetch windows of one gatherer (Note [execution order], Note [prefetch budget])."""

    def __init__(self, records_of: Callable[[nn.Module], list[UnitRecord]], group, pool: GatherPool | None,
                 *, prefetch_elements: int = 0, turn_elements: int | None = None,
                 max_live_elements: int | None = None):
        self._records_of = records_of
        self.group = group
        self.pool = pool
        # Note [prefetch budget]: how far past the fixed lookahead prefetch may reach, and the
        # elements of partitioned units gathered or in flight now (kept by a state listener).
        self.prefetch_elements = prefetch_elements
        # Note [forward runs on into backward]: backward's own window at the turn.
        self.turn_elements = prefetch_elements if turn_elements is None else turn_elements
        self.max_live_elements = max_live_elements
        self.live_elements = 0
        self._live_units: set[int] = set()
        # Note [forward runs on into backward]: the recorded forward followed by the recorded
        # backward (joined when either is recorded, not at every module call), and the units the
        # latest forward window reached in backward's part.
        self._forward_order: list[nn.Module] = []
        self._through_backward: list[nn.Module] = []
        self.held_for_backward: frozenset[int] = frozenset()
        # The pass a gather issued now is for, when not the pass running: "backward" while forward
        # issues backward's (Note [forward runs on into backward]), "forward" while the step
        # issues forward's (Note [next forward's gathers in the step] in step_gathers.py).
        self.gathering_for: str | None = None
        # Note [execution order]: modules in the order their backward hooks fire, and where
        # each first appears in it.
        self.backward_order: list[nn.Module] = []
        self._backward_position: dict[nn.Module, int] = {}
        # Note [pools follow backward] (unit/storage.py): gathers of each byte size from each
        # position of the recorded forward and backward on.
        self._forward_wanted_from: list[dict[int, int]] = [{}]
        self._wanted_from: list[dict[int, int]] = [{}]

    def count_live(self, unit) -> None:
        """Note [prefetch budget]: a unit's full copy starts to exist when its gather is issued
        and stops when it is released (SHARDED -> GATHERING ... -> SHARDED)."""
        live = unit.state is not ParamState.SHARDED
        if live != (unit.index in self._live_units):
            self._live_units.symmetric_difference_update({unit.index})
            self.live_elements += unit.layout.numel if live else -unit.layout.numel

    def _window(self, order: list[nn.Module], start: int, minimum: int, backward_from: int | None = None,
                budget: int | None = None) -> int:
        """Issue the gathers of the window of ``order`` from ``start`` on (Note [prefetch budget]),
        within ``budget`` elements (None: ``prefetch_elements``); returns the position just past
        it. Positions from ``backward_from`` on are backward's (Note [forward runs on into
        backward]): their gathers are issued as backward's."""
        end = self._span(order, start, minimum, budget)
        for position in range(start, end):
            # hpZ: a gather for backward reads the host's secondary copy (Note [secondary copy]).
            self.gathering_for = "backward" if backward_from is not None and position >= backward_from else None
            for record in self._records_of(order[position]):
                record.unit.start_gather(self.group)
        self.gathering_for = None
        return end

    def _span(self, order: list[nn.Module], start: int, minimum: int, budget: int | None = None,
              live_besides: int = 0) -> int:
        """The position just past the window of ``order`` from ``start`` on (Note [prefetch
        budget]); ``live_besides``: elements about to be gathered that ``live_elements`` does not
        count yet."""
        budget = self.prefetch_elements if budget is None else budget
        ahead: list[int] = []  # per next call, the elements of its units, each unit counted once
        counted: dict[int, UnitRecord] = {}
        for module in order[start:]:
            if len(ahead) >= minimum and (budget <= 0 or sum(ahead) > budget):
                break
            records = [r for r in self._records_of(module) if r.unit.partitioned and r.index not in counted]
            counted.update((r.index, r) for r in records)
            ahead.append(sum(r.unit.layout.numel for r in records if not _held_anyway(r)))
        # What the window holds already (gathered or in flight) is live already; a unit a running
        # call holds is live for that call (Note [forward runs on into backward]: the window may
        # reach it again in backward's order), so it stays counted in ``live_elements``.
        held = sum(r.unit.layout.numel for r in counted.values()
                   if r.unit.state is not ParamState.SHARDED and r.gathering.in_use == 0 and not _held_anyway(r))
        room = (self.max_live_elements - self.live_elements - live_besides + held
                if self.max_live_elements is not None else sum(ahead))
        return start + prefetch_window(ahead, minimum, budget, room)

    def gather_for_next_forward(self, record: UnitRecord) -> None:
        """Note [next forward's gathers in the step]: a gather the step issues is the next
        forward's (with hpZ it refreshes the host's secondary copy, as forward's own do)."""
        self.gathering_for = "forward"
        try:
            record.unit.start_gather(self.group)
        finally:
            self.gathering_for = None

    def next_forward_gathers(self, stop_before: Callable[[nn.Module], bool] | None = None) -> list[UnitRecord]:
        """Note [next forward's gathers in the step]: the partitioned units the next forward's
        first call gathers and the window it prefetches then, in the order it issues them, up to
        the first call ``stop_before`` names (one that reads rows instead: Note [lookup rows
        first] in lookup_rows.py); none without a budget or a recorded forward."""
        order = self._forward_order
        if self.prefetch_elements <= 0 or not order:
            return []
        first = [r for r in self._records_of(order[0]) if r.unit.partitioned]
        besides = sum(r.unit.layout.numel for r in first if r.unit.state is ParamState.SHARDED)
        end = self._span(order, 1, 1, live_besides=besides)
        seen: dict[int, UnitRecord] = {}
        for module in order[:end]:
            if stop_before is not None and stop_before(module):
                break
            for record in self._records_of(module):
                if record.unit.partitioned:
                    seen.setdefault(record.index, record)
        return list(seen.values())

    def forward(self, order: list[nn.Module], module: nn.Module, on_order: bool) -> None:
        """Issue the async gather of the module expected to run after ``module`` in forward, and
        tell the pool what the rest of forward will still gather (Note [pools follow backward]).
        ``order``: the recorded forward; ``on_order``: whether this forward has followed it so far."""
        position = order.index(module) if module in order else -1
        # Note [forward runs on into backward]: the recorded backward continues the order.
        runs_on = (self.prefetch_elements > 0 and on_order and position >= 0 and bool(self.backward_order)
                   and order is self._forward_order and torch.is_grad_enabled())
        sequence = self._through_backward if runs_on else order
        past = self._window(sequence, position + 1, 1, len(order)) if position >= 0 else 0
        if runs_on and position == len(order) - 1:  # forward's last call: backward's own window
            past = self._window(sequence, past, 0, len(order), self.turn_elements)
        # Only a window past forward's end reaches backward's part (never without a budget).
        self.held_for_backward = frozenset(
            r.index for m in sequence[len(order):past] for r in self._records_of(m) if r.unit.partitioned
        ) if past > len(order) else frozenset()
        if self.pool is not None:
            on_order = on_order and position >= 0
            self.pool.expect(self._forward_wanted_from[min(max(past, position + 2), len(order))] if on_order else None)

    def _partitioned_sizes(self, modules: list[nn.Module]) -> list[list[int]]:
        """Per module, the byte sizes of the partitioned units its call gathers."""
        return [[r.unit.full_nbytes for r in self._records_of(m) if r.unit.partitioned] for m in modules]

    def follow_forward(self, order: list[nn.Module]) -> None:
        """A newly recorded forward order: what each of its positions on still gathers."""
        self._forward_wanted_from = gathers_still_wanted(self._partitioned_sizes(order))
        self._forward_order = order
        self._through_backward = order + self.backward_order

    def follow_backward(self, order: list[nn.Module]) -> None:
        """Prefetch the next backwards along ``order`` (Note [execution order])."""
        self.backward_order = order
        self._backward_position = {}
        for position, m in enumerate(order):
            self._backward_position.setdefault(m, position)
        self._wanted_from = gathers_still_wanted(self._partitioned_sizes(order))
        self._through_backward = self._forward_order + order

    def backward(self, module: nn.Module) -> None:
        """Issue the gathers of the modules whose backward follows ``module``'s (BACKWARD_PREFETCH
        of them, more within the budget: Note [prefetch budget]),
        and tell the pool what the rest of backward will still gather (Note [pools follow backward])."""
        position = self._backward_position.get(module)
        if position is None:
            return
        past = self._window(self.backward_order, position + 1, BACKWARD_PREFETCH)
        if self.pool is not None:
            self.pool.expect(self._wanted_from[min(max(past, position + 1 + BACKWARD_PREFETCH), len(self._wanted_from) - 1)])


def _held_anyway(record: UnitRecord) -> bool:
    """Held from the end of forward into backward whatever is prefetched (Note [prefetch
    budget]): a unit of forward's last call that a call of this forward has gathered already (a
    tied embedding, from forward's first call on), or whose rows it read instead (Note [lookup
    rows first] in lookup_rows.py: the table is gathered when the window reaches the head, and
    the window reaches as far past it as when the lookup gathered it). Before that, gathering it
    is a prefetch."""
    gathering = record.gathering
    return (gathering.keep_for_backward and gathering.calls > 0
            and (record.unit.state is not ParamState.SHARDED or gathering.rows_read))
