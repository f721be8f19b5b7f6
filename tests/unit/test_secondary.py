"""pytest tests/unit/test_secondary.py — ZeRO++ hpZ's pure parts (Note [secondary copy] in
zerorun/zero/unit/secondary.py): the secondary slices and groups, the config's partition size
against the job (YAML and DeepSpeed's ``zero_hpz_partition_size``), and one step's bytes per link
class as hpZ issues them against ``zerorun estimate --link`` and its memory column (the
test_link_split.py pattern: telemetry and estimate are one arithmetic)."""

from __future__ import annotations

import pytest

from zerorun.config import load_config
from zerorun.errors import ConfigError
from zerorun.planner.memory import Job, secondary_elements
from zerorun.planner.traffic import all_traffic, step_traffic
from zerorun.zero.comm.link_split import NOTHING, ring_sent
from zerorun.zero.unit.secondary import partition_groups, secondary_range


def test_each_member_keeps_its_slice_of_the_padded_buffer():
    assert [secondary_range(12, 2, i) for i in range(2)] == [(0, 6), (6, 12)]
    assert [secondary_range(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    for bad in ((13, 2, 0), (12, 2, 2), (12, 0, 0)):
        with pytest.raises(ValueError):
            secondary_range(*bad)


def test_groups_within_and_across_hosts():
    assert partition_groups(4, 2) == ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    assert partition_groups(6, 3) == ([(0, 1, 2), (3, 4, 5)], [(0, 3), (1, 4), (2, 5)])
    assert partition_groups(2, 2) == ([(0, 1)], [(0,), (1,)])
    with pytest.raises(ValueError):
        partition_groups(6, 4)


def _problems(zero: dict, world: int, hosts) -> list[str]:
    try:
        load_config({"zero": zero}, world_size=world, hosts=hosts, environ={})
    except ConfigError as err:
        lines = str(err).splitlines()
        return [lines[0].split(": ", 1)[1]] if len(lines) == 1 else [line.strip() for line in lines[1:] if line.strip()]
    return []


def test_the_partition_size_must_fit_the_hosts():
    assert _problems({"stage": 3, "hpz_partition_size": 2}, 4, (0, 0, 1, 1)) == []
    assert _problems({"stage": 3, "hpz_partition_size": 2}, 8, (0, 0, 0, 0, 1, 1, 1, 1)) == []  # a divisor
    assert _problems({"stage": 3, "hpz_partition_size": 2}, 4, None) == []  # hosts unknown: the world only
    (stage,) = _problems({"stage": 2, "hpz_partition_size": 2}, 4, (0, 0, 1, 1))
    assert "zero.hpz_partition_size" in stage and "set zero.stage: 3 or hpz_partition_size: 1" in stage
    (world,) = _problems({"stage": 3, "hpz_partition_size": 2}, 3, None)
    assert "must divide the world size (3 ranks)" in world
    (hosts,) = _problems({"stage": 3, "hpz_partition_size": 2}, 4, (0, 1, 2, 3))
    assert "ranks per host: 1,1,1,1" in hosts
    (uneven,) = _problems({"stage": 3, "hpz_partition_size": 2}, 6, (0, 0, 0, 1, 1, 1))
    assert "ranks per host: 3,3" in uneven
    assert _problems({"stage": 3, "hpz_partition_size": 0}, 4, None)  # below 1


def test_deepspeeds_key_means_the_same():
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                         world_size=4, hosts=(0, 0, 1, 1), environ={})
    assert config.zero.hpz_partition_size == 2
    assert load_config({"train_batch_size": 8}, environ={}).zero.hpz_partition_size == 1  # off by default
    with pytest.raises(ConfigError, match="zero_optimization.zero_hpz_partition_size"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
                    world_size=4, hosts=(0, 1, 2, 3), environ={})


# --- a step's collectives with hpZ against ``zerorun estimate --link`` ----------------------------
P = 4
UNITS = (8 * 64, 12 * 64, 20 * 64)  # the first is the head, kept gathered into backward
PSI = sum(UNITS)
HOSTS = (0, 0, 1, 1)


def hpz_rank_step(index: int) -> tuple:
    """What rank ``index`` of 2 hosts x 2 sends in one hpZ step: forward's gathers on the world
    ring, backward's on its host group's ring, the reduce-scatter within the host then across."""
    world = (0, 1, 2, 3)
    within = (0, 1) if index < 2 else (2, 3)
    across = (0, 2) if index % 2 == 0 else (1, 3)
    sent = NOTHING
    for unit in UNITS:
        sent += ring_sent(P * unit, world, index, HOSTS)
    for unit in UNITS[1:]:
        sent += ring_sent(P * unit, within, within.index(index), HOSTS)
    sent += ring_sent(P * PSI, within, within.index(index), HOSTS)
    sent += ring_sent(P * PSI // 2, across, across.index(index), HOSTS)
    return sent


def test_two_hosts_of_two_ranks_hpz_sends_what_the_estimate_says():
    expected = step_traffic(PSI, Job(gpus_per_node=2, nodes=2), 3, P, kept=UNITS[0], hpz=2)
    ranks = [hpz_rank_step(i) for i in range(4)]
    assert sum(s.between for s in ranks) / 4 == pytest.approx(expected.link_bytes, rel=1e-12)
    assert sum(s.within for s in ranks) / 4 == pytest.approx(expected.local_bytes, rel=1e-12)
    flat = step_traffic(PSI, Job(gpus_per_node=2, nodes=2), 3, P, kept=UNITS[0])
    # forward's gathers and a quarter of the buffer instead of every gather and 3/8 of it
    assert expected.link_bytes / flat.link_bytes == pytest.approx((3 / 8 * PSI + PSI / 4) / (3 / 8 * (3 * PSI - UNITS[0])))
    labels = [row.label for row in all_traffic(PSI, Job(gpus_per_node=2, nodes=2), P)]
    assert labels[-2:] == ["stage 3+hpz", "stage 3+qwz+qgz+hpz"]
    assert not any("hpz" in row.label for row in all_traffic(PSI, Job(gpus_per_node=1, nodes=2), P))


def test_the_secondary_copy_is_a_1_over_h_of_the_padded_units():
    assert secondary_elements(PSI, 4, 2) == PSI // 2
    assert secondary_elements(7, 4, 2) == 4  # padded to 8 for 4 ranks


def test_the_launcher_checks_it_against_its_plan():
    from types import SimpleNamespace

    from zerorun.launch.prepare import _rank_hosts

    def plan(*workers: int, world: int | None = None):
        nodes = [SimpleNamespace(workers=[None] * n) for n in workers]
        return SimpleNamespace(nodes=nodes, world_size=world or sum(workers))

    assert _rank_hosts(plan(2, 2)) == (0, 0, 1, 1)
    assert _rank_hosts(plan(1, 1)) == (0, 1)
    assert _rank_hosts(plan(2, world=4)) is None  # srun's per-node launcher plans its own node only
    (refused,) = _problems({"stage": 3, "hpz_partition_size": 2}, 2, _rank_hosts(plan(1, 1)))
    assert "ranks per host: 1,1" in refused
