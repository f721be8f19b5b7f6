"""pytest tests/distributed/test_nvme_agreement.py — the NVMe free-space check agreed by every rank (issue 31 item 8).

Two gloo ranks build a stage-3 engine with optimizer and parameters on NVMe; only rank 1's file
system is (made to look) full. Before, rank 1 raised its one line and rank 0 went on into the
first collective, to die of a 60-line gloo traceback once rank 1 had exited. Now both raise
one line during initialize: rank 1 its own, rank 0 one naming rank 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from gloo_world import end_rank_now, run_ranks


def initialize_on_nvme(rank: int, out_dir: str) -> None:
    import shutil
    from collections import namedtuple

    import zerorun
    from zerorun.errors import ZerorunError

    for name in ("ZERORUN_CONFIG", "WORLD_SIZE", "RANK"):
        os.environ.pop(name, None)
    if rank == 1:
        usage = namedtuple("usage", "total used free")
        shutil.disk_usage = lambda path: usage(10 << 20, 0, 8 << 10)  # 8 KiB free on this rank only
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    nvme = str(Path(out_dir) / f"nvme{rank}")
    result = {"error": None, "type": None}
    try:
        zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {
            "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
            "offload_param": {"device": "nvme", "nvme_path": nvme}}})
    except ZerorunError as err:
        result = {"error": str(err), "type": type(err).__name__}
    except Exception as err:  # what the old code died of on rank 0
        result = {"error": str(err).splitlines()[0][:300], "type": type(err).__name__}
    end_rank_now(result)


def test_a_full_disk_on_one_rank_is_one_line_on_every_rank_during_initialize(tmp_path):
    results = run_ranks(initialize_on_nvme, 2, tmp_path, str(tmp_path), leave_together=False)
    assert results[1]["error"] and "its file system has 8.0 KiB free" in results[1]["error"], results
    assert results[0]["type"] == "RuntimeConfigError", results
    assert results[0]["error"] == "rank 0: setting up NVMe offload failed on rank 1 (its error says why)", results
