"""Ring reduce-scatter and all-gather from point-to-point sends, for gloo on CPU.

    pytest tests/distributed/test_cpu_collectives.py -k ring

Used between ranks that cannot share memory (on other hosts, in other namespaces, or
ZERORUN_HOST_CHANNEL=0); ranks on one host use comm/host_channel.py, two memcpys instead of TCP.

Why: gloo's own flat reduce-scatter and all-gather are far slower than its all-reduce (2 CPU
ranks, 32 MB: all-reduce 20-27 ms, reduce_scatter_single 52-86 ms, all_gather_single 39-75 ms),
while a ring of isend/irecv moves the same bytes in 15 ms (reduce-scatter) and 8 ms
(all-gather). With the ring, stages 1-2 (reduce-scatter + all-gather) cost about one
all-reduce, as the ZeRO paper's accounting says they should.

Algorithm (N ranks, buffers cut into N equal chunks, right = rank+1, left = rank-1):
  reduce-scatter  step s sends the running sum of chunk (rank-s-1) to the right and adds the
                  left's running sum of chunk (rank-s-2) to our own; after N-1 steps our
                  running sum of chunk ``rank`` holds every rank's contribution.
  all-gather      step s forwards chunk (rank-s) to the right and receives chunk (rank-s-1).
Between hosts the group's ring driver runs every step of it on a thread of its own (Note [ring
progress] in ring_driver.py), so the whole transfer overlaps the caller's compute whatever N is;
beside a host channel (tensors it cannot move) the caller posts the first step when issuing and
the rest when waiting. Tags come from the collective's sequence number, identical on every rank
of an SPMD program.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerorun.errors import InternalError


# Note [receives first]: gloo keeps one queue of outgoing messages per peer, and a receive
# tells the sender it may send (the bytes move only after that) through the same queue. A
# receive posted after a send of several MB to the same peer waited behind that send's bytes,
# so the two directions of a pair took turns instead of moving at once: at 2 ranks on a 300
# Mbit/s shaped veth, 16.8 MB each way took 0.93 s (145 Mbit/s). So receives are posted before
# sends, and a message is cut into pieces posted in turn (receive, send, receive, ...), so that
# each piece's go-ahead does not wait behind the bytes of the pieces before it: 0.48 s (278
# Mbit/s, the link's rate). Pieces of one message share its tag: gloo matches a peer's messages
# of one tag in the order they were posted, the order they travel in on the pair's connection.
PIECE_BYTES = 512 * 1024
MAX_PIECES = 32


def post_in_pieces(send: torch.Tensor, to: int, recv: torch.Tensor, frm: int, group, tag: int) -> list:
    """irecv ``recv`` from ``frm`` and isend ``send`` to ``to`` (global ranks), each cut into the
    same pieces on both sides, posted in turn (Note [receives first]); the works to wait for."""
    sends, recvs = _cut(send), _cut(recv)
    works = []
    for index in range(max(len(sends), len(recvs))):
        if index < len(recvs):
            works.append(dist.irecv(recvs[index], frm, group=group, tag=tag))
        if index < len(sends):
            works.append(dist.isend(sends[index], to, group=group, tag=tag))
    return works


def post_receives(recv: torch.Tensor, frm: int, group, tag: int) -> list:
    """The receiving half of ``post_in_pieces``, posted ahead of the sends (Note [receives ahead]
    in ring_driver.py): the same pieces as the sender cuts."""
    return [dist.irecv(piece, frm, group=group, tag=tag) for piece in _cut(recv)]


def post_sends(send: torch.Tensor, to: int, group, tag: int) -> list:
    return [dist.isend(piece, to, group=group, tag=tag) for piece in _cut(send)]


def _cut(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensor.view(-1).tensor_split(_pieces(tensor.numel() * tensor.element_size()))


def _pieces(nbytes: int) -> int:
    return max(1, min(MAX_PIECES, nbytes // PIECE_BYTES))


class Ring:
    def __init__(self, kind: str, output: torch.Tensor, input: torch.Tensor, group, tag: int, *, start: bool = True):
        """``start``: post the first step now; else the ring driver posts it in two halves
        (``receive_first``, then ``send_first``: Note [receives ahead] in ring_driver.py)."""
        if kind not in ("reduce_scatter", "all_gather"):
            raise InternalError(f"a ring collective of kind {kind!r}")
        self.kind, self.output, self.input, self.tag = kind, output, input, tag
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.right = peer((self.rank + 1) % self.size)
        self.left = peer((self.rank - 1) % self.size)
        self.group = group
        self.step = 0
        self._works: list = []
        if kind == "reduce_scatter":
            n = output.numel()
            # Note [receive into the output]: the last step's incoming sum lands in ``output``
            # itself, and our own chunk is added to it there (IEEE addition commutes, so the
            # bits are those of chunk + received). Only earlier steps (more than two ranks), or
            # an output that shares the input's storage, need a receive buffer of their own:
            # for two ranks that saves a chunk-sized allocation per reduce-scatter (16 MiB for
            # the 33.7M GPT's embedding, at the end of backward where stage 3 peaks on CPU).
            self._into_output = output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
            self._received = torch.empty_like(output) if self.size > 2 or not self._into_output else None
            # What we send next: first our own chunk, later the running sum, kept in one
            # buffer of our own so ``input`` is never modified. The buffer can be rewritten
            # in place because each step's send has completed before its add runs.
            self._running = self._chunk(input, self.rank - 1, n)
            self._sum = torch.empty_like(output) if self.size > 2 else None
        else:
            n = input.numel()
            mine = self._chunk(output, self.rank, n)
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input)
        if start:
            self._post()

    def _chunk(self, flat: torch.Tensor, index: int, n: int) -> torch.Tensor:
        index %= self.size
        return flat[index * n : (index + 1) * n]

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What this step sends and where what it receives lands."""
        if self.kind == "reduce_scatter":
            return self._running, self._receive_buffer()
        n = self.input.numel()
        return self._chunk(self.output, self.rank - self.step, n), self._chunk(self.output, self.rank - self.step - 1, n)

    def _post(self) -> None:
        send, recv = self._step_buffers()
        self._works = post_in_pieces(send, self.right, recv, self.left, self.group, self.tag)

    def receive_first(self) -> None:
        self._works = post_receives(self._step_buffers()[1], self.left, self.group, self.tag)

    def send_first(self) -> None:
        self._works += post_sends(self._step_buffers()[0], self.right, self.group, self.tag)

    def _finish_step(self) -> None:
        for work in self._works:
            work.wait()
        if self.kind == "reduce_scatter":
            n = self.output.numel()
            last = self.step == self.size - 2
            target = self.output if last else self._sum
            if target is None:  # _sum is made whenever a step comes before the last one (size > 2)
                raise RuntimeError(f"ring reduce-scatter step {self.step} of {self.size - 1} has no running-sum buffer")
            mine = self._chunk(self.input, self.rank - self.step - 2, n)
            if last and self._into_output:
                self.output.add_(mine)  # Note [receive into the output]
            else:
                torch.add(mine, self._receive_buffer(), out=target)
            self._running = target
        self.step += 1

    def _receive_buffer(self) -> torch.Tensor:
        """Where this step's incoming running sum lands (Note [receive into the output])."""
        if self.step == self.size - 2 and self._into_output:
            return self.output
        if self._received is None:
            raise InternalError(f"ring reduce-scatter step {self.step} of {self.size - 1} has no receive buffer")
        return self._received

    def wait(self) -> None:
        while self.step < self.size - 1:
            self._finish_step()
            if self.step < self.size - 1:
                self._post()

