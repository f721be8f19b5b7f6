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

from zerorun.zero.comm.ring import post_in_pieces, post_receives, post_sends


class Exchange:
    def __init__(self, send: torch.Tensor, received: torch.Tensor, part: int, group, tag: int, *, start: bool = True):
        """``start``: post everything now; else the ring driver posts the receives, then the
        sends (``receive_first``, ``send_first``: Note [receives ahead] in ring_driver.py)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        # each rank sends right by `step` and receives from left by `step`
        self._pairs = [(send[to * part : (to + 1) * part], peer(to), received[frm * part : (frm + 1) * part], peer(frm))
                       for to, frm in (((rank + step) % size, (rank - step) % size) for step in range(1, size))]
        self._group, self._tag = group, tag
        self._works: list = []
        if start:
            for out, to, into, frm in self._pairs:
                self._works += post_in_pieces(out, to, into, frm, group, tag)

    def receive_first(self) -> None:
        for _, _, into, frm in self._pairs:
            self._works += post_receives(into, frm, self._group, self._tag)

    def send_first(self) -> None:
        for out, to, _, _ in self._pairs:
            self._works += post_sends(out, to, self._group, self._tag)

    def wait(self) -> None:
        for work in self._works:
            if work is not None:  # torch types these Optional; gloo always returns a work
                work.wait()
        self._works = []
