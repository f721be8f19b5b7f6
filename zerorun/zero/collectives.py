"""Every collective zerorun issues goes through this module.

Each function takes its process group explicitly, and reports to the registered observers
when it starts (so a hang is visible while it is blocked) and when it finishes (op, bytes,
seconds). Telemetry (zerorun/telemetry) is one such observer; tests can add their own.

Observer contract (duck-typed):
    collective_started(seq: int, op: str, nbytes: int) -> None
    collective_finished(seq: int, op: str, nbytes: int, seconds: float) -> None
``seq`` counts collectives issued by this process, from 0, in program order: the same
number names the same collective on every rank of a correct SPMD program.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Protocol


class CollectiveObserver(Protocol):
    def collective_started(self, seq: int, op: str, nbytes: int) -> None: ...

    def collective_finished(self, seq: int, op: str, nbytes: int, seconds: float) -> None: ...


_observers: list[Any] = []
_observers_lock = threading.Lock()
_sequence = itertools.count()


def add_observer(observer: CollectiveObserver) -> None:
    with _observers_lock:
        _observers.append(observer)


def remove_observer(observer: CollectiveObserver) -> None:
    with _observers_lock:
        if observer in _observers:
            _observers.remove(observer)


def next_sequence() -> int:
    return next(_sequence)


def notify_started(seq: int, op: str, nbytes: int) -> None:
    for observer in list(_observers):
        observer.collective_started(seq, op, nbytes)


def notify_finished(seq: int, op: str, nbytes: int, seconds: float) -> None:
    for observer in list(_observers):
        observer.collective_finished(seq, op, nbytes, seconds)
