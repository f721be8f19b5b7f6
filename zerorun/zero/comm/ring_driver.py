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

Note [receives ahead]: a collective's bytes start to move a round trip after both its header
exchange and its receives are posted (gloo sends a message only once its receiver has said it
may), and on a link with latency that round trip, paid by every one of a stage-3 step's 50-odd
collectives, left the link idle between them: at 300 Mbit/s the 33.7M GPT's forward took 2.3 s
for 1.9 s of bytes. So while one collective's bytes move, the worker posts the next queued
collective's header exchange and the receives of its first step; its sends wait for its check,
as before. Receiving early is safe: no rank sends a byte of a collective before every rank's
header matched, so nothing of another size can arrive into a receive posted ahead, and after a
mismatch those receives are left unfilled on the way out.

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

from zerorun.errors import InternalError, ZerorunError
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
    bytes, ``start(tag)`` returning a Ring or an Exchange built with nothing posted (None: a
    check alone)."""

    __slots__ = ("start",)

    def __init__(self, kind: str, seq: int, descriptor: Descriptor | None, start: Callable[[int], object] | None):
        super().__init__(kind, None, None, seq, descriptor)
        self.start = start


class _Posted:
    """A job whose header exchange and first receives are posted (Note [receives ahead])."""

    __slots__ = ("job", "headers", "theirs", "transfer")

    def __init__(self, job: Job, headers: list, theirs: torch.Tensor | None, transfer):
        self.job, self.headers, self.theirs, self.transfer = job, headers, theirs, transfer


class RingDriver:
    """The worker of one group (Note [ring progress])."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.global_ranks = [r if group is None else dist.get_global_rank(group, r) for r in range(self.size)]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._stopping = False
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
        ahead: _Posted | None = None
        while True:
            posted: _Posted | None = ahead
            ahead = None
            if posted is None:
                job = self._jobs.get()
                if job is None:
                    return
                posted = self._post(job)
                if posted is None:
                    continue
            try:
                if posted.job.descriptor is not None:
                    self._check(posted)
                if posted.transfer is not None:
                    posted.transfer.send_first()
                ahead = self._look_ahead()
                if posted.transfer is not None:
                    posted.transfer.wait()
            except BaseException as err:  # handed to the waiting caller; the group is unusable after it
                failure = self._fail(posted.job, err)
                if ahead is not None:
                    ahead.job.fail(failure)
                    ahead = None
                continue
            posted.job.finish()

    def _look_ahead(self) -> _Posted | None:
        """The next job, posted now if it is already queued (Note [receives ahead])."""
        if self._stopping:
            return None
        try:
            job = self._jobs.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._stopping = True
            self._jobs.put(None)  # seen again by the loop once the current job is done
            return None
        return self._post(job)

    def _post(self, job: Job) -> _Posted | None:
        """Post ``job``'s header exchange and the receives of its first step; None when it
        failed (the group failed before it, or posting did)."""
        if self._failure is not None:
            job.fail(self._failure)
            return None
        try:
            headers, theirs = [], None
            if job.descriptor is not None:
                mine = torch.tensor(job.descriptor.encode(), dtype=torch.int64)
                theirs = torch.empty(self.size, agreement.HEADER_NUMEL, dtype=torch.int64)
                tag = header_tag(job.seq)
                for r in range(self.size):
                    if r != self.rank:  # Note [receives first] (comm/ring.py)
                        headers.append(dist.irecv(theirs[r], self.global_ranks[r], group=self.group, tag=tag))
                        headers.append(dist.isend(mine, self.global_ranks[r], group=self.group, tag=tag))
            transfer = job.start(data_tag(job.seq)) if job.start is not None else None
            if transfer is not None:
                transfer.receive_first()  # type: ignore[attr-defined]  # a Ring or an Exchange
            return _Posted(job, headers, theirs, transfer)
        except BaseException as err:
            self._fail(job, err)
            return None

    def _check(self, posted: _Posted) -> None:
        """Note [headers in band]: every rank's descriptor of this collective, compared."""
        for work in posted.headers:
            if work is not None:  # torch types these Optional; gloo always returns a work
                work.wait()
        descriptor, theirs = posted.job.descriptor, posted.theirs
        if descriptor is None or theirs is None:
            raise InternalError(f"{posted.job.kind} #{posted.job.seq} has no headers to check")
        agreement.check([descriptor if r == self.rank else Descriptor.decode(theirs[r].tolist())
                         for r in range(self.size)], self.global_ranks)

    def _fail(self, job: Job, err: BaseException) -> BaseException:
        failure = err if isinstance(err, ZerorunError) else RuntimeError(f"{job.kind} #{job.seq} between hosts failed: {err}")
        self._failure = failure
        job.fail(failure)
        return failure


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
