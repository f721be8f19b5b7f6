"""pytest tests/distributed/test_cpu_collectives.py — the two CPU transports of comm/collectives.py:
shared memory between ranks on one host (comm/host_channel.py) and gloo's point-to-point ring
(comm/ring.py, ZERORUN_HOST_CHANNEL=0 and ranks on other hosts).

Each transport's reduce-scatter must hand each rank exactly the sum of every rank's chunk, in
fp32 and bf16, at 2 and 3 ranks, with chunks larger than a channel slot (so several rounds,
the last one short) and in place (the output is the input's own chunk); values are small
integers, so every summation order gives the same bits. At 2 ranks nothing chunk-sized is
allocated while it runs (Note [receive into the output] for the ring; the channel reads its
peer's slot). The all-gather must put every rank's input in place. The channel must be the one
used when it is on, leave nothing in /dev/shm once opened, fall back to the ring on every rank
when one rank cannot open it (else the ranks would wait on different transports), and turn a
peer that exits while this rank waits for it into an error naming that rank, within seconds
rather than a hang.
"""

from __future__ import annotations

import json
import re
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks, spawn_and_collect, start_processes

from zerorun.zero.comm.host_channel import PEER_CHECK_S, SLOT_BYTES

CHUNK = SLOT_BYTES // 4 * 2 + 4099  # elements per rank: 2+ slots in fp32, 4+ in bf16, a short last round


def rank_input(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, (CHUNK * world,), generator=generator).to(dtype)


def largest_allocation(run) -> int:
    """The largest single CPU allocation ``run()`` makes, from torch's profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return max([0, *sizes])


def reduce_scatter_inline(out: torch.Tensor, bucket: torch.Tensor) -> None:
    """The transport's reduce-scatter on the calling thread, where the profiler sees its
    allocations (both transports run collectives on a worker thread of their own; every rank
    calls this at the same point while its workers are idle)."""
    from zerorun.zero.comm.host_channel import host_channel
    from zerorun.zero.comm.ring import Ring

    channel = host_channel(None)
    if channel is not None:
        channel._reduce_scatter(out, bucket)
    else:
        Ring("reduce_scatter", out, bucket, None, tag=0x3FFF_FFF0).wait()


def transports(rank: int, world: int, channel: str, out_dir: str) -> dict:
    from zerorun.zero.comm import collectives
    from zerorun.zero.comm.host_channel import host_channel

    from zerorun.zero.comm import host_channel as host_channel_module

    # Both read when the group's first collective opens its channel, not when the group is made.
    os.environ["ZERORUN_HOST_CHANNEL"] = "0" if channel == "0" else "1"
    if channel == "one_rank_cannot" and rank == 1:  # no /dev/shm here: all take the ring
        host_channel_module.SHM_DIR = str(Path(out_dir, "missing"))
    sys.stderr = open(Path(out_dir, f"rank{rank}.err"), "w")  # what the ranks say about the transport
    torch.set_num_threads(1)
    results: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        bucket = rank_input(rank, world, dtype)
        expected = sum(rank_input(r, world, dtype).float() for r in range(world))[rank * CHUNK : (rank + 1) * CHUNK]
        out = torch.empty(CHUNK, dtype=dtype)
        collectives.reduce_scatter(out, bucket, group=None, async_op=True).wait()
        largest = largest_allocation(lambda out=out, bucket=bucket: reduce_scatter_inline(out, bucket))
        in_place = rank_input(rank, world, dtype)
        own_chunk = in_place[rank * CHUNK : (rank + 1) * CHUNK]
        collectives.reduce_scatter(own_chunk, in_place, group=None)
        gathered = torch.empty(CHUNK * world, dtype=dtype)
        collectives.all_gather(gathered, bucket[rank * CHUNK : (rank + 1) * CHUNK], group=None, async_op=True).wait()
        expected_gather = torch.cat([rank_input(r, world, dtype)[r * CHUNK : (r + 1) * CHUNK] for r in range(world)])
        gathered_in_place = torch.zeros(CHUNK * world, dtype=dtype)
        gathered_in_place[rank * CHUNK : (rank + 1) * CHUNK] = bucket[rank * CHUNK : (rank + 1) * CHUNK]
        collectives.all_gather(gathered_in_place, gathered_in_place[rank * CHUNK : (rank + 1) * CHUNK], group=None)
        results[name] = {
            "reduce_scatter_exact": bool(torch.equal(out.float(), expected)),
            "in_place_reduce_scatter_exact": bool(torch.equal(own_chunk.float(), expected)),
            "input_untouched": bool(torch.equal(bucket, rank_input(rank, world, dtype))),
            "largest_allocation": largest,
            "chunk_bytes": CHUNK * bucket.element_size(),
            "all_gather_exact": bool(torch.equal(gathered, expected_gather)),
            "in_place_all_gather_exact": bool(torch.equal(gathered_in_place, expected_gather)),
        }
    opened = host_channel(None)
    results["channel_used"] = opened is not None
    results["files_left"] = [path for path in (opened.files if opened else []) if os.path.exists(path)]
    return results


@pytest.mark.parametrize("channel", ["1", "0"], ids=["host_channel", "ring"])
@pytest.mark.parametrize("world", [2, 3])
def test_cpu_reduce_scatter_and_all_gather_are_exact(tmp_path, world, channel):
    check_collectives(tmp_path, world, channel)


def test_every_rank_takes_the_ring_when_one_cannot_open_the_channel(tmp_path):
    """Issue 38 (messages): and says so, once for the group (its first rank), naming the rank
    that could not and why; it used to fall back without a word."""
    check_collectives(tmp_path, 2, "one_rank_cannot")
    said = {rank: [line for line in (tmp_path / f"rank{rank}.err").read_text().splitlines() if "zerorun" in line]
            for rank in (0, 1)}
    assert said[1] == [] and said[0] == [
        "zerorun: note: the job's ranks on this host move their collectives through the ring (TCP loopback), not "
        f"shared memory: rank 1 finds no {tmp_path / 'missing'}"], said


def check_collectives(tmp_path, world: int, channel: str) -> None:
    results = run_ranks(transports, world, tmp_path, world, channel, str(tmp_path))
    for rank, result in results.items():
        assert result.pop("channel_used") == (channel == "1"), f"rank {rank}: the wrong transport ran"
        if channel in ("0", "1"):  # the channel, or the ring by the user's choice: nothing to say
            assert "zerorun" not in (tmp_path / f"rank{rank}.err").read_text(), rank
        assert result.pop("files_left") == [], f"rank {rank}: the channel left files in /dev/shm"
        for dtype, checks in result.items():
            where = f"rank {rank} {dtype}"
            assert checks["reduce_scatter_exact"] and checks["input_untouched"], where
            assert checks["in_place_reduce_scatter_exact"], where
            assert checks["all_gather_exact"] and checks["in_place_all_gather_exact"], where
            if world == 2:  # no chunk-sized buffer is made while it runs
                assert checks["largest_allocation"] < checks["chunk_bytes"], (where, checks)


def exiting_peer_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from zerorun.zero.comm import collectives
    from zerorun.zero.comm.host_channel import PeerExited

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    shard = torch.full((CHUNK,), float(rank))
    collectives.all_gather(torch.empty(2 * CHUNK), shard, group=None)  # opens the channel
    result = {"error": None, "seconds": None}
    if rank == 0:
        started = time.monotonic()
        try:
            collectives.all_gather(torch.empty(2 * CHUNK), shard, group=None)
        except PeerExited as err:
            result = {"error": str(err), "seconds": time.monotonic() - started}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # rank 1 leaves without entering the second all-gather; no teardown for either


def test_a_peer_that_exits_mid_collective_is_named_within_seconds(tmp_path):
    results = spawn_and_collect(exiting_peer_worker, tmp_path, 2)
    assert results[0]["error"] is not None, "rank 0's all-gather finished without its peer"
    assert "rank 1" in results[0]["error"] and "exited" in results[0]["error"], results[0]
    assert results[0]["seconds"] < PEER_CHECK_S + 10, results[0]


def early_exit_worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from zerorun.zero.comm import collectives

    def ours() -> set[str]:
        return {name for name in os.listdir("/dev/shm") if name.startswith(("zerorun-outbox-", "zerorun-inbox-"))}

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(1.0)  # rank 0 is in its first all-gather, opening the channel
        os._exit(0)  # fails before the group's first collective
    before = ours()
    result: dict = {"error": None}
    try:
        collectives.all_gather(torch.empty(2 * CHUNK), torch.ones(CHUNK), group=None)
    except Exception as err:  # gloo's "connection closed" (the launcher names the rank that left)
        result["error"] = type(err).__name__
    # This rank's files: named with its pid, or (older versions) with no pid at all.
    mine = re.compile(rf"zerorun-(outbox|inbox)-(p{os.getpid()}-.*|(?!p[0-9]+-).*)")
    result["left"] = sorted(name for name in ours() - before if mine.fullmatch(name))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def test_a_rank_that_fails_before_the_first_collective_leaves_nothing_in_dev_shm(tmp_path):
    """The survivor's outbox and FIFO were made before the agreement and not
    unlinked when it raised; now nothing is made until every rank is there (Note [shm cleanup])."""
    procs = start_processes(early_exit_worker, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, join=False)
    for process in procs.processes:
        process.join(timeout=300)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["error"] is not None, "rank 0's all-gather finished without its peer"
    assert result["left"] == [], result


def test_stale_channel_files_are_removed_by_pid_and_age(tmp_path):
    from zerorun.zero.comm import shm_names

    dead = 2 ** 22 + 12345  # above any pid_max default: no such process
    (tmp_path / f"zerorun-outbox-p{dead}-abc").write_bytes(b"x")
    (tmp_path / f"zerorun-inbox-p{dead}-abc").write_bytes(b"x")
    (tmp_path / f"zerorun-outbox-p{os.getpid()}-abc").write_bytes(b"x")  # alive: kept
    (tmp_path / "zerorun-outbox-other").write_bytes(b"x")  # not our pattern: kept
    assert shm_names.remove_stale(str(tmp_path)) == []  # too young: perhaps another namespace's, mid-open
    later = time.time() + shm_names.STALE_S + 1
    assert sorted(os.path.basename(p) for p in shm_names.remove_stale(str(tmp_path), now=later)) == [
        f"zerorun-inbox-p{dead}-abc", f"zerorun-outbox-p{dead}-abc"]
    assert shm_names.remove_files_of([os.getpid()], str(tmp_path)) == [str(tmp_path / f"zerorun-outbox-p{os.getpid()}-abc")]
    assert os.listdir(tmp_path) == ["zerorun-outbox-other"]


def ring_in_background(rank: int, world: int) -> dict:
    """Issue 40 (Note [ring progress]): between hosts a collective is issued without waiting for
    its peers, and completes while the callers compute, however long the ring."""
    from zerorun.zero.comm import collectives

    os.environ["ZERORUN_HOST_CHANNEL"] = "0"
    torch.set_num_threads(1)
    shard = torch.full((CHUNK,), float(rank))
    expected = torch.cat([torch.full((CHUNK,), float(r)) for r in range(world)])
    collectives.all_gather(torch.empty(world * CHUNK), shard, group=None)  # every transport is set up
    # 1. The issue does not wait for the peers: the last rank issues 2 s after the others.
    if rank == world - 1:
        time.sleep(2.0)
    started = time.monotonic()
    first = torch.empty(world * CHUNK)
    handle = collectives.all_gather(first, shard, group=None, async_op=True)
    issued_s = time.monotonic() - started
    handle.wait()
    # 2. Every step moves while the ranks compute: the last rank computes 4 s, the others 1 s, so
    # a ring whose later steps are posted by wait() holds the others' wait until the last one's.
    second = torch.empty(world * CHUNK)
    handle = collectives.all_gather(second, shard, group=None, async_op=True)
    time.sleep(4.0 if rank == world - 1 else 1.0)
    started = time.monotonic()
    handle.wait()
    waited_s = time.monotonic() - started
    return {"issued_s": issued_s, "waited_s": waited_s,
            "exact": bool(torch.equal(first, expected) and torch.equal(second, expected))}


def test_ring_collectives_progress_while_the_caller_computes(tmp_path):
    """Old main: a rank blocked at the issue until every peer issued too (the descriptors' side
    all-gather: about 2 s here), and a ring of 3 moved only its first step before ``wait()``
    (the first ranks' waits took about 3 s)."""
    results = run_ranks(ring_in_background, 3, tmp_path, 3)
    for rank, result in results.items():
        assert result["exact"], rank
    for rank in (0, 1):
        assert results[rank]["issued_s"] < 1.0, (rank, results[rank])  # the last rank issued 2 s later
        assert results[rank]["waited_s"] < 1.0, (rank, results[rank])  # the last rank waited 3 s later
