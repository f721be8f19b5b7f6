"""pytest tests/unit/test_link_split.py — which link a collective's bytes cross (Note [link classes]
in zerorun/zero/comm/link_split.py), for host layouts 1x2, 2x1 and 2x2 and each transport: the host
channel, our ring, qgZ's exchange, and gloo's/NCCL's own collectives by the ring formula.

A step's collectives, as each stage issues them, split per rank and summed, agree with
``zerorun estimate --link`` (planner/traffic.py) on every rank for 2 hosts x 1 rank, and on the
ranks' mean for 2 x 2: the telemetry and the estimate are one arithmetic.
"""

from __future__ import annotations

import pytest

from zerorun.planner.memory import Job
from zerorun.planner.traffic import step_traffic
from zerorun.zero.comm import quantize
from zerorun.zero.comm.link_split import (NOTHING, Sent, channel_sent, estimated_sent, exchange_sent, job_hosts,
                                          ring_sent)

LAYOUTS = {"1x2": (0, 0), "2x1": (0, 1), "2x2": (0, 0, 1, 1)}


def test_the_host_map_from_the_launcher_torchrun_or_nothing():
    assert job_hosts({"ZERORUN_HOST_SLOTS": "2,1"}, 3) == (0, 0, 1)
    assert job_hosts({"ZERORUN_HOST_SLOTS": "2,2", "LOCAL_WORLD_SIZE": "1"}, 4) == (0, 0, 1, 1)
    # srun: one launcher per node names only its own node's slots; the local size is right
    assert job_hosts({"ZERORUN_HOST_SLOTS": "2", "LOCAL_WORLD_SIZE": "2"}, 4) == (0, 0, 1, 1)
    assert job_hosts({"LOCAL_WORLD_SIZE": "1"}, 2) == (0, 1)
    assert job_hosts({}, 3) == (0, 0, 0)  # spawned by a script: one host
    # srun python train.py: no launcher, no local size; the step's tasks per node, numbered node by node
    step = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NUM_TASKS": "3"}
    assert job_hosts(step, 3) == (0, 0, 1)
    assert job_hosts({**step, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, 4) == (0, 0, 1, 1)
    assert job_hosts({**step, "SLURM_DISTRIBUTION": "block:cyclic"}, 3) == (0, 0, 1)
    assert job_hosts({**step, "SLURM_DISTRIBUTION": "cyclic"}, 3) == (0, 0, 0)  # not guessed
    assert job_hosts({**step, "SLURM_STEP_TASKS_PER_NODE": "2(x"}, 3) == (0, 0, 0)  # does not parse
    for bad in ({"ZERORUN_HOST_SLOTS": "x,1"}, {"ZERORUN_HOST_SLOTS": "0,2"}, {"LOCAL_WORLD_SIZE": "3"},
                {"LOCAL_WORLD_SIZE": "two"}):
        assert job_hosts(bad, 2) == (0, 0), bad


@pytest.mark.parametrize(("layout", "expected"), [
    ("1x2", [Sent(400, 0), Sent(400, 0)]),
    ("2x1", [Sent(0, 400), Sent(0, 400)]),
    # the ring 0->1->2->3->0 crosses hosts leaving ranks 1 and 3
    ("2x2", [Sent(600, 0), Sent(0, 600), Sent(600, 0), Sent(0, 600)]),
])
def test_ring_sends_n_minus_one_chunks_to_its_right_neighbour(layout, expected):
    hosts = LAYOUTS[layout]
    members = tuple(range(len(hosts)))
    assert [ring_sent(800, members, i, hosts) for i in members] == expected


def test_a_subgroup_ring_follows_its_members_global_ranks():
    hosts = LAYOUTS["2x2"]
    # ranks 1 and 2 only: each sends its half to the other, across hosts
    assert [ring_sent(800, (1, 2), i, hosts) for i in (0, 1)] == [Sent(0, 400)] * 2
    assert [ring_sent(800, (0, 1), i, hosts) for i in (0, 1)] == [Sent(400, 0)] * 2


def test_the_host_channel_is_within_the_host():
    assert channel_sent(800, 2) == Sent(400, 0)
    assert channel_sent(900, 3) == Sent(600, 0)


def test_the_exchange_classes_each_part_by_its_receiver():
    hosts = LAYOUTS["2x2"]
    members = (0, 1, 2, 3)
    assert [exchange_sent(10, members, i, hosts) for i in members] == [Sent(10, 20)] * 4
    assert exchange_sent(10, (0, 1), 0, LAYOUTS["2x1"]) == Sent(0, 10)


def test_torchs_own_collectives_by_the_ring_formula():
    hosts = LAYOUTS["2x2"]
    members = (0, 1, 2, 3)
    assert [estimated_sent("all_reduce", 800, members, i, hosts) for i in members] == [
        Sent(1200, 0), Sent(0, 1200), Sent(1200, 0), Sent(0, 1200)]
    # a broadcast from rank 2: every rank forwards the buffer but rank 1, the one before the source
    assert [estimated_sent("broadcast", 800, members, i, hosts, src_index=2) for i in members] == [
        Sent(800, 0), NOTHING, Sent(800, 0), Sent(0, 800)]
    assert estimated_sent("all_gather", 800, members, 3, hosts) == Sent(0, 600)
    assert estimated_sent("barrier", 0, members, 0, hosts) == NOTHING
    assert estimated_sent("all_reduce", 800, (0,), 0, (0,)) == NOTHING


# --- a step's collectives against ``zerorun estimate --link`` -------------------------------------
P = 4  # fp32
BLOCK = 2048
UNITS = (8 * BLOCK, 12 * BLOCK, 20 * BLOCK)  # stage 3's units; the first is the head, kept into backward
PSI = sum(UNITS)


def step_collectives(stage: int, world: int, qwz: bool, qgz: bool) -> list[tuple[str, int]]:
    """(route, bytes) of one step's collectives as the stage issues them: 'ring' (a reduce-scatter
    or all-gather through comm/ring.py), 'all_reduce' (gloo's own), 'exchange' (qgZ: bytes per peer)."""
    def packed(numel: int) -> int:
        return world * quantize.packed_nbytes(numel // world, BLOCK)

    reduce = [("exchange", quantize.packed_nbytes(PSI // world, BLOCK))] if qgz else [("ring", P * PSI)]
    if stage == 0:
        return [("all_reduce", P * PSI)]
    if stage == 1:  # the gradient reduce-scattered at the boundary (Note [scatter in place])
        return [("ring", P * PSI), ("ring", P * PSI)]
    if stage == 2:
        return reduce + [("ring", P * PSI)]
    gathers = list(UNITS) + list(UNITS[1:])  # forward, then backward without the head
    return [("ring", packed(u) if qwz else P * u) for u in gathers] + reduce


def rank_step(stage: int, hosts, index: int, qwz: bool, qgz: bool) -> Sent:
    members = tuple(range(len(hosts)))
    sent = NOTHING
    for route, nbytes in step_collectives(stage, len(hosts), qwz, qgz):
        if route == "ring":
            sent += ring_sent(nbytes, members, index, hosts)
        elif route == "exchange":
            sent += exchange_sent(nbytes, members, index, hosts)
        else:
            sent += estimated_sent(route, nbytes, members, index, hosts)
    return sent


CASES = [(0, False, False), (1, False, False), (2, False, False), (2, False, True), (3, False, False),
         (3, True, False), (3, False, True), (3, True, True)]


@pytest.mark.parametrize(("stage", "qwz", "qgz"), CASES)
def test_two_hosts_of_one_rank_every_rank_sends_what_the_estimate_says(stage, qwz, qgz):
    expected = step_traffic(PSI, Job(gpus_per_node=1, nodes=2), stage, P, qwz=qwz, qgz=qgz, block=BLOCK,
                            kept=UNITS[0])
    for index in range(2):
        sent = rank_step(stage, LAYOUTS["2x1"], index, qwz, qgz)
        assert sent.within == 0
        assert sent.between == pytest.approx(expected.link_bytes, rel=1e-12), (stage, qwz, qgz, index)


@pytest.mark.parametrize(("stage", "qwz", "qgz"), CASES)
def test_two_hosts_of_two_ranks_the_mean_rank_sends_what_the_estimate_says(stage, qwz, qgz):
    expected = step_traffic(PSI, Job(gpus_per_node=2, nodes=2), stage, P, qwz=qwz, qgz=qgz, block=BLOCK,
                            kept=UNITS[0])
    ranks = [rank_step(stage, LAYOUTS["2x2"], i, qwz, qgz) for i in range(4)]
    assert sum(s.between for s in ranks) / 4 == pytest.approx(expected.link_bytes, rel=1e-12)
    assert sum(s.within for s in ranks) / 4 == pytest.approx(expected.local_bytes, rel=1e-12)


def test_one_host_sends_nothing_between_hosts():
    for stage, qwz, qgz in CASES:
        assert all(rank_step(stage, LAYOUTS["1x2"], i, qwz, qgz).between == 0 for i in range(2))
