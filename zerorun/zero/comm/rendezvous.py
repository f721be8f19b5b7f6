"""The job's rendezvous: a store whose every value proves the launch's secret, bound to the job's
address, and a proof between every pair of ranks before any tensor moves.

Used by comm/process_group.py (the engine's group) and deepspeed/comm.py (``init_distributed``)
when the launcher asked for it (ZERORUN_RENDEZVOUS=signed beside ZERORUN_RUN_TOKEN); tests:
tests/unit/test_rendezvous_signing.py, tests/e2e/test_rendezvous.py.

Note [authenticated rendezvous]: torch's env:// rendezvous is a TCPStore on MASTER_PORT that
anyone who can reach the port may read (``list_keys``) and write, with no authentication, and
gloo then connects every pair of ranks to the addresses the store holds. Another local user who
connected before the last rank joined became that rank and received rank 0's whole model from
the initial broadcast. Now, with a secret every rank of the launch holds (the run token, which
travels to the agents on their stdin, never on a command line):

1. Rank 0 listens on the job's address only where that is all the job needs (a loopback
   MASTER_ADDR: a single-host job), and so does gloo (GLOO_SOCKET_IFNAME, unless the user set it);
   a multi-host job listens on every interface, as torch does, and relies on 2 and 3.
2. Every value written to the store carries an HMAC-SHA256 of its key and value under the secret
   (``SignedStore``); a value read is used only if its tag proves the secret. An impostor can
   still read the store (gloo's addresses, nothing secret) but cannot plant an address, so it
   cannot place itself between two ranks. A forged value ends the job at once, naming it.
3. Gloo accepts any connection that names a pair's sequence number, which is guessable, so an
   impostor could still take a pair's place by connecting first. So after the group forms, and
   before any other tensor moves, every rank challenges every other with 16 random bytes and
   checks the HMAC of its answer (``prove_peers``), bound to both ranks' numbers so no answer
   serves another pair. An impostor in a pair's place receives one random challenge, nothing
   else, and the rank that met it ends the job naming what happened.
4. After that, rank 0 counts the store's keys whose values prove nothing (``foreign_keys``):
   a process that wrote to the store without the secret is named in one warning line.

The checksum-free counters of the store (``add``) are left as torch uses them: a forged count can
only stall the rendezvous, which the start-up timeout then reports. The cost is measured in
docs/launch.md (one store round trip per key and two tiny messages per pair).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import sys
from collections.abc import Mapping

import torch
import torch.distributed as dist

from zerorun.errors import RendezvousError
from zerorun.worker.launch_env import RENDEZVOUS_MODE_ENV as MODE_ENV
from zerorun.worker.launch_env import RUN_TOKEN_ENV as TOKEN_ENV
_TAG = 32  # bytes of an HMAC-SHA256
_CHALLENGE = 16
PROOF_TIMEOUT_S = 120.0


def secret_for(environ: Mapping[str, str]) -> bytes | None:
    """The launch's secret when the launcher asked for a signed rendezvous, else None."""
    token = environ.get(TOKEN_ENV, "")
    if environ.get(MODE_ENV) != "signed" or not token:
        return None
    return hashlib.sha256(f"zerorun-rendezvous:{token}".encode()).digest()


def mac(secret: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists share an encoding)."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


class SignedStore(dist.Store):
    """A store whose values carry an HMAC of (key, value) under the secret (Note [authenticated
    rendezvous], 2). ``forged`` names the first key whose value proved nothing."""

    def __init__(self, inner, secret: bytes, where: str):
        super().__init__()
        self.inner, self.secret, self.where = inner, secret, where
        self.forged: str | None = None

    def _sign(self, key: str, value) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return mac(self.secret, "value", key, data) + data

    def _open(self, key: str, raw) -> bytes:
        raw = bytes(raw)
        tag, data = raw[:_TAG], raw[_TAG:]
        if len(raw) < _TAG or not hmac.compare_digest(tag, mac(self.secret, "value", key, data)):
            self.forged = self.forged or key
            raise RendezvousError(f"the rendezvous at {self.where} holds a value for {key!r} written by something "
                                  "that does not know this launch's secret", hint=INTRUDER_HINT)
        return data

    def set(self, key, value):
        self.inner.set(key, self._sign(key, value))

    def get(self, key):
        return self._open(key, self.inner.get(key))

    def multi_set(self, keys, values):
        self.inner.multi_set(keys, [self._sign(k, v) for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys):
        return [self._open(k, v) for k, v in zip(keys, self.inner.multi_get(keys), strict=True)]

    def compare_set(self, key, expected, desired):
        raise RendezvousError(f"compare_set({key!r}) on the signed rendezvous is not supported")

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


INTRUDER_HINT = ("a process outside this job connected to its rendezvous port; it was given nothing. Find it "
                 "with `ss -tnp`; only ranks started by this launch hold its secret")


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface (IFF_LOOPBACK; "lo" on Linux)."""
    import fcntl
    import struct

    siocgifflags, iff_loopback = 0x8913, 0x8
    for _, name in socket.if_nameindex():
        with socket.socket() as sock:
            try:
                request = struct.pack("16sh", name.encode()[:15], 0)
                flags = struct.unpack("16sh", fcntl.ioctl(sock.fileno(), siocgifflags, request))[1]
            except OSError:
                continue
        if flags & iff_loopback:
            return name
    return None


def open_store(addr: str, port: int, rank: int, world_size: int, secret: bytes,
               timeout: datetime.timedelta) -> SignedStore:
    """Rank 0 serves, the others connect (Note [authenticated rendezvous], 1 and 2)."""
    listen_fd = None
    if rank == 0 and is_loopback(addr):
        listen_fd = _listen(addr, port)
    if is_loopback(addr) and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _loopback_interface()
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface  # gloo's own listeners on loopback too
    inner = dist.TCPStore(addr, port, world_size, rank == 0, timeout, wait_for_workers=False,
                          master_listen_fd=listen_fd)
    store = SignedStore(inner, secret, f"{addr}:{port}")
    # torch keeps only the C++ half of a Python store: without a Python reference its methods are
    # gone ("fn INTERNAL ASSERT FAILED ... Not implemented" at the next new_group).
    _LIVE_STORES.append(store)
    return store


_LIVE_STORES: list[SignedStore] = []


def _listen(addr: str, port: int) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if addr == "localhost" else addr, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise RendezvousError(f"rank 0 cannot listen on {addr}:{port} for the rendezvous ({exc.strerror})",
                              hint="another process holds that port; pass another --master-port") from None
    return sock.detach()


def init_signed(backend: str, rank: int, world_size: int, secret: bytes, timeout=None) -> None:
    """``init_process_group`` over the signed store, then ``prove_peers`` (Note [authenticated
    rendezvous]); raises RendezvousError naming an intruder."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    wait = timeout or datetime.timedelta(minutes=30)
    store = open_store(addr, port, rank, world_size, secret, wait)
    try:
        if timeout is None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except RendezvousError:
        raise
    except Exception as exc:
        if store.forged:  # the C++ side wrapped our refusal: say it in our words
            raise RendezvousError(f"rank {rank}: the rendezvous at {store.where} holds a value for {store.forged!r} "
                                  "written by something that does not know this launch's secret",
                                  hint=INTRUDER_HINT) from None
        raise exc
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    prove_peers(rank, world_size, secret, device, store.where)
    if rank == 0:
        foreign = foreign_keys(store)
        if foreign:
            print(f"zerorun: warning: rank 0: {foreign} key(s) of this job's rendezvous at {store.where} were written "
                  "by something that does not know the launch's secret; it was not admitted and was given nothing",
                  file=sys.stderr, flush=True)


def prove_peers(rank: int, world_size: int, secret: bytes, device: torch.device, where: str,
                timeout_s: float = PROOF_TIMEOUT_S) -> None:
    """Note [authenticated rendezvous], 3: every pair of ranks proves the secret to each other
    over the very connection the group will use, before any other tensor moves."""
    peers = [peer for peer in range(world_size) if peer != rank]
    if not peers:
        return
    mine = {peer: secrets.token_bytes(_CHALLENGE) for peer in peers}
    theirs = {peer: torch.zeros(_CHALLENGE, dtype=torch.uint8, device=device) for peer in peers}
    _exchange({p: _tensor(mine[p], device) for p in peers}, theirs, rank, where, timeout_s)
    answers = {p: _tensor(mac(secret, "pair", p, rank, bytes(theirs[p].cpu().tolist())), device) for p in peers}
    received = {peer: torch.zeros(_TAG, dtype=torch.uint8, device=device) for peer in peers}
    _exchange(answers, received, rank, where, timeout_s)
    for peer in peers:
        if not hmac.compare_digest(bytes(received[peer].cpu().tolist()), mac(secret, "pair", rank, peer, mine[peer])):
            raise RendezvousError(f"rank {rank}: the connection that should be rank {peer} did not prove this launch's "
                                  f"secret: something outside the job took its place at the rendezvous ({where}); "
                                  "it was sent one random challenge and nothing else", hint=INTRUDER_HINT)


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8, device=device)


def _exchange(send: dict, recv: dict, rank: int, where: str, timeout_s: float) -> None:
    ops = [dist.P2POp(dist.isend, tensor, peer) for peer, tensor in send.items()]
    ops += [dist.P2POp(dist.irecv, tensor, peer) for peer, tensor in recv.items()]
    works = dist.batch_isend_irecv(ops)
    try:
        for work in works:
            work.wait(datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise RendezvousError(f"rank {rank}: a peer did not answer the rendezvous proof within {timeout_s:.0f} s "
                              f"({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})",
                              hint=INTRUDER_HINT) from None


def foreign_keys(store: SignedStore) -> int:
    """Note [authenticated rendezvous], 4: keys whose values prove nothing (counters excepted:
    torch's own are never signed, so values of 8 bytes or fewer are not judged)."""
    count = 0
    try:
        keys = store.inner.list_keys()
    except Exception:  # an older store without the extended API: nothing to judge
        return 0
    for key in keys:
        try:
            raw = bytes(store.inner.get(key))
        except Exception:
            continue
        if len(raw) <= 8:
            continue
        tag, data = raw[:_TAG], raw[_TAG:]
        if not hmac.compare_digest(tag, mac(store.secret, "value", key, data)):
            count += 1
    return count
