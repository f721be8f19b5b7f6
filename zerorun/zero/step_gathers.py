"""Stage 3: the next forward's first gathers go out during the update.

    pytest tests/distributed/test_prefetch_budget.py tests/distributed/test_step_gathers.py

Note [next forward's gathers in the step]: a forward's first call gathers its units when it
starts, and only then does its window prefetch the next ones (Note [prefetch budget] in
gather_prefetch.py). So each step began with a gather that nothing computed beside: the 33.7M
GPT's tied embedding, 16.8 MB per rank (0.14 s at 1 Gbit/s; 4.2 MB and 0.11 s quantized at 300
Mbit/s), right after the update, which itself had waited for that same unit's reduce-scatter
(the embedding's gradient is the last one backward finishes). With a prefetch budget, the step
now issues those gathers itself, as soon as their units are current:
- the update takes the units the next forward gathers first (its first call's and the window
  that call prefetches, ``Prefetcher.next_forward_gathers``) first, in that order; each unit's
  update reads only its own gradient, state and the global clip coefficient, so the order
  changes no value;
- after each optimizer call the planned gathers whose units are now current are issued, in
  the forward's order, and the link moves them while the rest of the update, the script's own
  work between steps and the forward's first call run;
- the next forward's start hands them over: its calls find them in flight, as they would a
  prefetch of their own, and its window counts them.
Every rank plans from the same recorded order and unit states and updates in the same order, so
the gathers are paired. Without a budget (zerorun's default) nothing changes: the budget is the
user's consent to hold gathered units ahead of their use, and here that is from the update to
the forward (at most the first call's units and the budget; ``zerorun estimate`` adds them to
the step's workspace). On the CPU link bench the first gather's wait in forward fell by 20-45 ms
and the update grew by 15-30 ms (issuing and the ring's sends share the rank's core): the
bench's loop goes straight from ``step()`` into forward; a loop's own work between steps is
time the gathers have besides (docs/benchmarks.md, 2026-12-02).

Until the forward takes them, these units are in flight and their parameters keep the sharded
class (param_access.py): a read between steps is refused as before. Whatever wants the exact
values between steps settles them first (``settle``: the gather is waited and the unit
released): a ``GatheredParameters`` block, a full state dict, a checkpoint (``quiesce``), the
group's teardown (Note [settled before teardown] in comm/process_group.py). Under qwZ the
gathered copy is rounded, so handing it to those would be wrong, not only early.
"""

from __future__ import annotations

from zerorun.zero.comm.process_group import settle_before_teardown
from zerorun.zero.refresh_ahead import EagerRefresh
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.storage import ParamState


class StepGathers(EagerRefresh):
    """Note [next forward's gathers in the step]. Replicated (persistent) units are refreshed
    inside ``step()`` as without it (``EagerRefresh``)."""

    def __init__(self, gatherer) -> None:
        self._gatherer = gatherer
        self._planned: list[UnitRecord] = []  # the forward's first gathers not issued yet, in its order
        self._issued: list[UnitRecord] = []  # issued here, not yet handed to a forward
        gatherer.on_forward_start.append(self.hand_over)
        settle_before_teardown(self)  # Note [settled before teardown] in comm/process_group.py

    def update_order(self, records: list[UnitRecord]) -> list[UnitRecord]:
        """``records`` with the next forward's first units first, in the forward's order."""
        self._planned = self._gatherer.next_forward_gathers()
        planned = {r.index for r in self._planned}
        pending = {r.index for r in records}
        return [r for r in self._planned if r.index in pending] + [r for r in records if r.index not in planned]

    def updated(self) -> None:
        """Issue the planned gathers whose units are current, up to the first that is not."""
        while self._planned and (self._planned[0].unit.frozen or self._planned[0].update.updated):
            self._issue(self._planned.pop(0))

    def start(self, units, group) -> None:
        """The update is over: the replicated units are refreshed, the rest of the plan issued."""
        super().start(units, group)
        while self._planned:
            self._issue(self._planned.pop(0))

    def _issue(self, record: UnitRecord) -> None:
        if record.unit.state is ParamState.SHARDED:
            self._gatherer.prefetcher.gather_for_next_forward(record)
            self._issued.append(record)

    def hand_over(self) -> None:
        """The forward starts: what is in flight is its prefetch now."""
        self._planned = []
        self._issued = []

    def settle(self) -> None:
        """Wait for and release every unit gathered here that no forward has taken."""
        for record in self._issued:
            if record.unit.state is not ParamState.SHARDED and record.gathering.in_use == 0:
                record.unit.release()
        self._issued = []

    def in_flight(self) -> int:
        """Units gathered here that no forward has taken yet."""
        return sum(1 for r in self._issued if r.unit.state is ParamState.GATHERING)
