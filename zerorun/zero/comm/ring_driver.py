"""A thread per group that runs its point-to-point collectives while the caller computes.

    pytest tests/distributed/test_cpu_collectives.py -k "ring or driver" tests/distributed/test_collective_agreement.py

Used for gloo groups whose ranks cannot share memory (other hosts, other namespaces,
ZERORUN_HOST_CHANNEL=0): the ring's reduce-scatter and all-gather (comm/ring.py) and qgZ's
exchange (comm/quantized_exchange.py).

Note [ring progress]: a ring of N ranks moves its bytes in N-1 steps, each posted only when the
one before has arrived. Posted from the caller, only the first step moved while the caller
computed; the others waited for ``wait()``, so between hosts (3 ranks or more, and every
collective queued behind them) the link idled while the model computed. Here one worker thread
per group runs each collective to its end, in issue order, the way the host channel's worker
does (comm/host_channel.py): ``submit`` returns at once, and ``wait()`` only waits for the
worker. gloo's point-to-point waits release the GIL, so the worker's transfers overlap the
caller's compute whatever the ring's length.

Note [headers in band]: before any byte of a collective moves, the worker sends this rank's
descriptor of it (comm/agreement.py, 8 int64) to every peer and receives theirs, point to point
under a header tag of the collective's sequence number, and compares them (Note [collective
agreement]). The headers have one size whatever the collective, so ranks in different
collectives still exchange them, and a mismatch is raised on every rank before data moves.
Before this, the descriptors went apart, in a gloo all-gather waited by the caller before the
collective was issued: between hosts that all-gather queued behind the bytes already in flight
on the link, so the caller blocked at every issue until the link drained, and a prefetch could
not overlap anything (stage 3 on a 300 Mbit/s link took compute plus link time, not their
maximum). A collective the worker does not run (an all-reduce, a broadcast, a barrier: gloo's
own, issued by the caller) sends its descriptor in a header-only job, waited before it is
issued (``check``); as the worker runs jobs in issue order, that wait also orders it after every
ring collective issued before it.

The worker issues no gloo collective, only sends and receives with tags: gloo's collectives
(the caller's, or a script's own ``dist.all_reduce``) are numbered by the order of their calls,
and a second thread calling them would number them differently on different ranks. Sends and
receives match by (peer, tag) alone, so they cannot pair with a collective.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.zero.comm import agreement
from zerorun.zero.comm.agreement import Descriptor
from zerorun.zero.comm.host_channel import Transfer

# Note [headers in band]: tags are 31-bit; the top bit of the 30 kept apart marks a header, so a
# collective's header and its data never share a tag (their sizes differ).
_SEQ_MASK = 0x3FFF_FFFF
_HEADER_TAG = 0x4000_0000


def data_tag(seq: int) -> int:
    return seq & _SEQ_MASK


def header_tag(seq: int) -> int:
    return (seq & _SEQ_MASK) | _HEADER_TAG


class Job(Transfer):
    """One collective for the worker: its descriptor (None: none to check) and what moves its
    bytes, ``start(tag)`` returning an object whose ``wait()`` completes it (None: a check alone)."""

    __slots__ = ("start",)

    def __init__(self, kind: str, seq: int, descriptor: Descriptor | None, start: Callable[[int], object] | None):
        super().__init__(kind, None, None, seq, descriptor)
        self.start = start


class RingDriver:
    """The worker of one group (Note [ring progress])."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.size)]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="zerorun-ring-driver", daemon=True)
        self._worker.start()

    def submit(self, kind: str, seq: int, descriptor: Descriptor | None,
               start: Callable[[int], object] | None) -> Job:
        job = Job(kind, seq, descriptor, start)
        if self._failure is not None:
            job.fail(self._failure)
        else:
            self._jobs.put(job)
        return job

    def close(self, *, finished: bool = True) -> None:
        """Stop the worker after the jobs already submitted; ``finished``: wait for it."""
        self._jobs.put(None)
        if finished:
            self._worker.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._failure is not None:
                job.fail(self._failure)
                continue
            try:
                if job.descriptor is not None:
                    self._agree(job.seq, job.descriptor)
                if job.start is not None:
                    job.start(data_tag(job.seq)).wait()  # a Ring or an Exchange
            except BaseException as err:  # handed to the waiting caller; the group is unusable after it
                self._failure = err if isinstance(err, ZerorunError) else RuntimeError(
                    f"{job.kind} #{job.seq} between hosts failed: {err}")
                job.fail(self._failure)
                continue
            job.finish()

    def _agree(self, seq: int, descriptor: Descriptor) -> None:
        """Note [headers in band]: every rank's descriptor of this collective, then the check."""
        mine = torch.tensor(descriptor.encode(), dtype=torch.int64)
        theirs = torch.empty(self.size, agreement.HEADER_NUMEL, dtype=torch.int64)
        tag = header_tag(seq)
        works = []
        for r in range(self.size):
            if r != self.rank:
                works.append(dist.irecv(theirs[r], self.global_ranks[r], group=self.group, tag=tag))  # Note [receives first]
                works.append(dist.isend(mine, self.global_ranks[r], group=self.group, tag=tag))
        for work in works:
            if work is not None:  # torch types these Optional; gloo always returns a work
                work.wait()
        agreement.check([descriptor if r == self.rank else Descriptor.decode(theirs[r].tolist())
                         for r in range(self.size)], self.global_ranks)


_drivers: dict = {}
_drivers_lock = threading.Lock()


def ring_driver(group) -> RingDriver:
    """The worker for ``group``, started at its first point-to-point collective."""
    key = dist.group.WORLD if group is None else group
    with _drivers_lock:
        driver = _drivers.get(key)
        if driver is None:
            driver = _drivers[key] = RingDriver(group)
        return driver


def close_ring_drivers(*, finished: bool = True) -> None:
    """Stop every worker (before its process group is destroyed). ``finished``: every collective
    is over, so wait for the workers; otherwise (a rank failing) only tell them to stop."""
    with _drivers_lock:
        drivers = list(_drivers.values())
        _drivers.clear()
    for driver in drivers:
        driver.close(finished=finished)
