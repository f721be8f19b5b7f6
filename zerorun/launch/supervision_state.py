"""Where the supervisor is while it runs a job, as two enums with their legal transitions (pure).

Note [supervision states]: the supervisor's loop decides what an event means from where the job
is: a worker's non-zero exit is the root cause while the job runs, and a consequence once every
host was told to stop or to print its stacks; a Ctrl-C stops the workers unless they are already
stopping or dumping (the dump ends them anyway). That place was once two optional timestamps
(``_dumping_since``, ``_stopping_since``) plus ``_starting_at_dump is not None`` for why stacks
were asked, and a save request was two booleans (``_checkpoint_deferred``, ``_checkpoint_asked``).
Here each is one state, moved only by ``move``, which refuses a transition the supervisor never
makes with an InternalError (torchelastic's ``WorkerState`` is the model of the idea).

What stays plain data on the supervisor is independent of these: the time a state began, the
signals written by the signal handlers (a handler only stores a number; the loop moves the
states), the once-only guards of the two questions asked of Slurm, and the hang warning's time
(a quiet spell inside RUNNING, forgotten when progress resumes).
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from zerorun.errors import InternalError


class Phase(enum.Enum):
    """The job as the supervisor drives it; the docstring of each says what the channels are doing."""

    RUNNING = "workers run; the first non-zero exit is the root cause"
    DUMPING_HANG = "no rank made progress for the hang timeout: every rank asked for its stacks (SIGABRT)"
    DUMPING_STARTUP = "a rank had not joined after the start-up timeout: every rank asked for its stacks"
    STOPPING = "every host told to stop its workers (TERM, grace, KILL by process group)"
    ENDED = "the loop is over: channels finished, exits drained, teardown checked"

    @property
    def dumping(self) -> bool:
        return self in (Phase.DUMPING_HANG, Phase.DUMPING_STARTUP)


# A dump ends in STOPPING (its blame is a failure, or a host is lost meanwhile) or, when every
# rank already ended of it, the blame comes after the loop and still stops the hosts.
PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.DUMPING_HANG, Phase.DUMPING_STARTUP, Phase.STOPPING, Phase.ENDED}),
    Phase.DUMPING_HANG: frozenset({Phase.STOPPING, Phase.ENDED}),
    Phase.DUMPING_STARTUP: frozenset({Phase.STOPPING, Phase.ENDED}),
    Phase.STOPPING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


class SaveRequest(enum.Enum):
    """A checkpoint.on_signal request (SIGUSR1/2, a preemption's SIGTERM) on its way to the workers
    (Note [save request waits for training] in supervisor.py)."""

    NONE = "no save asked for (or asked, and not yet seen by the loop)"
    DEFERRED = "asked for before every rank made a step; said so once, passed on when they have"
    PASSED_ON = "every host told its workers to save at their next step and stop"


SAVE_MOVES: dict[SaveRequest, frozenset[SaveRequest]] = {
    SaveRequest.NONE: frozenset({SaveRequest.DEFERRED, SaveRequest.PASSED_ON}),
    SaveRequest.DEFERRED: frozenset({SaveRequest.PASSED_ON}),
    SaveRequest.PASSED_ON: frozenset(),
}

S = TypeVar("S", bound=enum.Enum)


class Tracked(Generic[S]):
    """One state of an enum and its legal moves; ``move`` to anything else is a zerorun bug."""

    def __init__(self, what: str, start: S, moves: dict[S, frozenset[S]]):
        self.what = what
        self.state = start
        self._moves = moves

    def move(self, new: S) -> None:
        if new not in self._moves[self.state]:
            raise InternalError(f"supervisor {self.what} {self.state.name} -> {new.name} is not a transition")
        self.state = new


def phase_tracker() -> Tracked[Phase]:
    return Tracked("phase", Phase.RUNNING, PHASE_MOVES)


def save_tracker() -> Tracked[SaveRequest]:
    return Tracked("save request", SaveRequest.NONE, SAVE_MOVES)
