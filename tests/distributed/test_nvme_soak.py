"""pytest -m soak tests/distributed/test_nvme_soak.py — 5,000 steps with everything on NVMe.

Two gloo ranks train a small MLP at stage 3 with parameters and optimizer state offloaded to
NVMe files, saving a checkpoint every 500 steps with keep_last 2. Each rank measures its
resident memory (VmRSS, after gc and a heap trim), open file descriptors and threads at step
1,000 and at the end. Must hold: RSS growth after step 1,000 under 2 MiB, fd and thread counts
the same, only the last two checkpoints kept, and no scratch file left once the ranks exited.
ZERORUN_SOAK_STEPS shortens the run for a quick look (the bounds are asserted at 5,000 only).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_world import spawn_and_collect

STEPS = int(os.environ.get("ZERORUN_SOAK_STEPS", "5000"))
MEASURE_AT = min(1000, STEPS // 2)
SAVE_EVERY = 500 if STEPS >= 2000 else max(1, STEPS // 5)


def _census() -> dict:
    import gc

    from zerorun.zero.host_memory import trim_host_heap

    gc.collect()
    trim_host_heap()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss_kib": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
            "fds": len(os.listdir("/proc/self/fd"))}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import zerorun
    from zerorun.zero.comm.process_group import leaving_together

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    with leaving_together():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                    torch.nn.Tanh(), torch.nn.Linear(64, 8))
        nvme = f"{out_dir}/nvme"
        engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
            "zero": {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 4160,
                     "offload_param": {"device": "nvme", "nvme_path": nvme},
                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2,
                                           "buffer_size": 3 * 4160}},
            "checkpoint": {"dir": f"{out_dir}/ckpt", "interval_steps": SAVE_EVERY, "keep_last": 2}})
        gen = torch.Generator().manual_seed(rank)
        censuses, losses = {}, []
        for step in range(1, STEPS + 1):
            x = torch.randn(4, 64, generator=gen)
            loss = (engine(x) - x[:, :8]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            if step % 100 == 0:
                losses.append(loss.item())
            if step in (MEASURE_AT, STEPS):
                censuses[step] = _census()
    # The scratch files go when the process exits (weakref.finalize at exit): checked by the test.
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"census": censuses, "losses": losses}))


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.long
@pytest.mark.timeout(3600)
def test_five_thousand_nvme_steps_hold_memory_fds_threads_and_scratch(tmp_path):
    ranks = spawn_and_collect(_worker, tmp_path, world=2)
    for rank, result in ranks.items():
        start, end = result["census"][str(MEASURE_AT)], result["census"][str(STEPS)]
        growth_mib = (end["rss_kib"] - start["rss_kib"]) / 1024
        print(f"rank {rank}: steps {MEASURE_AT}->{STEPS}: RSS {start['rss_kib'] / 1024:.1f} -> "
              f"{end['rss_kib'] / 1024:.1f} MiB (growth {growth_mib:+.2f}), fds {start['fds']} -> {end['fds']}, "
              f"threads {start['threads']} -> {end['threads']}; loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
        if STEPS == 5000:
            assert growth_mib < 2.0
        assert end["fds"] == start["fds"] and end["threads"] == start["threads"]
        assert result["losses"][-1] < result["losses"][0]
    tags = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))
    assert tags == [f"global_step{STEPS - SAVE_EVERY}", f"global_step{STEPS}", "latest"]
    assert not list((tmp_path / "nvme").rglob("*")), "scratch left behind"
