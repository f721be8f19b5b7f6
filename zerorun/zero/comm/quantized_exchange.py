"""Point-to-point exchange of packed chunks for the quantized reduce-scatter (qgZ), gloo or NCCL.

    pytest tests/distributed/test_quantized_collectives.py

Each rank's send buffer holds one packed part per rank (its own slot unused); part r goes to
rank r, and rank r's part for us lands in slot r of the receive buffer. Every send and receive
is posted when the collective is issued, so the transfer proceeds while the caller computes
(as comm/ring.py's first step does); ``wait()`` completes them. Tags are the collective's
sequence number, identical on every rank of an SPMD program.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerorun.zero.comm.ring import post_in_pieces


class Exchange:
    def __init__(self, send: torch.Tensor, received: torch.Tensor, part: int, group, tag: int):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self._works: list = []
        for step in range(1, size):  # each rank sends right by `step` and receives from left by `step`
            to, frm = (rank + step) % size, (rank - step) % size
            self._works += post_in_pieces(send[to * part : (to + 1) * part], peer(to),
                                          received[frm * part : (frm + 1) * part], peer(frm), group, tag)

    def wait(self) -> None:
        for work in self._works:
            if work is not None:  # torch types these Optional; gloo always returns a work
                work.wait()
        self._works = []
