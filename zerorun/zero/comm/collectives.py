"""Every collective zerorun issues goes through this module.

Each function takes its process group explicitly, and reports to the registered observers
when it starts (so a hang is visible while it is blocked) and when it finishes (op, bytes,
seconds). Telemetry (zerorun/telemetry) is one such observer; tests can add their own.

Observer contract (duck-typed):
    collective_started(seq: int, op: str, nbytes: int) -> None
    collective_waited(seq: int, op: str, waited: float) -> None      (optional)
    collective_finished(seq: int, op: str, nbytes: int, seconds: float, waited: float) -> None
    collective_sent(seq: int, op: str, within: int, between: int) -> None    (optional)
``collective_sent`` comes once per collective, when it is issued: the bytes this rank sends in
it to ranks of its own host and to other hosts (Note [link classes] in link_split.py: counted by
the host channel, the ring and qgZ's exchange, estimated by the ring formula for gloo's and
NCCL's own collectives).
On the CPU (gloo, the host channel, the ring) a collective starts when it is issued and
finishes inside its ``wait()``: ``seconds`` runs from issue to completion (an asynchronous
collective overlaps compute for most of it) and ``waited`` is the part the calling thread spent
blocked on it (all of it for a blocking collective, the ``wait()`` for an asynchronous one),
reported from that thread. On the communication stream (NCCL, below) the device says when: a
collective starts when the GPU begins it and finishes when the GPU is done, ``seconds`` is that
transfer as its CUDA events timed it, reported later from whichever thread polled (Note [event
ledger] in event_ledger.py) with ``waited`` 0; the host's blocked time comes separately, from
the waiting thread, as ``collective_waited``. ``seq`` counts collectives issued by this process,
from 0, in program order: the same number names the same collective on every rank of a correct
SPMD program.

Note [streams]: on the CPU nothing here uses a stream. On a GPU with NCCL every collective of
CUDA tensors (all-gather, reduce-scatter, all-reduce, broadcast; ``barrier`` has no tensor and
stays torch's) runs on the GPU's communication stream (comm_stream.py), ordered by CUDA events:
- Before: an event recorded on the issuing thread's current stream (the compute stream) right
  at the issue, which the communication stream waits for. Everything the collective reads was
  written before that point (a bucket filled, a chunk cast into its slot of ``full``, a staged
  host chunk the compute stream already waited for: Note [copy stream] in unit/staging.py), and
  its output was allocated before it, so any earlier user of that memory is done with it.
- After: the collective's ``end`` event. ``wait()`` makes the waiting thread's current stream
  wait for it, on the device: the host does not block, and every later read of an output
  (accumulating a reduced chunk, autograd reading a gathered unit, the offload worker's
  blocking copy of a reduced chunk, issued after the main thread queued the wait on the same
  default stream) is queued after it. Publishing an update back to a host chunk is a blocking
  copy (publish in offload/master.py), so a host buffer is never reused under an in-flight copy.
- Timing: the collective runs between two timing events on the communication stream; its
  seconds are theirs, read lazily (Note [event ledger]). Before this, ``wait()`` on NCCL
  returned once the wait was queued, so the reported seconds measured issue-to-queue time.
- In flight: a collective is in flight until its end event completed, not until a host call
  returned; the reduce-scatter throttle (grad_reduce.py, Note [in flight by events]) and the
  hang view (a stuck collective stays begun and unfinished) count that way.
- One stream for all of them, so they run in issue order, the order every rank issued them
  (Note [launch order] in grad_reduce.py); a reduce-scatter and the next gather do not overlap
  each other, only compute. Separate gather and reduce streams, as FSDP2 has, would need the
  gather not to wait behind a reduce-scatter it does not depend on; not measured, not done.
- The comm share (``waited_s``) stays host-blocked time: on NCCL a wait blocks the host for
  microseconds, so the share says little there; the transfer seconds (``bw``, the summary's
  per-op seconds) are what the GPU spent in collectives.
Note [buffers across streams]: every buffer a collective touches (its inputs and outputs: a
gradient bucket, an output chunk, a gathered unit's storage) is allocated on the compute stream
(a staged host chunk on the copy stream, marked used by the compute stream: Note [copy stream]),
and the handle holds a reference to each until ``wait()`` has queued the compute stream's wait
for the collective's end event; only then may the caller drop them. The caching allocator hands
a freed block out again only to work queued later on the stream it was allocated on (or, for a
marked block, once the compute stream passed the point of the free), which is then after that
wait, so the collective has finished with the block
(holding references, not ``record_stream``: memory is freed at a known point, as FSDP2 chose,
instead of whenever the communication stream's later work completes). So a handle must be
waited before its buffers are dropped; every caller waits (grad_reduce's in-flight queue,
a gather's ``_finish_gather``, a refresh, a blocking call). The process group keeps its own
references too. gloo with CUDA tensors (two ranks sharing one GPU, the cuda test tier) keeps
torch's own ordering: its ``wait()`` blocks the host and orders the current stream.
The cuda test tier checks all of this on a GPU (tests/cuda/test_cuda_comm_stream.py; NCCL at
world 2 needs two GPUs).

Every collective says what it is (``unit=``, and the phase it is issued in) and the ranks check
that they agree before any output is used: Note [collective agreement] in agreement.py, which
says how the descriptors travel on each transport (``_agree_first`` below, or the transport).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zerorun.zero.comm import agreement, link_split
from zerorun.zero.comm.agreement import Descriptor
from zerorun.zero.comm.event_ledger import EventLedger
from zerorun.zero.comm.host_channel import host_channel, usable as host_channel_usable
from zerorun.zero.comm.link_split import Sent
from zerorun.zero.comm.ring import Ring
from zerorun.zero.comm.ring_driver import data_tag, ring_driver


class CollectiveObserver(Protocol):
    def collective_started(self, seq: int, op: str, nbytes: int) -> None: ...

    def collective_waited(self, seq: int, op: str, waited: float) -> None: ...

    def collective_finished(self, seq: int, op: str, nbytes: int, seconds: float, waited: float) -> None: ...


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


def notify_finished(seq: int, op: str, nbytes: int, seconds: float, waited: float) -> None:
    for observer in list(_observers):
        observer.collective_finished(seq, op, nbytes, seconds, waited)


def notify_sent(seq: int, op: str, sent: Sent) -> None:
    for observer in list(_observers):
        said = getattr(observer, "collective_sent", None)
        if said is not None:
            said(seq, op, sent.within, sent.between)


def notify_waited(seq: int, op: str, waited: float) -> None:
    for observer in list(_observers):
        said = getattr(observer, "collective_waited", None)
        if said is not None:
            said(seq, op, waited)


def _on_gpu(lane: int):
    from zerorun.zero.comm import comm_stream

    return comm_stream.on_gpu(lane)


# Collectives on communication streams not yet seen finished (Note [event ledger]).
_ledger = EventLedger(guard=_on_gpu)


def poll_timings() -> None:
    """Tell the observers which collectives on a communication stream the GPU has begun or
    finished since the last poll, with their transfer seconds; never blocks (Note [event
    ledger]). Nothing to do on the CPU."""
    for progress in _ledger.poll():
        if progress.seconds is None:
            notify_started(progress.seq, progress.op, progress.nbytes)
        else:
            notify_finished(progress.seq, progress.op, progress.nbytes, progress.seconds, 0.0)


# --- the collectives ---------------------------------------------------------------------
# Every function below takes its group explicitly (``group=None`` means the default group)
# and issues nothing at all when the group has one member: world size 1 is the plain path.

ReduceOp = dist.ReduceOp


def group_size(group) -> int:
    """Members of ``group``; 1 when torch.distributed is not initialised at all."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Handle:
    """An issued collective on the CPU path: ``wait()`` blocks until it is done and reports it once."""

    __slots__ = ("_work", "_seq", "_op", "_nbytes", "_start", "_done")

    def __init__(self, work, seq: int, op: str, nbytes: int, start: float):
        self._work, self._seq, self._op, self._nbytes, self._start = work, seq, op, nbytes, start
        self._done = False

    def wait(self, *, blocked_since: float | None = None) -> None:
        """``blocked_since``: when the caller began to block on it (a blocking collective: its issue)."""
        if self._done:
            return
        entered = time.perf_counter() if blocked_since is None else blocked_since
        if self._work is not None:
            self._work.wait()
        self._done = True
        now = time.perf_counter()
        notify_finished(self._seq, self._op, self._nbytes, now - self._start, now - entered)

    def finished_on_device(self) -> bool:
        """False: a host collective has no device events; it is in flight until waited."""
        return False


class StreamHandle:
    """A collective on a GPU's communication stream (Note [streams]): ``wait()`` makes the
    waiting thread's current stream wait for it, then lets its buffers go (Note [buffers across
    streams]); its seconds come from its events (Note [event ledger])."""

    __slots__ = ("_seq", "_op", "_end", "_device", "_buffers", "_done")

    def __init__(self, seq: int, op: str, end, device: torch.device, buffers: tuple):
        self._seq, self._op, self._end, self._device, self._buffers = seq, op, end, device, buffers
        self._done = False

    def wait(self, *, blocked_since: float | None = None) -> None:
        if self._done:
            return
        entered = time.perf_counter() if blocked_since is None else blocked_since
        from zerorun.zero.comm import comm_stream

        comm_stream.consume(self._end, self._device)
        self._buffers = ()  # the consumer is ordered after the collective now
        self._done = True
        notify_waited(self._seq, self._op, time.perf_counter() - entered)
        poll_timings()

    def finished_on_device(self) -> bool:
        """Whether the GPU has finished it (its end event), asked without blocking."""
        with _on_gpu(self._device.index):
            return bool(self._end.query())


class _Done:
    """What a collective on a one-member group returns: already complete."""

    def wait(self) -> None:
        pass

    def finished_on_device(self) -> bool:
        return False  # as a host collective: the CPU path retires it exactly as before


DONE = _Done()
Issued = Handle | StreamHandle | _Done  # what every collective below returns


def _issue(op: str, nbytes: int, call, async_op: bool, *, transport=None, on_stream=None, buffers=(),
           descriptor: Descriptor, group, src: int | None = None, part: int = 0):
    """``on_stream``: the GPU whose communication stream runs it (Note [streams]), or None.
    ``transport(seq, descriptor)`` carries the descriptor with the data; else it travels apart
    (``_agree_first``). ``src`` (a broadcast's global source) and ``part`` (qgZ's bytes per peer)
    serve the link split (Note [link classes] in link_split.py)."""
    seq = next_sequence()
    if _observers:
        notify_sent(seq, op, _sent(op, nbytes, group, transport, src, part))
    handle: Handle | StreamHandle
    if on_stream is not None:
        from zerorun.zero.comm import comm_stream

        start = time.perf_counter()
        began, end = comm_stream.issue(lambda: call(False), on_stream)  # queued, not waited, by the host
        _ledger.add(seq, op, nbytes, began, end, lane=on_stream.index)
        handle = StreamHandle(seq, op, end, on_stream, buffers)
        poll_timings()  # report what finished meanwhile (a query or two)
    else:
        notify_started(seq, op, nbytes)
        start = time.perf_counter()
        if transport is not None and transport.carries_descriptor:
            work = transport(seq, descriptor)
        else:
            _agree_first(group, descriptor, seq)  # before any byte moves: Note [collective agreement]
            work = transport(seq, None) if transport is not None else call(async_op)
        handle = Handle(work, seq, op, nbytes, start)  # work None when torch already finished it
    if not async_op:
        handle.wait(blocked_since=start)
    return handle


def _sent(op: str, nbytes: int, group, transport, src: int | None, part: int) -> Sent:
    """What this rank sends in the collective, by link class (Note [link classes])."""
    members, index = _members(group)
    hosts = _job_hosts(dist.get_world_size())
    route = None if transport is None else transport.route
    if route == "channel":
        return link_split.channel_sent(nbytes, len(members))
    if route == "ring":
        return link_split.ring_sent(nbytes, members, index, hosts)
    if route == "exchange":
        return link_split.exchange_sent(part, members, index, hosts)
    src_index = members.index(src) if src is not None and src in members else None
    return link_split.estimated_sent(op, nbytes, members, index, hosts, src_index)


_members_of: dict = {}


def _members(group) -> tuple[tuple[int, ...], int]:
    """The group's global ranks in group order (looked up once per group), and this rank's index."""
    key = dist.group.WORLD if group is None else group
    members = _members_of.get(key)
    if members is None:
        size = dist.get_world_size(group)
        members = _members_of[key] = tuple(range(size)) if group is None else tuple(
            dist.get_global_rank(group, r) for r in range(size))
    return members, dist.get_rank(group)


_hosts_of: dict[int, tuple[int, ...]] = {}


def _job_hosts(world_size: int) -> tuple[int, ...]:
    """Each global rank's host, read from the environment once (link_split.job_hosts)."""
    hosts = _hosts_of.get(world_size)
    if hosts is None:
        hosts = _hosts_of[world_size] = link_split.job_hosts(os.environ, world_size)
    return hosts


def _agree_first(group, descriptor: Descriptor, seq: int) -> None:
    """The ranks' check of a collective whose transport does not carry its descriptor, waited
    before the collective is issued (gloo aborts the process when a peer sends another size): a
    round of the group's host channel (it then orders every collective of the group), else a
    header-only job of the group's ring driver (Note [headers in band] in ring_driver.py); nothing
    on NCCL (Note [collective agreement])."""
    if dist.get_backend(group) != "gloo":
        return
    channel = host_channel(group)
    check = (channel.submit("check", None, None, seq, descriptor) if channel is not None
             else ring_driver(group).submit("check", seq, descriptor, None))
    check.wait()


def _stream_device(tensor: torch.Tensor, group) -> torch.device | None:
    """Note [streams]: an NCCL collective of CUDA tensors runs on that GPU's communication
    stream; everything else (the CPU, gloo with CUDA tensors) as torch runs it."""
    if not tensor.is_cuda or "nccl" not in str(dist.get_backend(group)).lower():
        return None
    return tensor.device


# torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, *, group, op=ReduceOp.SUM, async_op: bool = False,
               unit: tuple[int, int] | None = None):
    if group_size(group) == 1:
        return DONE
    return _issue(
        "all_reduce", _nbytes(tensor),
        lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op,
        on_stream=_stream_device(tensor, group), buffers=(tensor,),
        descriptor=agreement.describe("all_reduce", tensor, unit, _op_code(op)), group=group,
    )


def _op_code(op) -> int:
    """A reduce op as a number every rank computes alike (the descriptor's ``extra``)."""
    for code, name in enumerate(("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")):
        if op == getattr(ReduceOp, name, None):
            return code
    return 99


class _Transport:
    """How a CPU collective moves its bytes: ``(seq, descriptor) -> work``; ``carries_descriptor``:
    whether the descriptor travels with the data (the host channel) or apart (the ring);
    ``route``: channel, ring or exchange, for the link split (Note [link classes])."""

    __slots__ = ("_start", "carries_descriptor", "route")

    def __init__(self, start, carries_descriptor: bool, route: str):
        self._start, self.carries_descriptor, self.route = start, carries_descriptor, route

    def __call__(self, seq: int, descriptor: Descriptor | None):
        return self._start(seq, descriptor)


def _cpu_transport(kind: str, output: torch.Tensor, input: torch.Tensor, group) -> _Transport | None:
    """gloo on CPU: ranks that share a host move the bytes through shared memory
    (comm/host_channel.py), others through our point-to-point ring (comm/ring.py); both beat
    gloo's own flat collectives. None: let torch run it (NCCL)."""
    if output.is_cuda or dist.get_backend(group) != "gloo":
        return None
    channel = host_channel(group)  # opened by the group's first collective here, on every rank
    if channel is not None and host_channel_usable(output, input):
        return _Transport(lambda seq, d: channel.submit(kind, output, input, seq, d), True, "channel")
    return _point_to_point(lambda tag, post: Ring(kind, output, input, group, tag=tag, start=post), group, "ring")


def _point_to_point(start, group, route: str) -> _Transport:
    """A collective of sends and receives, ``start(tag, post) -> a Ring or an Exchange`` (``post``:
    its first step posted at once). A gloo group without a host channel runs it on its ring
    driver, which carries its descriptor and posts it (Note [ring progress], Note [headers in
    band], Note [receives ahead]). Otherwise it starts from the caller: beside a channel (a
    tensor the channel cannot move), after the channel's check round, so the channel still
    orders every collective of the group; on NCCL (qgZ's exchange of GPU tensors)."""
    if dist.get_backend(group) != "gloo" or host_channel(group) is not None:
        return _Transport(lambda seq, _: start(data_tag(seq), True), False, route)
    driver = ring_driver(group)
    return _Transport(lambda seq, d: driver.submit(route, seq, d, lambda tag: start(tag, False)), True, route)


def exchange(op: str, send: torch.Tensor, into: torch.Tensor, part: int, *, group, async_op: bool = False,
             unit: tuple[int, int] | None = None, described: torch.Tensor | None = None):
    """Point-to-point exchange of equal byte parts (comm/quantized_exchange.py): ``send`` holds one
    part of ``part`` bytes per rank (this rank's slot unused); rank r's part for this one lands in
    slot r of ``into``. ``op`` names it in the agreement and the link split (qgZ's reduce-scatter,
    a tied lookup's gradient rows); the agreement describes ``described`` (default ``send``)."""
    from zerorun.zero.comm.quantized_exchange import Exchange

    transport = _point_to_point(lambda tag, post: Exchange(send, into, part, group, tag=tag, start=post),
                                group, "exchange")
    return _issue(op, (group_size(group) - 1) * part, None, async_op, transport=transport,
                  descriptor=agreement.describe(op, send if described is None else described, unit),
                  group=group, part=part)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False,
                   unit: tuple[int, int] | None = None):
    """Sum ``input`` over the group; rank r receives elements [r*n, (r+1)*n), n = output.numel()."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input[: output.numel()])
        return DONE
    return _issue(
        "reduce_scatter", _nbytes(input),
        lambda a: _reduce_scatter_flat(output, input, group=group, async_op=a), async_op,
        transport=_cpu_transport("reduce_scatter", output, input, group),
        on_stream=_stream_device(output, group), buffers=(output, input),
        descriptor=agreement.describe("reduce_scatter", input, unit), group=group,
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False,
               unit: tuple[int, int] | None = None):
    """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's slice
    of ``output`` (in place)."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output[: input.numel()].copy_(input)
        return DONE
    return _issue(
        "all_gather", _nbytes(output),
        lambda a: _all_gather_flat(output, input, group=group, async_op=a), async_op,
        transport=_cpu_transport("all_gather", output, input, group),
        on_stream=_stream_device(output, group), buffers=(output, input),
        descriptor=agreement.describe("all_gather", output, unit), group=group,
    )


def broadcast(tensor: torch.Tensor, *, src: int, group, async_op: bool = False):
    if group_size(group) == 1:
        return DONE
    return _issue(
        "broadcast", _nbytes(tensor),
        lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), async_op,
        on_stream=_stream_device(tensor, group), buffers=(tensor,),
        descriptor=agreement.describe("broadcast", tensor, None, src), group=group, src=src,
    )


def barrier(*, group) -> None:
    if group_size(group) == 1:
        return
    _issue("barrier", 0, lambda a: dist.barrier(group=group, async_op=a), False,
           descriptor=agreement.describe("barrier", None, None), group=group)


# ZeRO++'s collectives (qwZ's quantized gathers, qgZ's quantized reduce-scatters, hpZ's
# hierarchical reduce-scatter) are built on the ones above, in quantized_collectives.py (Note
# [quantized collectives], Note [hierarchical reduce-scatter] there).
