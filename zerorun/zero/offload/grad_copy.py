"""An offloaded unit's gradient onto the host: pinned buffers, a copy stream, events
(Note [gradient copies]).

    pytest tests/unit/test_gpu_paths.py -k gradient_copies

Note [gradient copies]: with an offloaded optimizer each unit's fp32 gradient chunk crosses to
the host once per step (about 5 GB a step for a 1.26B model). It used to be ``chunk.to("cpu")``
on the update thread: fresh pageable memory (17 GiB/s against 51 pinned on GUIDE.md section 5's
host), a copy that blocked that thread, issued on its default stream behind whatever was queued
there and, for a training loop on another stream, unordered after the reduce-scatter that
writes the chunk. Now:

- when a unit's gradient is final (update.py's ``unit_reduced``, on the training stream, right
  after its reduce-scatter's wait), an event ``final`` is recorded there
  (``record.update.final``);
- the copy is issued on a device-to-host stream of its own that first waits for ``final``,
  into a pinned buffer from torch's pinned caching allocator, non-blocking, and its end is
  recorded as ``done``; the chunk is marked as used by that stream (``record_stream``), so a
  chunk dropped while the copy runs is not reused under it, and a copy is taken only by the
  window whose ``final`` it waited for;
- at most ``AHEAD`` copies run ahead of the updates (started in backward by the placement's
  ``prefetch``); the others start when their update takes them, so pinned staging stays a few
  units' gradients whatever the model's size (Note [unit-sized gradient staging] in
  offload/placements.py); a buffer goes back to torch's pinned cache when the update drops it;
- the update waits on the host for ``done``; ``final`` has then passed as well, so what the
  update thread does on the device next (publishing the master) comes after every read of the
  unit queued before the gradient was final (``wait_for_final`` orders the thread's other
  device work, the norm piece, the same way).

On the CPU nothing changes: the chunk is read where it is (the "device" is the host).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zerorun.errors import InternalError
from zerorun.zero.unit.record import UnitRecord
from zerorun.zero.unit.staging import copy_stream

HOST = torch.device("cpu")
AHEAD = 2  # gradient copies issued before their update takes them
_to_host_streams: dict[int, torch.cuda.Stream] = {}  # one device-to-host stream per GPU


def final_event(device: torch.device):
    """An event on ``device``'s current stream, where the gradient just became final; None on
    the CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for_final(record: UnitRecord) -> None:
    """Order this thread's later work on the unit's device after its gradient's ``final``."""
    final = record.update.final
    if final is not None:
        torch.cuda.current_stream(record.unit.device).wait_event(final)  # type: ignore[arg-type]


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=True)


@dataclass
class _Copy:
    buffer: torch.Tensor
    final: object  # the torch.cuda.Event it waited for: which window's gradient it holds
    done: object  # torch.cuda.Event


class GradientCopies:
    """One offloading placement's gradient copies in flight (Note [gradient copies])."""

    def __init__(self, ahead: int = AHEAD):
        self.ahead = ahead
        self._issued: dict[int, _Copy] = {}
        self._lock = threading.Lock()

    def start(self, record: UnitRecord) -> None:
        """Backward, on the training thread: issue the unit's copy now if fewer than ``ahead``
        are waiting for their update; otherwise its update issues it."""
        if record.unit.device.type != "cuda" or record.update.final is None:
            return
        with self._lock:
            if record.index in self._issued or len(self._issued) >= self.ahead:
                return
            self._issued[record.index] = self._issue(record, record.update.final)

    def take(self, record: UnitRecord) -> torch.Tensor:
        """The unit's fp32 gradient chunk on the host, once its copy is done; zeros for a lazy
        shard that no backward created this window."""
        grad = record.gradient.chunk
        if grad is None:
            return torch.zeros(record.unit.layout.chunk_numel, dtype=torch.float32)
        if record.unit.device.type != "cuda":
            return grad.to(HOST, dtype=torch.float32)
        with self._lock:
            copy = self._issued.pop(record.index, None)
        if copy is not None and copy.final is not record.update.final:
            copy = None  # an earlier window's, never taken (its step failed): not this gradient
        if copy is None:  # not started in backward: ordered after what this thread queued so far
            copy = self._issue(record, record.update.final or final_event(record.unit.device))
        copy.done.synchronize()  # type: ignore[attr-defined]
        return copy.buffer if copy.buffer.dtype == torch.float32 else copy.buffer.float()

    @staticmethod
    def _issue(record: UnitRecord, final) -> _Copy:
        grad = record.gradient.chunk
        if grad is None:
            raise InternalError(f"unit {record.index}: a gradient copy without a gradient")
        stream = copy_stream(record.unit.device, _to_host_streams)
        with torch.cuda.stream(stream):
            stream.wait_event(final)
            buffer = pinned_empty(grad.numel(), grad.dtype)
            buffer.copy_(grad.reshape(-1), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        grad.record_stream(stream)
        return _Copy(buffer, final, done)
