"""pytest tests/distributed/test_link_bytes.py — the bytes each collective says this rank sends,
by link class (Note [link classes] in zerorun/zero/comm/link_split.py), on 2 gloo ranks of one host.

- The default group goes through the host channel (reduce-scatter, all-gather) and gloo's own
  all-reduce and broadcast: every byte is within the host, N-1 chunks of each buffer, twice that
  for the all-reduce, and a broadcast's whole buffer from the source only.
- A group made with the channel off, ZERORUN_HOST_SLOTS saying one rank a host: the ring, the
  all-reduce estimate and qgZ's exchange put every byte between hosts, the same counts.
"""

from __future__ import annotations

import os

from gloo_world import run_ranks

N = 1000  # elements per rank's chunk


class Sends:
    def __init__(self):
        self.ops: list[list] = []

    def collective_started(self, seq, op, nbytes):
        pass

    def collective_finished(self, seq, op, nbytes, seconds, waited):
        pass

    def collective_sent(self, seq, op, within, between):
        self.ops.append([op, within, between])


def _issue_each(group, collectives) -> None:
    import torch

    from zerorun.zero.comm import collectives as c

    full = torch.ones(2 * N)
    c.all_gather(torch.empty(2 * N), full[:N].clone(), group=group)
    c.reduce_scatter(torch.empty(N), full, group=group)
    c.all_reduce(full, group=group)
    c.broadcast(full, src=0, group=group)
    c.barrier(group=group)


def sends_by_link(rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from zerorun.zero.comm import collectives, quantized_collectives

    for name in ("ZERORUN_HOST_SLOTS", "LOCAL_WORLD_SIZE", "ZERORUN_HOST_CHANNEL"):
        os.environ.pop(name, None)  # read at the group's first collective, not when it is made
    sends = Sends()
    collectives.add_observer(sends)
    _issue_each(None, collectives)
    one_host = list(sends.ops)
    sends.ops.clear()
    os.environ["ZERORUN_HOST_CHANNEL"] = "0"  # read when the new group's channel would open
    os.environ["ZERORUN_HOST_SLOTS"] = "1,1"
    collectives._hosts_of.clear()  # the host map is read once per process: read it again
    ring_group = dist.new_group([0, 1])
    _issue_each(ring_group, collectives)
    out = torch.empty(N)
    quantized_collectives.quantized_reduce_scatter(out, torch.ones(2 * N), group=ring_group, block=256)
    two_hosts = list(sends.ops)
    collectives.remove_observer(sends)
    dist.destroy_process_group()
    return {"one_host": one_host, "two_hosts": two_hosts}


def test_two_ranks_of_one_host_send_within_it_and_a_two_host_map_moves_the_same_bytes_between(tmp_path):
    from zerorun.zero.comm import quantize

    results = run_ranks(sends_by_link, 2, tmp_path, leave_together=False)
    chunk = 4 * N
    for rank, r in results.items():
        broadcast = 2 * chunk if rank == 0 else 0  # rank 1 is the last of the ring from source 0
        expected = [["all_gather", chunk], ["reduce_scatter", chunk], ["all_reduce", 2 * chunk],
                    ["broadcast", broadcast], ["barrier", 0]]
        assert r["one_host"] == [[op, n, 0] for op, n in expected], rank
        part = quantize.packed_nbytes(N, 256)
        assert r["two_hosts"] == [[op, 0, n] for op, n in expected] + [["reduce_scatter_q", 0, part]], rank
