"""When the device began and finished each collective on a communication stream, read from its
timing events without ever blocking (Note [event ledger]).

    pytest tests/unit/test_comm_stream.py -k ledger

Note [event ledger]: a collective on the communication stream (Note [streams] in collectives.py)
is bracketed by two timing events recorded on that stream, ``start`` just before it and ``end``
just after. The host call returns long before the device reaches either, so what the device did
is known only later, and reading it must not hold training up: ``elapsed_time`` on an event not
yet reached raises, and ``synchronize`` would stall the host until the device caught up. So the
ledger keeps the collectives not yet finished, in issue order, and ``poll`` only asks ``query()``
(which never blocks). It reports, in order, each collective the device has *begun* (its start
event completed: it is inside the collective, waiting for peers or moving bytes) and each it has
*finished*, with its transfer time ``start.elapsed_time(end)``. One stream runs its collectives
one after another, so on each lane (a GPU's stream) a collective not yet begun or finished hides
every later one: the poll stops there and asks nothing more of that lane.

Who polls: the issuing thread at every issue and wait on the stream, and the telemetry recorder
at each step record and each sample (its own thread), so a finished collective is reported
within one sampling interval, and a stuck one stays "begun, not finished" where the hang view
can see it. The ledger itself is pure bookkeeping over objects with ``query()`` and
``elapsed_time(end)`` (milliseconds, as ``torch.cuda.Event``), so it is tested on the CPU with
fake events; ``guard(lane)`` is entered around a lane's queries (CUDA: make that GPU current, so
a thread whose current device is GPU 0 does not create a context there).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol


class TimingEvent(Protocol):
    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


@dataclass
class _Entry:
    seq: int
    op: str
    nbytes: int
    start: Any
    end: Any
    lane: int
    begun: bool = field(default=False)


@dataclass(frozen=True)
class Progress:
    """What one poll learnt about one collective: it ``begun``, or it finished (``seconds`` set)."""

    seq: int
    op: str
    nbytes: int
    seconds: float | None = None  # None: it has begun; a number: it finished, this long on the device

    @property
    def finished(self) -> bool:
        return self.seconds is not None


class EventLedger:
    """The collectives issued on communication streams and not yet seen finished (thread-safe)."""

    def __init__(self, guard: Callable[[int], AbstractContextManager] | None = None):
        self._guard = guard or (lambda lane: nullcontext())
        self._pending: list[_Entry] = []
        self._lock = threading.Lock()

    def add(self, seq: int, op: str, nbytes: int, start: TimingEvent, end: TimingEvent, lane: int = 0) -> None:
        with self._lock:
            self._pending.append(_Entry(seq, op, nbytes, start, end, lane))

    def pending(self) -> int:
        """Collectives issued and not yet seen finished: what is in flight, counted by events."""
        with self._lock:
            return len(self._pending)

    def poll(self) -> list[Progress]:
        """Everything learnt since the last poll, in issue order per lane; never blocks."""
        with self._lock:
            if not self._pending:
                return []
            learnt: list[Progress] = []
            stopped: set[int] = set()  # lanes whose oldest collective is still running
            kept: list[_Entry] = []
            for lane in dict.fromkeys(entry.lane for entry in self._pending):
                with self._guard(lane):
                    for entry in self._pending:
                        if entry.lane != lane:
                            continue
                        if lane in stopped:
                            kept.append(entry)
                            continue
                        if not entry.begun and entry.start.query():
                            entry.begun = True
                            learnt.append(Progress(entry.seq, entry.op, entry.nbytes))
                        if entry.begun and entry.end.query():
                            seconds = max(0.0, entry.start.elapsed_time(entry.end) / 1000.0)
                            learnt.append(Progress(entry.seq, entry.op, entry.nbytes, seconds))
                        else:
                            stopped.add(lane)
                            kept.append(entry)
            kept.sort(key=lambda entry: entry.seq)
            self._pending = kept
            return learnt
