"""ZeRO++'s collectives, built on the plain ones of collectives.py: qwZ's quantized all-gather,
qgZ's quantized reduce-scatter (Note [quantized collectives]) and hpZ's hierarchical
reduce-scatter (Note [hierarchical reduce-scatter]).

    pytest tests/distributed/test_quantized_collectives.py tests/distributed/test_hpz.py

Each issues its bytes through collectives.py (``collectives.all_gather``, ``reduce_scatter``,
``_issue``), so the observers, the ranks' agreement and the link split see them as any other
collective; calls go through the module, so what replaces one of its functions (a test's
counter) sees them too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerorun.zero.comm import collectives


# --- hpZ: the hierarchical reduce-scatter ----------------------------------------------------


class _Chained:
    """Two collectives, the second issued once the first is done (when the first is waited)."""

    __slots__ = ("_first", "_then", "_second", "_buffers")

    def __init__(self, first, then, buffers: tuple):
        self._first, self._then, self._second = first, then, None
        self._buffers = buffers  # what the first reads, alive until it is done

    def wait(self, **_unused) -> None:
        second = self._second
        if second is None:
            self._first.wait()
            self._buffers = ()
            second = self._second = self._then()
        second.wait()

    def finished_on_device(self) -> bool:
        return False  # the second is issued by the waiting thread: in flight until waited


def hierarchical_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, within, across,
                                async_op: bool = False, unit: tuple[int, int] | None = None):
    """reduce_scatter over the world as two: within the host, then across hosts.

    Note [hierarchical reduce-scatter]: with hpZ's groups (process_group.partition_groups: L
    consecutive ranks per host, H hosts) a world reduce-scatter of ``input`` (world x n
    elements, rank h*L + l receives chunk h*L + l) runs as a reduce-scatter within the host
    over ``input`` reordered as [L, H, n] (rank l receives, summed over its host, the H chunks
    of local index l), then one across hosts among the ranks of local index l over those H
    chunks (rank h receives chunk h*L + l summed over every host). Each rank sends (L-1)/L of
    the buffer within its host and (H-1)/H of 1/L of it between hosts: 1/4 of the buffer for
    2 hosts x 2, where the flat ring's ranks send 3/8 on average. The reorder is one copy of
    the buffer. The sum is taken in another order than the flat ring's (each host's ranks
    first), so fp32 results differ from it in the last bits: |difference| <= 2 (N-1) eps
    sum_r |x_r| per element (N ranks), as between any two summation orders."""
    size_within, size_across = collectives.group_size(within), collectives.group_size(across)
    n = output.numel()
    staged = input[: size_across * size_within * n].view(size_across, size_within, n).transpose(0, 1).contiguous()
    partial = torch.empty(size_across * n, dtype=input.dtype, device=input.device)
    first = collectives.reduce_scatter(partial, staged.view(-1), group=within, async_op=True, unit=unit)
    handle = _Chained(first, lambda: collectives.reduce_scatter(output, partial, group=across, async_op=True, unit=unit),
                      (staged,))
    if not async_op:
        handle.wait()
    return handle


# --- qwZ and qgZ: quantized collectives ------------------------------------------------------
# Note [quantized collectives]: a separate call path, taken only when the config asks for qwZ
# (stage 3's parameter gathers) or qgZ (gradient reduce-scatters). Both cut the tensor into
# blocks quantized to int8 with one fp32 scale each (quantize.py, Note [packed layout]) and move
# that packed buffer instead of the tensor:
# - all-gather (qwZ): each rank packs its own shard and the packed shards are all-gathered by
#   the ordinary collectives.all_gather (host channel, ring or gloo); ``wait()`` unpacks every
#   rank's part, this rank's included, into ``output``, so every rank computes with the same
#   rounded weights while its shard (the fp32 master in fp32 training) stays exact.
# - reduce-scatter (qgZ): each rank packs the N-1 chunks that other ranks own and sends each to
#   its owner (point to point, comm/quantized_exchange.py); ``wait()`` dequantizes what arrived
#   and sums it with this rank's own, unquantized, chunk in fp32, in rank order. Per element the
#   error is at most the sum over the other ranks r of s_r / 2 (s_r: rank r's block scale, its
#   block's max |g| / 127), plus fp32 rounding of the sum.
# World size 1 issues nothing and rounds nothing, as every collective here.


class QuantizedHandle:
    """An issued quantized collective: ``wait()`` waits for the bytes, then unpacks them once."""

    __slots__ = ("_inner", "_finish")

    def __init__(self, inner, finish):
        self._inner, self._finish = inner, finish

    def wait(self, **_unused) -> None:
        if self._finish is None:
            return
        self._inner.wait()
        finish, self._finish = self._finish, None
        finish()

    def finished_on_device(self) -> bool:
        return False  # unpacking is host-issued work: in flight until waited


def quantized_all_gather(output: torch.Tensor, input: torch.Tensor, *, group, block: int,
                         async_op: bool = False, unit: tuple[int, int] | None = None):
    """all_gather with every rank's part block-quantized on the way (Note [quantized collectives])."""
    from zerorun.zero.comm import quantize

    size = collectives.group_size(group)
    if size == 1:
        return collectives.all_gather(output, input, group=group, async_op=async_op, unit=unit)
    rank, n = dist.get_rank(group), input.numel()
    part = quantize.packed_nbytes(n, block)
    packed = torch.empty(size * part, dtype=torch.uint8, device=input.device)
    mine = packed[rank * part : (rank + 1) * part]
    quantize.pack(input, block, mine)  # before the issue: ``input`` may be a slice of ``output``
    inner = collectives.all_gather(packed, mine, group=group, async_op=True, unit=unit)  # the packed bytes' descriptor

    def finish() -> None:
        for r in range(size):
            quantize.unpack(packed[r * part : (r + 1) * part], block, output[r * n : (r + 1) * n])

    handle = QuantizedHandle(inner, finish)
    if not async_op:
        handle.wait()
    return handle


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group, block: int,
                             async_op: bool = False, unit: tuple[int, int] | None = None):
    """reduce_scatter with the chunks other ranks own block-quantized (Note [quantized collectives])."""
    from zerorun.zero.comm import quantize
    size = collectives.group_size(group)
    if size == 1:
        return collectives.reduce_scatter(output, input, group=group, async_op=async_op, unit=unit)
    rank, n = dist.get_rank(group), output.numel()
    part = quantize.packed_nbytes(n, block)
    send = torch.empty(size * part, dtype=torch.uint8, device=input.device)
    for r in range(size):
        if r != rank:
            quantize.pack(input[r * n : (r + 1) * n], block, send[r * part : (r + 1) * part])
    own = input[rank * n : (rank + 1) * n].float()  # read now: the caller may reuse ``input`` after wait()
    received = torch.empty_like(send)
    inner = collectives.exchange("reduce_scatter_q", send, received, part, group=group, async_op=True, unit=unit,
                                 described=input)

    def finish() -> None:
        total = torch.zeros(n, dtype=torch.float32, device=output.device)
        scratch = torch.empty(n, dtype=torch.float32, device=output.device)
        for r in range(size):  # rank order: the same sum whichever rank computes it
            total += own if r == rank else quantize.unpack(received[r * part : (r + 1) * part], block, scratch)
        output.copy_(total)

    handle = QuantizedHandle(inner, finish)
    if not async_op:
        handle.wait()
    return handle
