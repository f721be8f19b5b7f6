"""Copying an offloaded chunk onto its GPU on a copy stream of its own (Note [copy stream]).

    pytest tests/unit/test_device_contract.py -k staging

Note [copy stream]: with stage-3 parameter offload each gather first copies the owned chunk
from host memory onto the GPU (Note [host shards] in unit/storage.py). Queued on the compute
stream, that copy waited for every kernel already queued there, so a prefetch issued while a
module computes could not start moving bytes until that compute was done (FSDP2 copies on a
stream of its own for the same reason). Here the copy is issued on one copy stream per
device and starts at once; then:

- the compute stream waits for the copy (an event, queued where the all-gather is about to
  be issued from), so the all-gather, which the communication stream runs after an event the
  compute stream records at its issue (Note [streams] in comm/collectives.py), reads the
  finished copy, and nothing on the compute stream is held back but what comes after that point;
- the staged tensor is allocated from the copy stream's pool and marked as used by the
  compute stream (``record_stream``): when the gather drops it after ``wait()``, the caching
  allocator reuses the block only once the compute stream passed that point, which is after
  the collective finished reading it;
- the host chunk is written only by an update's publish, and every publish comes after a
  blocking device-to-host copy on the compute stream that is ordered after the copy.

On the CPU there is no stream and nothing to stage (the chunk already is where the model is).
"""

from __future__ import annotations

import threading

import torch

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def copy_stream(device: torch.device, streams: dict[int, torch.cuda.Stream] | None = None) -> torch.cuda.Stream:
    """The one copy stream of this GPU in ``streams`` (made on first use): by default the
    host-to-device one; offload/grad_copy.py keeps the device-to-host streams apart, so the two
    directions run at once."""
    streams = _streams if streams is None else streams
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(device=index)
        return stream


def stage(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied onto ``device`` for a collective issued next on the current stream."""
    if device.type != "cuda":
        return host.to(device)
    current = torch.cuda.current_stream(device)
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        staged = host.to(device, non_blocking=True)
    current.wait_stream(stream)
    staged.record_stream(current)
    return staged
