"""Note [supervision states]: the supervisor's phase and save request move only along their
legal transitions; anything else is an InternalError, and the supervisor's own decisions follow
the state (an exit during a stack dump is no root cause; a second stop is a bug)."""

from __future__ import annotations

import collections
import types

import pytest

from zerorun.errors import InternalError
from zerorun.launch.supervision_state import (PHASE_MOVES, SAVE_MOVES, Phase, SaveRequest, phase_tracker,
                                              save_tracker)


def test_every_phase_reaches_the_end_and_none_leaves_it():
    for start in Phase:
        seen, todo = {start}, [start]
        while todo:
            for nxt in PHASE_MOVES[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert Phase.ENDED in seen
    assert PHASE_MOVES[Phase.ENDED] == frozenset()
    assert set(PHASE_MOVES) == set(Phase) and set(SAVE_MOVES) == set(SaveRequest)


@pytest.mark.parametrize("path", [
    [Phase.STOPPING, Phase.ENDED],
    [Phase.DUMPING_HANG, Phase.STOPPING, Phase.ENDED],
    [Phase.DUMPING_STARTUP, Phase.ENDED],
    [Phase.ENDED],
])
def test_the_phases_the_supervisor_goes_through(path):
    tracker = phase_tracker()
    for phase in path:
        tracker.move(phase)
    assert tracker.state is path[-1]


@pytest.mark.parametrize("path", [
    [Phase.STOPPING, Phase.STOPPING],  # stopped twice
    [Phase.STOPPING, Phase.DUMPING_HANG],  # stacks asked of workers being killed
    [Phase.DUMPING_HANG, Phase.RUNNING],  # a dump ends in a stop, never back to running
    [Phase.DUMPING_HANG, Phase.DUMPING_STARTUP],
    [Phase.ENDED, Phase.STOPPING],  # nothing after the end
])
def test_an_illegal_phase_move_is_an_internal_error(path):
    tracker = phase_tracker()
    for phase in path[:-1]:
        tracker.move(phase)
    with pytest.raises(InternalError, match=f"phase {path[-2].name} -> {path[-1].name} is not a transition"):
        tracker.move(path[-1])


def test_a_save_request_is_deferred_at_most_once_and_passed_on_once():
    direct, deferred = save_tracker(), save_tracker()
    direct.move(SaveRequest.PASSED_ON)
    deferred.move(SaveRequest.DEFERRED)
    deferred.move(SaveRequest.PASSED_ON)
    for tracker in (direct, deferred):
        with pytest.raises(InternalError, match="save request PASSED_ON -> PASSED_ON"):
            tracker.move(SaveRequest.PASSED_ON)
    again = save_tracker()
    again.move(SaveRequest.DEFERRED)
    with pytest.raises(InternalError, match="save request DEFERRED -> DEFERRED"):
        again.move(SaveRequest.DEFERRED)


def _supervisor():
    from zerorun.launch.plan import Target, build_plan
    from zerorun.launch.supervisor import Supervisor

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir="/r",
                      token="t", master_port=29500, local_names={"localhost"})
    supervisor = Supervisor(plan, types.SimpleNamespace(on_worker_exit=lambda host, rank, rc: None))
    for channel in supervisor.channels:  # no agent runs here
        channel.stop = channel.dump_stacks = lambda: None
    # What run() sets up before it reads the first event.
    supervisor._failure, supervisor._exit_codes, supervisor._running = None, {}, {0, 1}
    supervisor._sink = types.SimpleNamespace(output=lambda *args: None)
    return supervisor


def test_an_exit_during_a_stack_dump_is_no_root_cause_and_the_blame_stops_the_job():
    supervisor = _supervisor()
    supervisor._begin_dump(Phase.DUMPING_HANG)
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": -6})  # SIGABRT of the dump
    assert supervisor._failure is None and supervisor._phase.state is Phase.DUMPING_HANG
    supervisor._tails[1] = collections.deque()
    supervisor._blame_hang()
    assert supervisor._phase.state is Phase.STOPPING and supervisor._failure.reason.startswith("hung")
    with pytest.raises(InternalError):
        supervisor._stop_all()  # a second stop is a bug, not a silent restart of the grace clock


def test_a_failure_while_running_stops_once_and_later_failures_are_consequences():
    supervisor = _supervisor()
    supervisor._handle("localhost", {"t": "exit", "rank": 1, "rc": 3})
    assert supervisor._phase.state is Phase.STOPPING and supervisor._failure.rank == 1
    supervisor._handle("localhost", {"t": "exit", "rank": 0, "rc": -15})  # our TERM
    assert supervisor._failure.rank == 1 and supervisor._phase.state is Phase.STOPPING
