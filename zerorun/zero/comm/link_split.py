"""Which link a collective's bytes cross: to a rank on this host, or to another host (pure).

    pytest tests/unit/test_link_split.py

Note [link classes]: every collective reports the bytes *this rank sends* in it, split in two:
``within`` (to ranks of its own host: the host channel's shared memory, or a loopback socket)
and ``between`` (to ranks on other hosts: the network). Each transport says what it knows:

- the host channel (host_channel.py) exists only when every rank of the group shares this
  host, so all of it is within: a rank writes the N-1 chunks its peers read, (N-1)/N of the
  buffer;
- our ring (ring.py) sends (N-1)/N of the buffer, all of it to one peer, its right neighbour:
  within or between by that peer's host;
- qgZ's exchange (quantized_exchange.py) sends one packed part to each other rank, each
  classed by that rank's host;
- gloo's and NCCL's own collectives (all-reduce, broadcast, and every collective on NCCL) do
  not say how they route, so they are *estimated* with the ring formula over the group's ranks
  in order: an all-reduce sends 2 (N-1)/N of the buffer to the right neighbour, a reduce-scatter
  or all-gather (N-1)/N, a broadcast the whole buffer from every rank but the one before the
  source. NCCL's rings are built host by host, which for ranks numbered host by host (zerorun's
  launcher and torchrun number them so) is this same order; gloo's own algorithms may route
  otherwise, so those figures are the ring's, not a count. A barrier sends nothing here (a few
  bytes). The descriptor checks (agreement.py) are a few dozen bytes per collective, not
  counted.

Which host each rank is on (``job_hosts``): the launcher's ZERORUN_HOST_SLOTS (ranks per host,
in rank order, e.g. ``2,1``), else LOCAL_WORLD_SIZE with ranks numbered host by host (torchrun,
srun's per-node launchers, which all run the same number of workers), else, for ``srun python
train.py``, the step's tasks per node (SLURM_STEP_TASKS_PER_NODE, which may differ from node to
node) under srun's default block distribution (ranks numbered node by node; any other
SLURM_DISTRIBUTION places ranks otherwise and is not guessed), else every rank on one host
(processes spawned by a script).
These are the figures telemetry carries (telemetry/recorder.py), and the same arithmetic as
``zerorun estimate --link`` (planner/traffic.py), which averages them over the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerorun.worker.launch_env import HOST_SLOTS_ENV


@dataclass(frozen=True)
class Sent:
    """Bytes this rank sends in one collective (or a sum of them), by link class."""

    within: int = 0
    between: int = 0

    def __add__(self, other: Sent) -> Sent:
        return Sent(self.within + other.within, self.between + other.between)


NOTHING = Sent()


def job_hosts(environ: Mapping[str, str], world_size: int) -> tuple[int, ...]:
    """The host index of each global rank (see the module docstring for the sources)."""
    slots = _slots(environ.get(HOST_SLOTS_ENV, ""))
    if slots and sum(slots) == world_size:
        return tuple(host for host, count in enumerate(slots) for _ in range(count))
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE", "") or 0)
    except ValueError:
        local = 0
    if local > 0 and world_size % local == 0:
        return tuple(rank // local for rank in range(world_size))
    per_node = _slurm_step_slots(environ)
    if per_node and sum(per_node) == world_size:
        return tuple(host for host, count in enumerate(per_node) for _ in range(count))
    return (0,) * world_size


def _slurm_step_slots(environ: Mapping[str, str]) -> tuple[int, ...]:
    """Tasks per node of the Slurm step this process is a task of, where srun numbers them node by
    node (its default ``block`` distribution); () otherwise or where Slurm's variables do not parse."""
    from zerorun.errors import ZerorunError
    from zerorun.worker.slurm_env import detect

    if environ.get("SLURM_DISTRIBUTION", "block").split(":")[0] not in ("block", ""):
        return ()
    try:
        ctx = detect(environ)
    except ZerorunError:
        return ()
    return ctx.step_tasks_per_node if ctx is not None and ctx.in_step else ()


def _slots(text: str) -> tuple[int, ...]:
    try:
        slots = tuple(int(part) for part in text.split(",")) if text else ()
    except ValueError:
        return ()
    return slots if all(n > 0 for n in slots) else ()


def _to(nbytes: int, me: int, peer: int, hosts: Sequence[int]) -> Sent:
    return Sent(nbytes, 0) if _host(hosts, me) == _host(hosts, peer) else Sent(0, nbytes)


def _host(hosts: Sequence[int], rank: int) -> int:
    return hosts[rank] if 0 <= rank < len(hosts) else -1 - rank  # an unknown rank: a host of its own


def channel_sent(total_bytes: int, size: int) -> Sent:
    """A host-channel reduce-scatter or all-gather over a buffer of ``total_bytes``."""
    return Sent(total_bytes // size * (size - 1), 0)


def ring_sent(total_bytes: int, members: Sequence[int], index: int, hosts: Sequence[int]) -> Sent:
    """A ring reduce-scatter or all-gather (ring.py): ``members`` the group's global ranks in
    group order, ``index`` this rank's place among them; all to the right neighbour."""
    size = len(members)
    right = members[(index + 1) % size]
    return _to(total_bytes // size * (size - 1), members[index], right, hosts)


def exchange_sent(part_bytes: int, members: Sequence[int], index: int, hosts: Sequence[int]) -> Sent:
    """qgZ's exchange: one part of ``part_bytes`` to every other member."""
    me, sent = members[index], NOTHING
    for peer in members:
        if peer != me:
            sent += _to(part_bytes, me, peer, hosts)
    return sent


def estimated_sent(op: str, total_bytes: int, members: Sequence[int], index: int, hosts: Sequence[int],
                   src_index: int | None = None) -> Sent:
    """gloo's or NCCL's own collective, by the ring formula (Note [link classes]): an estimate."""
    size = len(members)
    if size < 2 or op == "barrier":
        return NOTHING
    right_index = (index + 1) % size
    if op == "broadcast":
        nbytes = 0 if right_index == src_index else total_bytes
    elif op == "all_reduce":
        nbytes = 2 * (total_bytes // size * (size - 1))
    else:  # reduce_scatter, all_gather
        nbytes = total_bytes // size * (size - 1)
    return _to(nbytes, members[index], members[right_index], hosts)
