"""python scripts/bench_collectives.py [--nproc 2] [--sizes-mb 8.4,33.6] [--iters 40]

zerorun's CPU collectives against gloo's own, in one run: reduce-scatter and all-gather of a
flat fp32 buffer between gloo ranks on this host, through the shared-memory channel
(zerorun/zero/comm/host_channel.py), through the point-to-point ring over TCP (comm/ring.py,
what ranks on different hosts use) and through torch's gloo collectives
(all_gather_into_tensor / reduce_scatter_tensor, what FSDP2 calls). Each transport gets a fresh
world of spawned processes; reported per transport and size: the median over iterations of
the wall and CPU milliseconds of one collective on rank 0, and both as ratios to gloo's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TRANSPORTS = ("host_channel", "ring", "gloo")


def rank_main(rank: int, world: int, transport: str, sizes: list[int], iters: int, out_dir: str) -> None:
    os.environ["ZERORUN_HOST_CHANNEL"] = "1" if transport == "host_channel" else "0"
    import torch
    import torch.distributed as dist

    from zerorun.zero.comm.process_group import leaving_together

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    rows = {}
    with leaving_together():
        for numel in sizes:
            full, shard = torch.randn(numel), torch.randn(numel // world)
            gathered, reduced = torch.empty(numel), torch.empty(numel // world)
            ops = collectives_of(transport, gathered, shard, reduced, full)
            for op, run in ops.items():
                for _ in range(3):
                    run()
                walls, cpus = [], []
                for _ in range(iters):
                    dist.barrier()
                    wall, cpu = time.perf_counter(), time.process_time()
                    run()
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
                rows[f"{op} {numel * 4 / 1e6:.1f}"] = (statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3)
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))


def collectives_of(transport: str, gathered, shard, reduced, full) -> dict:
    """The all-gather and reduce-scatter of one transport, as calls that block until done."""
    import torch.distributed as dist

    from zerorun.zero.comm import collectives

    if transport == "gloo":  # torch 2.13 names them *_single; older releases *_tensor
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return {"all_gather": lambda: gather(gathered, shard), "reduce_scatter": lambda: scatter(reduced, full)}
    return {"all_gather": lambda: collectives.all_gather(gathered, shard, group=None),
            "reduce_scatter": lambda: collectives.reduce_scatter(reduced, full, group=None)}


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes-mb", default="8.4,33.6", help="fp32 buffer sizes in MB, comma-separated")
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args(argv)
    if args.nproc < 2 or args.iters < 1:
        parser.error("--nproc must be >= 2 and --iters >= 1")
    try:
        sizes = [int(float(mb) * 1e6 / 4) // args.nproc * args.nproc for mb in args.sizes_mb.split(",")]
    except ValueError:
        parser.error(f"--sizes-mb {args.sizes_mb!r} is not a comma-separated list of numbers")
    results = {}
    for transport in TRANSPORTS:
        with tempfile.TemporaryDirectory(prefix="zerorun-collectives-") as out_dir:
            mp.start_processes(rank_main, args=(args.nproc, transport, sizes, args.iters, out_dir),
                               nprocs=args.nproc, start_method="spawn", join=True)
            results[transport] = json.loads(Path(out_dir, "rows.json").read_text())
    print(f"{args.nproc} gloo ranks on this host, fp32, median of {args.iters}: wall / CPU ms of rank 0 (x gloo's)")
    for row in results["gloo"]:
        gloo_wall, gloo_cpu = results["gloo"][row]
        cells = [f"{t} {results[t][row][0]:.2f} / {results[t][row][1]:.2f} "
                 f"({results[t][row][0] / gloo_wall:.2f}x / {results[t][row][1] / gloo_cpu:.2f}x)" for t in TRANSPORTS]
        print(f"{row} MB: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
