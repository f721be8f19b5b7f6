"""pytest tests/unit/test_comm_stream.py — collectives on a GPU's communication stream, with CUDA mocked.

Note [streams] in zerorun/zero/comm/collectives.py: NCCL collectives of CUDA tensors run on a
communication stream after an event of the compute stream, the consumer waits for their end
event, their buffers live until that wait, and their seconds come from their timing events, read
without blocking (Note [event ledger]). No GPU here: streams and events are fakes that log what
was asked of them; the cuda tier (tests/cuda/test_cuda_comm_stream.py) runs the real thing.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from zerorun.zero import grad_reduce
from zerorun.zero.comm import collectives, comm_stream
from zerorun.zero.comm.event_ledger import EventLedger, Progress


class FakeEvent:
    """A CUDA event the test completes by hand; ``at`` is the device time it was reached (s)."""

    def __init__(self, name="event", log=None, enable_timing=False):
        self.name, self.log, self.timing = name, log, enable_timing
        self.done, self.at = False, 0.0

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time of an event not reached raises on CUDA"
        return (end.at - self.at) * 1000.0

    def synchronize(self):
        raise AssertionError("the host must never block on an event")

    def record(self, stream=None):
        if self.log is not None:
            self.log.append(f"{self.name} recorded on {stream.name}")

    def reach(self, at):
        self.done, self.at = True, at


def pair(start_at=None, end_at=None):
    start, end = FakeEvent("start"), FakeEvent("end")
    if start_at is not None:
        start.reach(start_at)
    if end_at is not None:
        end.reach(end_at)
    return start, end


# -- the ledger (pure) ----------------------------------------------------------------------
def test_ledger_reports_begun_then_finished_in_issue_order_and_never_blocks():
    ledger = EventLedger()
    first, second, third = pair(), pair(), pair()
    ledger.add(0, "all_gather", 100, *first)
    ledger.add(1, "reduce_scatter", 200, *second)
    ledger.add(2, "all_gather", 300, *third)
    assert ledger.poll() == [] and ledger.pending() == 3  # nothing reached: nothing known
    first[0].reach(1.0)
    third[0].reach(1.0), third[1].reach(1.5)  # out of order: the stream cannot, the ledger must not believe it
    assert ledger.poll() == [Progress(0, "all_gather", 100)]  # #0 has begun (the GPU is inside it)
    assert ledger.poll() == []  # said once
    first[1].reach(1.25)
    second[0].reach(1.25)
    assert ledger.poll() == [Progress(0, "all_gather", 100, 0.25), Progress(1, "reduce_scatter", 200)]
    second[1].reach(2.0)
    assert ledger.poll() == [Progress(1, "reduce_scatter", 200, 0.75), Progress(2, "all_gather", 300),
                             Progress(2, "all_gather", 300, 0.5)]
    assert ledger.pending() == 0 and ledger.poll() == []


def test_ledger_lanes_are_independent_and_each_is_asked_under_its_guard():
    entered = []

    @contextlib.contextmanager
    def guard(lane):
        entered.append(lane)
        yield

    ledger = EventLedger(guard=guard)
    stuck, done = pair(start_at=0.0), pair(start_at=0.0, end_at=0.1)
    ledger.add(0, "all_gather", 8, *stuck, lane=0)
    ledger.add(1, "all_gather", 8, *done, lane=1)
    learnt = ledger.poll()
    assert [p for p in learnt if p.seq == 1] == [Progress(1, "all_gather", 8), Progress(1, "all_gather", 8, 0.1)]
    assert [p for p in learnt if p.seq == 0] == [Progress(0, "all_gather", 8)]  # begun, stuck: stays in flight
    assert sorted(entered) == [0, 1] and ledger.pending() == 1


def test_ledger_is_safe_to_poll_from_two_threads():
    ledger = EventLedger()
    for seq in range(200):
        ledger.add(seq, "all_reduce", 4, *pair(start_at=0.0, end_at=0.001))
    seen: list[int] = []
    threads = [threading.Thread(target=lambda: seen.extend(p.seq for p in ledger.poll() if p.finished))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == list(range(200))  # each finished collective reported exactly once


# -- the stream mechanics, with CUDA mocked ----------------------------------------------------
class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for {event.name}")


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda with streams and events that log; the current stream is ``compute``."""
    log: list[str] = []
    on: list[str] = []
    compute = FakeStream("compute", log)
    made: list[tuple] = []
    events: list[FakeEvent] = []

    def stream_factory(device=None, priority=0):
        made.append((device, priority))
        return FakeStream(f"comm{device}", log)

    @contextlib.contextmanager
    def stream_context(stream):
        on.append(stream.name)
        yield
        on.pop()

    def event_factory(enable_timing=False):
        names = {0: "ready", 1: "start", 2: "end"}
        event = FakeEvent(names[len(events) % 3], log, enable_timing)
        events.append(event)
        return event

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", stream_factory)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(torch.cuda, "Event", event_factory)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(comm_stream, "_streams", {})
    return {"log": log, "on": on, "made": made, "events": events}


def test_a_collective_waits_for_the_compute_stream_and_runs_between_its_timing_events(cuda):
    log = cuda["log"]

    def collective():
        log.append(f"collective queued on {cuda['on'][-1]}")

    start, end = comm_stream.issue(collective, torch.device("cuda", 1))
    assert log == ["ready recorded on compute", "comm1 waits for ready", "start recorded on comm1",
                   "collective queued on comm1", "end recorded on comm1"]
    assert start.timing and end.timing and not cuda["events"][0].timing  # only the pair is timed
    comm_stream.consume(end, torch.device("cuda", 1))
    assert log[-1] == "compute waits for end"
    comm_stream.issue(collective, torch.device("cuda", 1))
    assert cuda["made"] == [(1, -1)]  # one high-priority stream per GPU, made once


class FakeCudaTensor:
    """What the collectives read of a tensor; dropping it is observable (weakref)."""

    is_cuda = True
    device = torch.device("cuda", 0)
    dtype = torch.float32  # read by the collective's descriptor (Note [collective agreement])

    def numel(self):
        return 16

    def element_size(self):
        return 4


class Observer:
    def __init__(self):
        self.seen: list[tuple] = []

    def collective_started(self, seq, op, nbytes):
        self.seen.append(("started", seq, op))

    def collective_waited(self, seq, op, waited):
        self.seen.append(("waited", seq, op, threading.get_ident()))

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        self.seen.append(("finished", seq, op, seconds, waited))


@pytest.fixture
def nccl(cuda, monkeypatch):
    """A two-member NCCL group; the flat all-gather only logs."""
    monkeypatch.setattr(collectives, "group_size", lambda group: 2)
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    # Note [link classes]: this rank is the first of the group's two, both on one host.
    monkeypatch.setattr(collectives, "_members", lambda group: ((0, 1), 0))
    monkeypatch.setattr(collectives, "_job_hosts", lambda world_size: (0, 0))
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
    calls = []
    monkeypatch.setattr(collectives, "_all_gather_flat",
                        lambda output, input, group, async_op: calls.append(async_op))
    monkeypatch.setattr(collectives, "_ledger", collectives.EventLedger(guard=collectives._on_gpu))
    observer = Observer()
    collectives.add_observer(observer)
    yield {**cuda, "calls": calls, "observer": observer}
    collectives.remove_observer(observer)


def test_an_nccl_gather_is_timed_by_its_events_and_its_buffers_live_until_the_wait(nccl):
    output, source = FakeCudaTensor(), FakeCudaTensor()
    alive = weakref.ref(source)
    handle = collectives.all_gather(output, source, group=object(), async_op=True)
    assert nccl["calls"] == [False]  # queued on the stream as a plain (non-blocking on NCCL) call
    assert nccl["observer"].seen == []  # issued, but the GPU has not begun it: not "in" it yet
    _ready, start, end = nccl["events"]
    assert not handle.finished_on_device()
    del source
    gc.collect()
    assert alive() is not None  # the handle holds the input while the collective may read it
    start.reach(10.0)
    collectives.poll_timings()
    assert [e[0] for e in nccl["observer"].seen] == ["started"]
    handle.wait()
    assert nccl["log"][-1] == "compute waits for end"  # the consumer waits on the device, not the host
    gc.collect()
    assert alive() is None  # after the wait the buffers go (Note [buffers across streams])
    kinds = [e[0] for e in nccl["observer"].seen]
    assert kinds == ["started", "waited"] and nccl["observer"].seen[1][3] == threading.get_ident()
    end.reach(10.5)
    assert handle.finished_on_device()
    collectives.poll_timings()
    finished = nccl["observer"].seen[-1]
    assert finished[0] == "finished" and finished[3] == pytest.approx(0.5) and finished[4] == 0.0


def test_a_blocking_nccl_collective_does_not_block_the_host(nccl):
    collectives.all_gather(FakeCudaTensor(), FakeCudaTensor(), group=object())  # async_op=False
    assert nccl["log"][-1] == "compute waits for end"
    assert [e[0] for e in nccl["observer"].seen] == ["waited"]  # and no seconds until the GPU says


def test_the_cpu_and_gloo_never_touch_a_stream(monkeypatch):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "gloo")
    assert collectives._stream_device(FakeCudaTensor(), object()) is None  # gloo with CUDA tensors
    assert collectives._stream_device(torch.zeros(2), object()) is None
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    assert collectives._stream_device(FakeCudaTensor(), object()) == torch.device("cuda", 0)
    assert collectives._stream_device(torch.zeros(2), object()) is None  # never asks about a CPU tensor's group
    assert not collectives.DONE.finished_on_device()
    assert not collectives.Handle(None, 0, "x", 0, 0.0).finished_on_device()


# -- the reduce-scatter throttle (Note [in flight by events]) -----------------------------------
class FakeHandle:
    def __init__(self, index, log, device_finished):
        self.index, self.log, self.device_finished = index, log, device_finished

    def wait(self):
        self.log.append(self.index)

    def finished_on_device(self):
        return self.device_finished(self.index)


def _reducer_with_fake_collectives(monkeypatch, device_finished):
    from zerorun.zero.unit.record import UnitRecord
    from zerorun.zero.unit.storage import FlatUnit

    waited: list[int] = []
    launched: list[int] = []

    def reduce_scatter(output, input, *, group, async_op=False, unit=None):
        launched.append(len(launched))
        return FakeHandle(launched[-1], waited, device_finished)

    monkeypatch.setattr(grad_reduce.collectives, "reduce_scatter", reduce_scatter)
    layers = [torch.nn.Linear(3, 3) for _ in range(5)]
    records = []
    for index, layer in enumerate(layers):
        unit = FlatUnit(index, 0, list(layer.named_parameters()), 2, 0, partition_params=False)
        records.append(UnitRecord(unit=unit, segments=(), master=unit.shard, state_home=None, param_home=None))
    reducer = grad_reduce.GradReducer(records, list(reversed(range(5))), grad_reduce.ReducePolicy.REDUCE_SCATTER,
                                      group=None, lazy_gradients=True)
    model = torch.nn.Sequential(*layers)
    return reducer, model, waited, launched


def test_the_throttle_waits_by_count_on_the_cpu_exactly_as_before(monkeypatch):
    reducer, model, waited, launched = _reducer_with_fake_collectives(monkeypatch, lambda index: False)
    order = []
    reducer.on_unit_reduced = lambda record: order.append((record.index, len(launched)))
    model(torch.ones(2, 3)).sum().backward()
    # Units reduce last to first; each is retired only when a launch leaves more than 2 out.
    assert order == [(4, 3), (3, 4), (2, 5)] and waited == [0, 1, 2]
    reducer.finish_backward()
    assert waited == [0, 1, 2, 3, 4]


def test_the_throttle_retires_what_the_gpu_finished_at_once(monkeypatch):
    finished = {0, 1}  # the GPU is through the first two reduce-scatters by the third launch
    reducer, model, waited, launched = _reducer_with_fake_collectives(monkeypatch, lambda index: index in finished)
    order = []
    reducer.on_unit_reduced = lambda record: order.append((record.index, len(launched)))
    model(torch.ones(2, 3)).sum().backward()
    # #0 and #1 retire at their own launch (their events say done), not two launches later;
    # #2.. are still running, so the count rule applies to them: #2 waits at the launch of #4.
    assert order == [(4, 1), (3, 2), (2, 5)] and waited == [0, 1, 2]
    reducer.finish_backward()
    assert waited == [0, 1, 2, 3, 4]
