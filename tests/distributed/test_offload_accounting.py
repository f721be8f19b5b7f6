"""pytest tests/distributed/test_offload_accounting.py — where offloaded state lives, measured.

Two gloo ranks train the 8.4M-parameter MLP of planner_mlp.py (fp32, AdamW, stage 2, one layer
per unit) three steps each with the optimizer on the device, on the host (cpu) and in files
(nvme, one host buffer of at most 1.6M elements, sized down to the 1.58M the largest unit
needs: the optimizer state, 50 MB per rank, is 8x the buffer). Each must:
- train exactly like the run without offload (losses equal to 1e-6 relative);
- report in memory_breakdown() host bytes per parameter no more than fp32 master + Adam state +
  the configured buffers, and NVMe bytes equal to master + state;
- agree with the planner's host and NVMe figures (zerorun estimate) within 10%;
- for nvme, keep the process's resident memory after training (heap trimmed) below the
  cpu-offload run's by at least 70% of the state it moved to disk (it holds one buffer instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gloo_world import run_ranks

pytestmark = pytest.mark.slow

BUFFER = 1_600_000  # >= master + two Adam moments of the largest chunk (a 1024x1024 layer over 2 ranks)
MODES = {
    "none": {"device": "none"},
    "cpu": {"device": "cpu"},
    "nvme": {"device": "nvme", "buffer_count": 1, "buffer_size": BUFFER},
}


def _train_offloaded(rank: int, out_dir: str, settings: dict) -> dict:
    import psutil
    import torch

    import planner_mlp
    import zerorun
    from zerorun.zero.host_memory import trim_host_heap

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = planner_mlp.build()
    offload = dict(settings["offload"])
    if offload["device"] == "nvme":
        offload["nvme_path"] = out_dir
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
        "zero": {"stage": 2, "reduce_bucket_size": 1_100_000, "offload_optimizer": offload}})
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        x = torch.randn(4, planner_mlp.WIDTH, generator=gen)[rank * 2 : rank * 2 + 2]
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if offload["device"] == "nvme":
        engine.quiesce()
    trim_host_heap()  # what is resident now is what is held, not what glibc kept
    result = {"losses": losses, "breakdown": engine.memory_breakdown(),
              "params": sum(p.numel() for p in model.parameters()),
              "settled_rss": psutil.Process().memory_info().rss}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for mode, offload in MODES.items():
        out = tmp_path_factory.mktemp(mode)
        found[mode] = run_ranks(_train_offloaded, 2, out, str(out), {"offload": offload})
    return found


def _planner(offload: str):
    from zerorun.planner.counting import spec_from_factory
    from zerorun.planner.memory import Job, Training, estimate

    spec = spec_from_factory(f"{Path(__file__).with_name('planner_mlp.py')}:build")
    return estimate(spec, Job(2), Training(stage=2, precision="fp32", offload=offload, reduce_bucket_size=1_100_000,
                                           device="cpu", nvme_buffer_count=1, nvme_buffer_size=BUFFER))


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_offload_trains_exactly_like_no_offload(runs, mode):
    for rank in range(2):
        for got, want in zip(runs[mode][rank]["losses"], runs["none"][rank]["losses"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want)


@pytest.mark.parametrize("mode, planner_offload", [("cpu", "cpu-optimizer"), ("nvme", "nvme")])
def test_host_and_nvme_bytes_are_bounded_and_match_the_planner(runs, mode, planner_offload):
    plan = _planner(planner_offload)
    for rank in range(2):
        result = runs[mode][rank]
        b = result["breakdown"]
        share = -(-result["params"] // 2)
        buffers = 4 * BUFFER if mode == "nvme" else 0
        print(f"{mode} rank {rank}: host {b['offloaded_host'] / 2**20:.1f} MiB (planner {plan.host_per_rank / 2**20:.1f}), "
              f"nvme {b['offloaded_nvme'] / 2**20:.1f} MiB (planner {plan.nvme_per_rank / 2**20:.1f}), "
              f"device optimizer state {b['optimizer_state']}")
        assert b["optimizer_state"] == 0
        assert b["offloaded_host"] <= (4 + 8) * share * 1.01 + buffers  # master + Adam + buffers (padding)
        assert b["offloaded_host"] == pytest.approx(plan.host_per_rank, rel=0.10)
        assert b["offloaded_nvme"] == pytest.approx(plan.nvme_per_rank, rel=0.10)
        if mode == "nvme":
            assert b["offloaded_host"] <= 4 * BUFFER
            assert b["offloaded_nvme"] >= 4 * b["offloaded_host"]  # the state is >= 4x the buffers


def test_nvme_keeps_host_memory_to_its_buffers(runs):
    for rank in range(2):
        cpu, nvme = runs["cpu"][rank], runs["nvme"][rank]
        moved = nvme["breakdown"]["offloaded_nvme"] - nvme["breakdown"]["offloaded_host"]
        print(f"rank {rank}: resident after training: cpu-offload {cpu['settled_rss'] / 2**20:.0f} MiB, "
              f"nvme {nvme['settled_rss'] / 2**20:.0f} MiB (state on disk {moved / 2**20:.0f} MiB more than the buffer)")
        assert nvme["settled_rss"] <= cpu["settled_rss"] - 0.7 * moved
