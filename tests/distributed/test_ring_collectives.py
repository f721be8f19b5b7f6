"""pytest tests/distributed/test_ring_collectives.py — gloo's point-to-point ring (comm/ring.py).

The reduce-scatter must hand each rank exactly the sum of every rank's chunk, in fp32 and bf16,
at 2 and 3 ranks (values are small integers, so every summation order gives the same bits),
and at 2 ranks receive straight into the output (Note [receive into the output]): nothing
chunk-sized is allocated while it runs. The all-gather must put every rank's input in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_world import spawn_and_collect

CHUNK = 1 << 16  # elements per rank: 256 KiB in fp32


def rank_input(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(-8, 9, (CHUNK * world,), generator=generator).to(dtype)


def largest_allocation(run) -> int:
    """The largest single CPU allocation ``run()`` makes, from torch's profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return max([0, *sizes])


def worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from zerorun.zero.comm import collectives
    from zerorun.zero.comm.process_group import leaving_together

    torch.set_num_threads(1)
    world = int(Path(out_dir, "world").read_text())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict = {}
    with leaving_together():  # Note [clean exit] in zerorun/zero/comm/process_group.py
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            bucket = rank_input(rank, world, dtype)
            expected = sum(rank_input(r, world, dtype).float() for r in range(world))[rank * CHUNK : (rank + 1) * CHUNK]
            out = torch.empty(CHUNK, dtype=dtype)
            largest = largest_allocation(
                lambda out=out, bucket=bucket: collectives.reduce_scatter(out, bucket, group=None, async_op=True).wait())
            gathered = torch.empty(CHUNK * world, dtype=dtype)
            collectives.all_gather(gathered, bucket[rank * CHUNK : (rank + 1) * CHUNK], group=None, async_op=True).wait()
            expected_gather = torch.cat([rank_input(r, world, dtype)[r * CHUNK : (r + 1) * CHUNK] for r in range(world)])
            results[name] = {
                "reduce_scatter_exact": bool(torch.equal(out.float(), expected)),
                "input_untouched": bool(torch.equal(bucket, rank_input(rank, world, dtype))),
                "largest_allocation": largest,
                "chunk_bytes": CHUNK * bucket.element_size(),
                "all_gather_exact": bool(torch.equal(gathered, expected_gather)),
            }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.parametrize("world", [2, 3])
def test_ring_reduce_scatter_and_all_gather_are_exact(tmp_path, world):
    (tmp_path / "world").write_text(str(world))
    results = spawn_and_collect(worker, tmp_path, world)
    for rank, by_dtype in results.items():
        for dtype, result in by_dtype.items():
            where = f"rank {rank} {dtype}"
            assert result["reduce_scatter_exact"] and result["input_untouched"], where
            assert result["all_gather_exact"], where
            if world == 2:  # Note [receive into the output]: no chunk-sized receive buffer
                assert result["largest_allocation"] < result["chunk_bytes"], (where, result)
