"""Every collective zerorun issues goes through this module.

Each function takes its process group explicitly, and reports to the registered observers
when it starts (so a hang is visible while it is blocked) and when it finishes (op, bytes,
seconds). Telemetry (zerorun/telemetry) is one such observer; tests can add their own.

Observer contract (duck-typed):
    collective_started(seq: int, op: str, nbytes: int) -> None
    collective_finished(seq: int, op: str, nbytes: int, seconds: float, waited: float) -> None
``seconds`` runs from issue to completion (an asynchronous collective overlaps compute for most
of it); ``waited`` is the part the calling thread spent blocked on it (all of it for a
blocking collective, the ``wait()`` for an asynchronous one), reported from that thread.
``seq`` counts collectives issued by this process, from 0, in program order: the same
number names the same collective on every rank of a correct SPMD program.

Note [streams]: zerorun issues every collective, bucket copy, zero-fill and fp32 accumulation
on the caller's current CUDA stream. The one stream of its own is the copy stream that moves an
offloaded parameter chunk onto the GPU before its gather (Note [copy stream] in
unit/staging.py: issued at once, not behind queued compute; the current stream waits for it
before the all-gather is issued, and the staged block is freed only after the current stream
passed the collective). What that guarantees and what it does not, on NCCL:
- Order is correct by construction. ProcessGroupNCCL makes its internal stream wait for the
  current stream when a collective is issued, and ``Handle.wait()`` makes the current stream
  wait for the collective. Every later read of an output (accumulating a reduced chunk,
  autograd reading a gathered unit) is queued on the current stream after that wait.
- Buffer lifetimes: a bucket handed back to its pool (grad_reduce.py, Note [bucket reuse])
  after ``wait()`` is next written by work queued on the current stream after that wait, so
  the collective has finished with it; the process group also keeps its inputs alive until
  the work completes. A gathered unit's storage is freed (Note [freeing by storage resize])
  by the current stream's allocator only after its last reader was queued there.
- The offload worker thread (update.py) copies a reduced chunk to the host with a blocking
  ``.to("cpu")`` issued after the main thread queued the collective's wait; both threads use
  the default stream, so the copy sees the reduced values. Publishing an update back is a
  blocking copy too (publish in offload/master.py), so a host buffer is never reused under an in-flight copy.
- Not right on GPU yet: ``Handle.wait()`` on NCCL returns as soon as the wait is queued, so the
  seconds reported per collective measure issue-to-queue time, not the transfer, and the
  in-flight throttle (MAX_IN_FLIGHT) bounds queued work, not running work; a stuck collective
  shows as the next synchronizing call, not as "has not entered collective #k". Events timed
  on a dedicated communication stream would fix all three (issue 32 item 3, not done): that
  needs a GPU to test, and none was lent to the sessions that wrote this. The cuda test tier
  (tests/cuda, scripts/gpu_check.sh) checks the ordering above by parity on a GPU.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zerorun.zero.comm.host_channel import host_channel, usable as host_channel_usable
from zerorun.zero.comm.ring import Ring


class CollectiveObserver(Protocol):
    def collective_started(self, seq: int, op: str, nbytes: int) -> None: ...

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
    """An issued collective: ``wait()`` blocks until it is done and reports it once."""

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


class _Done:
    """What a collective on a one-member group returns: already complete."""

    def wait(self) -> None:
        pass


DONE = _Done()


def _issue(op: str, nbytes: int, call, async_op: bool, *, transport=None):
    seq = next_sequence()
    notify_started(seq, op, nbytes)
    start = time.perf_counter()
    work = transport(seq) if transport is not None else call(async_op)
    handle = Handle(work, seq, op, nbytes, start)  # None when torch already finished it
    if not async_op:
        handle.wait(blocked_since=start)
    return handle


# torch 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, *, group, op=ReduceOp.SUM, async_op: bool = False):
    if group_size(group) == 1:
        return DONE
    return _issue(
        "all_reduce", _nbytes(tensor),
        lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a), async_op,
    )


def _cpu_transport(kind: str, output: torch.Tensor, input: torch.Tensor, group):
    """gloo on CPU: ranks that share a host move the bytes through shared memory
    (comm/host_channel.py), others through our point-to-point ring (comm/ring.py); both beat
    gloo's own flat collectives. None: let torch run it (NCCL)."""
    if output.is_cuda or dist.get_backend(group) != "gloo":
        return None
    channel = host_channel(group)  # opened by the group's first collective here, on every rank
    if channel is not None and host_channel_usable(output, input):
        return lambda seq: channel.submit(kind, output, input, seq)
    return lambda seq: Ring(kind, output, input, group, tag=seq & 0x7FFFFFFF)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False):
    """Sum ``input`` over the group; rank r receives elements [r*n, (r+1)*n), n = output.numel()."""
    if group_size(group) == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input[: output.numel()])
        return DONE
    return _issue(
        "reduce_scatter", _nbytes(input),
        lambda a: _reduce_scatter_flat(output, input, group=group, async_op=a), async_op,
        transport=_cpu_transport("reduce_scatter", output, input, group),
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False):
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
    )


def broadcast(tensor: torch.Tensor, *, src: int, group, async_op: bool = False):
    if group_size(group) == 1:
        return DONE
    return _issue(
        "broadcast", _nbytes(tensor),
        lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a), async_op,
    )


def barrier(*, group) -> None:
    if group_size(group) == 1:
        return
    _issue("barrier", 0, lambda a: dist.barrier(group=group, async_op=a), False)
