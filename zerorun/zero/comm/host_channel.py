"""Reduce-scatter and all-gather through shared memory, for gloo ranks that share one host.

    pytest tests/distributed/test_cpu_collectives.py     # exactness at 2 and 3 ranks, a peer that exits

Why: the ring (comm/ring.py) moves every byte through the kernel's TCP loopback, and on a
CPU-bound host that CPU is taken from the ranks' own compute. Here a byte costs two memcpys
(our part into our outbox, the peer's out of its outbox): 33.6 MB between 2 ranks took 3.8-5.3
ms of CPU per rank against the ring's 8.6-10 (scripts/bench_collectives.py). Stage 3 moves up
to 1.5x DDP's bytes per step (all-gathers in forward and backward, a reduce-scatter, against
the all-reduce's reduce-scatter and all-gather), so on a CPU the transport decides whether it
keeps up with DDP.

Layout: every rank owns an outbox in /dev/shm of SLOTS slots of SLOT_BYTES each, mapped by
every rank of the group, and an inbox FIFO into which each peer writes one-byte tokens (the
sender's rank). Both files are unlinked as soon as every rank has opened them, within the
group's first reduce-scatter or all-gather: from then on nothing is left in /dev/shm however
the job ends. Before then, Note [shm cleanup] (comm/shm_names.py) says who unlinks them.

Note [rounds]: a collective is cut into rounds of at most one slot per rank; round t (counted
over the channel's whole life, identical on every rank because the collectives are issued in
the same order with the same sizes) uses slot t % 2. In round t a rank writes its part into
that slot, sends READY (one byte, its rank) to every peer, waits for READY from every peer and
reads their slots. Two slots need no other signal: a rank writes slot t % 2 only after READY
of round t-1 from every peer, and a peer sends that only once it has read everything of round
t-2, the last round that used the slot. Bytes from one sender arrive in the order sent, so
counting them says which round each belongs to.

Note [descriptor headers]: beside its data slots an outbox holds one 64-byte header per slot.
The first round of a collective writes this rank's descriptor of it (comm/agreement.py) into the
header of the slot it fills; after that round's READY every rank reads every peer's header and
compares before copying any peer's data out, so a mismatch is raised on every rank in the same
round, before any value is used (Note [collective agreement] in agreement.py). A collective
the channel does not carry sends its descriptor in a round of its own with no data (``check``).

Note [sum order]: a reduce-scatter adds the ranks' contributions in rank order, x0 + x1 + ...,
on every rank, so a reduced chunk has the same bits whichever rank reduced it (for 2 ranks,
the bits of the ring's own + received).

Collectives run on one worker thread per channel, in the order they were issued, as gloo runs
its own: ``wait()`` blocks until the worker has finished that one. A peer that exits while a
rank waits for its tokens is noticed within PEER_CHECK_S (its /proc entry is gone, or it is a
zombie) and the wait raises, naming the peer, as gloo's "connection closed" would.
"""

from __future__ import annotations

import mmap
import os
import queue
import secrets
import select
import socket
import struct
import sys
import tempfile
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.zero.comm import agreement, shm_names
from zerorun.zero.comm.agreement import HEADER_BYTES, Descriptor
from zerorun.zero.comm.shm_names import channel_wanted

SLOTS = 2  # Note [rounds]: exactly two
SLOT_BYTES = 1 << 20  # 2 slots per rank: 2 MiB of outbox, 4 MiB mapped by each of 2 ranks (2 MiB slots cost no less CPU)
PEER_CHECK_S = 1.0
MAX_RANKS = 256  # a token is the sender's rank in one byte
SHM_DIR = shm_names.SHM_DIR
_HEADER = 64  # the outbox's first bytes hold its owner's nonce, checked by every peer
_DATA = _HEADER + SLOTS * HEADER_BYTES  # then one descriptor header per slot (Note [descriptor headers])
_OUTBOX_BYTES = _DATA + SLOTS * SLOT_BYTES
_HEADER_FORMAT = f"<{agreement.HEADER_NUMEL}q"


class PeerExited(ZerorunError, RuntimeError):
    """A peer of a host channel exited while this rank waited for it. A zerorun error, so a
    surviving rank prints one line (the launcher names the rank that left and why), not a
    traceback through the channel's worker thread."""

    exit_code = 1


@dataclass(frozen=True)
class _Peer:
    rank: int  # in the group
    global_rank: int
    pid: int
    start_time: str  # /proc/<pid>/stat field 22: tells the peer from a later process with its pid


def host_channel(group) -> HostChannel | None:
    """The channel for ``group``, opened on first use (a collective over the group), or None on
    every rank when any of its ranks cannot share memory (another host, another /dev/shm or pid
    namespace, no room in /dev/shm, more than MAX_RANKS ranks, or ZERORUN_HOST_CHANNEL=0)."""
    key = dist.group.WORLD if group is None else group
    with _channels_lock:
        if key not in _channels:
            _channels[key] = _open(group)
        return _channels[key]


def close_host_channels(*, finished: bool = True) -> None:
    """Forget every channel (before its process group is destroyed). ``finished``: every
    collective is over, so the workers are joined and the files closed; otherwise (a rank
    failing) the workers are only told to stop after their current collective."""
    with _channels_lock:
        channels = [c for c in _channels.values() if c is not None]
        _channels.clear()
    for channel in channels:
        if finished:
            channel.close()
        else:
            channel.stop()


_channels: dict = {}
_channels_lock = threading.Lock()


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return fields[19]  # field 22 of stat(5); fields[0] is field 3


def _open(group) -> HostChannel | None:
    if not channel_wanted(os.environ):
        return None  # the user's choice: nothing to say
    size = dist.get_world_size(group)
    if size < 2:
        return None  # one rank: nothing to move
    cannot = (f"is one of {size} ranks, more than the channel's {MAX_RANKS}" if size > MAX_RANKS
              else None if os.path.isdir(SHM_DIR) else f"finds no {SHM_DIR}")
    can = cannot is None
    if can:
        shm_names.remove_stale(SHM_DIR)
    # Note [shm cleanup]: nothing is created until every rank is here, so a rank that fails
    # before its first collective leaves its peers waiting in this barrier with no file made.
    # Every rank runs the same collectives whatever it can do (a rank that skipped one would
    # pair its next with another's and hang).
    dist.barrier(group=group)
    created: list[str] = []
    try:
        mine: dict = {"host": socket.gethostname()}
        try:
            if not can:
                raise OSError(cannot)
            nonce = secrets.token_hex(8)
            fd, outbox_path = tempfile.mkstemp(prefix=shm_names.outbox_prefix(), dir=SHM_DIR)
            created.append(outbox_path)
            with os.fdopen(fd, "r+b") as outbox:
                # Reserve the pages now: a sparse file on a full tmpfs would pass here and
                # raise SIGBUS at the first write into a slot, mid-training.
                os.posix_fallocate(outbox.fileno(), 0, _OUTBOX_BYTES)
                outbox.write(nonce.encode())
            inbox_path = shm_names.inbox_path(outbox_path)
            os.mkfifo(inbox_path, 0o600)
            created.append(inbox_path)
            mine.update(outbox=outbox_path, inbox=inbox_path, nonce=nonce, pid=os.getpid(),
                        start_time=_proc_start_time(os.getpid()))
        except Exception as exc:  # whatever fails here, this rank must still reach the agreements below
            mine["error"] = cannot or f"cannot make its files in {SHM_DIR} ({_why(exc)})"
        return _agree(group, size, mine)
    finally:
        for path in created:  # every rank has opened them, given up, or failed: unlink
            try:
                os.unlink(path)
            except OSError:
                pass


def _agree(group, size: int, mine: dict) -> HostChannel | None:
    """Exchange what each rank made, open the channel where every rank made its part, and agree
    that every rank opened it; else None on every rank, and the group's first rank says why."""
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    channel, error = None, None
    if not any("error" in info for info in everyone):
        try:
            channel = HostChannel(group, dist.get_rank(group), everyone)
        except Exception as exc:  # as above: a rank that skipped the next agreement would hang the others
            channel, error = None, f"cannot open the others' files ({_why(exc)})"
    try:
        opened: list = [None] * size
        dist.all_gather_object(opened, error, group=group)
    except BaseException:
        if channel is not None:
            channel.close()
        raise
    if channel is not None and any(opened):
        channel.close()
        channel = None
    if channel is None and dist.get_rank(group) == 0:
        _say_ring(group, size, everyone, opened)
    return channel


# Note [the ring, said once]: where ranks that share a host cannot share memory, their
# collectives take the ring (TCP loopback), about twice the CPU per byte (see above): slower,
# never wrong, so it is no error, but it used to happen without a word. The group's first rank
# says it once when the group opens its channel (its first collective), naming the first rank
# that could not and why. Ranks on several hosts take the ring by design: nothing is said.
def _say_ring(group, size: int, everyone: list, opened: list) -> None:
    if len({info["host"] for info in everyone}) > 1:
        return
    failed = [(r, info["error"]) for r, info in enumerate(everyone) if "error" in info]
    failed += [(r, why) for r, why in enumerate(opened) if why]
    if not failed:
        return
    rank, why = failed[0]
    global_rank = rank if group is None else dist.get_global_rank(group, rank)
    ranks = "the job's ranks" if group is None or size == dist.get_world_size() else f"a group of {size} ranks"
    print(f"zerorun: note: {ranks} on this host move their collectives through the ring (TCP loopback), not "
          f"shared memory: rank {global_rank} {why}", file=sys.stderr, flush=True)


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return str(exc)[:200] or type(exc).__name__


class HostChannel:
    """The mapped outboxes and FIFOs of one group's ranks, and the worker that runs its collectives."""

    def __init__(self, group, rank: int, everyone: list[dict]):
        self.rank, self.size = rank, len(everyone)
        # the group's outbox and inbox paths, unlinked once every rank has opened them
        self.files = [path for info in everyone for path in (info["outbox"], info["inbox"])]
        self._token = bytes([rank])  # READY, Note [rounds]
        global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.global_ranks = [global_rank(r) for r in range(self.size)]
        # Each rank's outbox, mapped; viewed as tensors only for the length of a round, so the
        # channel holds no tensor between collectives (a transport's buffer, like gloo's socket
        # buffers or NCCL's, outside what a count of live tensors sees; peak RSS counts it).
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self.peers: list[_Peer] = []
        try:
            for r, info in enumerate(everyone):
                with open(info["outbox"], "r+b") as outbox:
                    mapped = mmap.mmap(outbox.fileno(), _OUTBOX_BYTES)
                self._maps.append(mapped)
                if mapped[: len(info["nonce"])] != info["nonce"].encode():
                    raise OSError(f"rank {r}'s outbox is another file here (another /dev/shm)")
                if r == rank:
                    # O_RDWR: reads block instead of seeing end-of-file while no peer has it open
                    self.inbox = os.open(info["inbox"], os.O_RDWR)
                    self._fds.append(self.inbox)
                else:
                    if _proc_start_time(info["pid"]) != info["start_time"] or info["start_time"] is None:
                        raise OSError(f"rank {r}'s process is not visible from here (another pid namespace)")
                    self.peers.append(_Peer(r, global_rank(r), info["pid"], info["start_time"]))
            self.outbox_of: dict[int, int] = {}
            for p in self.peers:
                self.outbox_of[p.rank] = os.open(everyone[p.rank]["inbox"], os.O_WRONLY)
                self._fds.append(self.outbox_of[p.rank])
        except (OSError, ValueError):
            self.close()
            raise
        self.ready = dict.fromkeys(self.outbox_of, 0)  # tokens received and not yet used, by sender
        self.round = 0
        self._pending: Descriptor | None = None  # to send with the next round (the first of a collective)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name="zerorun-host-channel", daemon=True)
        self._worker.start()

    # -- the caller's side ----------------------------------------------------------------------
    def submit(self, kind: str, output: torch.Tensor | None, input: torch.Tensor | None, seq: int,
               descriptor: Descriptor | None = None) -> Transfer:
        """``kind``: all_gather, reduce_scatter, or check (a round with ``descriptor`` alone).
        With a descriptor, the ranks compare theirs first (Note [descriptor headers])."""
        transfer = Transfer(kind, output, input, seq, descriptor)
        if self._failure is not None:
            transfer.fail(self._failure)
        else:
            self._jobs.put(transfer)
        return transfer

    def stop(self) -> None:
        if getattr(self, "_worker", None) is not None:
            self._jobs.put(None)

    def close(self) -> None:
        self.stop()
        if getattr(self, "_worker", None) is not None:
            self._worker.join(timeout=PEER_CHECK_S)
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        for mapped in self._maps:
            try:
                mapped.close()
            except BufferError:  # a round's view is still alive: the mapping goes with the process
                pass
        self._maps = []

    # -- the worker -----------------------------------------------------------------------------
    def _run(self) -> None:
        while (transfer := self._jobs.get()) is not None:
            if self._failure is not None:
                transfer.fail(self._failure)
                continue
            try:
                self._pending = transfer.descriptor
                if transfer.kind == "check" or transfer.input.numel() == 0:
                    self._exchange_ready()  # the descriptors alone
                elif transfer.kind == "all_gather":
                    self._all_gather(transfer.output, transfer.input)
                else:
                    self._reduce_scatter(transfer.output, transfer.input)
            except BaseException as err:  # handed to the waiting caller
                # a peer that left, a mismatch: one line of their own (zerorun errors)
                self._failure = err if isinstance(err, ZerorunError) else RuntimeError(
                    f"host channel {transfer.kind} #{transfer.seq} failed: {err}")
                transfer.fail(self._failure)
                continue
            transfer.finish()

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = input.numel()
        mine = output[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        per_round = SLOT_BYTES // input.element_size()
        for start in range(0, n, per_round):
            stop = min(n, start + per_round)
            slot = self.round % SLOTS
            self._slot(self.rank, slot, input.dtype, stop - start).copy_(input[start:stop])
            self._exchange_ready()
            for p in self.peers:
                output[p.rank * n + start : p.rank * n + stop].copy_(self._slot(p.rank, slot, input.dtype, stop - start))

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = output.numel()
        # each slot holds one part per peer, 64-byte aligned
        part_bytes = (SLOT_BYTES // (self.size - 1)) // 64 * 64
        per_round = part_bytes // input.element_size()
        aliased = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        for start in range(0, n, per_round):
            stop = min(n, start + per_round)
            count = stop - start
            slot = self.round % SLOTS
            for p in self.peers:
                part = (p.rank - self.rank - 1) % self.size
                self._slot(self.rank, slot, input.dtype, count, part * part_bytes).copy_(
                    input[p.rank * n + start : p.rank * n + stop])
            self._exchange_ready()
            mine = input[self.rank * n + start : self.rank * n + stop]
            contributions = [
                (mine.clone() if aliased else mine) if r == self.rank
                else self._slot(r, slot, input.dtype, count, ((self.rank - r - 1) % self.size) * part_bytes)
                for r in range(self.size)
            ]
            target = output[start:stop]
            torch.add(contributions[0], contributions[1], out=target)  # Note [sum order]
            for later in contributions[2:]:
                target.add_(later)

    def _slot(self, owner: int, slot: int, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
        return torch.frombuffer(self._maps[owner], dtype=dtype, count=count,
                                offset=_DATA + slot * SLOT_BYTES + offset)

    def _exchange_ready(self) -> None:
        """Note [rounds]: tell every peer our slot is written, wait until theirs are. The
        collective's first round carries its descriptor (Note [descriptor headers]), checked
        here before the caller reads any peer's data."""
        descriptor, self._pending = self._pending, None
        header = _HEADER + (self.round % SLOTS) * HEADER_BYTES
        if descriptor is not None:
            struct.pack_into(_HEADER_FORMAT, self._maps[self.rank], header, *descriptor.encode())
        self._send(self._token)
        for p in self.peers:
            self._take_ready(p)
        self.round += 1
        if descriptor is not None:
            agreement.check([descriptor if r == self.rank
                             else Descriptor.decode(list(struct.unpack_from(_HEADER_FORMAT, self._maps[r], header)))
                             for r in range(self.size)], self.global_ranks)

    def _send(self, token: bytes) -> None:
        for p in self.peers:
            try:
                os.write(self.outbox_of[p.rank], token)
            except BrokenPipeError:  # its inbox has no reader left: the peer is gone
                self._check_peers()
                raise PeerExited(f"rank {p.global_rank} (pid {p.pid}) closed its inbox during a collective") from None

    def _take_ready(self, peer: _Peer) -> None:
        """Use one READY from ``peer``, reading the inbox until one is there."""
        while self.ready[peer.rank] == 0:
            readable, _, _ = select.select([self.inbox], [], [], PEER_CHECK_S)
            if not readable:
                self._check_peers()
                continue
            for sender in os.read(self.inbox, 4096):
                self.ready[sender] += 1
        self.ready[peer.rank] -= 1

    def _check_peers(self) -> None:
        for p in self.peers:
            if _proc_start_time(p.pid) != p.start_time:
                raise PeerExited(
                    f"rank {p.global_rank} (pid {p.pid}) exited while this rank waited for it in a collective")


class Transfer:
    """One issued collective: ``wait()`` returns when the worker has finished it, or raises what stopped it."""

    __slots__ = ("kind", "output", "input", "seq", "descriptor", "_done", "_error")

    def __init__(self, kind: str, output: torch.Tensor | None, input: torch.Tensor | None, seq: int,
                 descriptor: Descriptor | None = None):
        self.kind, self.output, self.input, self.seq, self.descriptor = kind, output, input, seq, descriptor
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self) -> None:
        self.output = self.input = None  # the caller owns them again
        self._done.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self.finish()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def usable(output: torch.Tensor, input: torch.Tensor) -> bool:
    """The channel moves contiguous CPU tensors of one dtype."""
    return (output.device.type == "cpu" and output.is_contiguous() and input.is_contiguous()
            and output.dtype == input.dtype)

