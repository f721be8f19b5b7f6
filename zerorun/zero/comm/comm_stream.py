"""The communication stream of a GPU: where NCCL collectives run, ordered and timed with CUDA
events (Note [streams] in collectives.py, which is the only caller).

    pytest tests/unit/test_comm_stream.py

Only NCCL collectives of CUDA tensors come here; the CPU and gloo never do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
# A high-priority stream (FSDP2 does the same): a collective's kernel is scheduled ahead of queued
# compute kernels, instead of waiting for SMs behind them while every rank waits for it.
_PRIORITY = -1


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The one communication stream of this GPU (made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index, priority=_PRIORITY)
        return stream


def issue(call: Callable[[], object], device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Run ``call`` (which queues one collective on the current stream, without blocking the
    host) on the communication stream, after everything the calling thread's current stream has
    queued so far; returns the timing events just before and just after it."""
    current = torch.cuda.current_stream(device)
    stream = comm_stream(device)
    ready = torch.cuda.Event()
    ready.record(current)  # the inputs were written, and the outputs allocated, before this point
    stream.wait_event(ready)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        call()
        end.record(stream)
    return start, end


def consume(end: torch.cuda.Event, device: torch.device) -> None:
    """The calling thread's current stream waits (on the device, not the host) for the
    collective that ``end`` closes."""
    torch.cuda.current_stream(device).wait_event(end)


def on_gpu(index: int):
    """Make GPU ``index`` current around event queries from any thread (a thread starts on GPU
    0, and a CUDA call there would create a context on GPU 0 for every rank)."""
    return torch.cuda.device(index)
