"""Imported by tests/distributed/*: spawn one small gloo world and collect every rank's result.

The worker is ``worker(rank, rendezvous_file, out_dir)``: it joins with a ``file://`` init
method (no ports to race for) and writes ``out_dir/rank{R}.json``.
"""

from __future__ import annotations

import json
from pathlib import Path


def spawn_and_collect(worker, out_dir: Path, world: int) -> dict[int, dict]:
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(str(out_dir / "rendezvous"), str(out_dir)), nprocs=world,
                       start_method="spawn", join=True)
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)}
