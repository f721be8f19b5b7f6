"""pytest tests/unit/test_placements.py — placements against a fake record, with no process group.

A placement needs only a few fields of a record (its unit's layout and chunk, its master, its
gradient, the slot it owns); each one here steps a plain optimizer through the protocol and
must land exactly where the same optimizer on a plain tensor lands.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerorun.errors import RuntimeConfigError
from zerorun.zero.offload.placements import OnDevice, OnFile, OnHost
from zerorun.zero.unit.layout import ParamSpec, UnitLayout

N = 37


def fake_unit(values: torch.Tensor, index: int = 0):
    layout = UnitLayout((ParamSpec("w", values.numel()),), world_size=1)
    return SimpleNamespace(index=index, layout=layout, shard=values.clone(), dtype=torch.float32,
                           device=torch.device("cpu"), partitioned=False, shard_beside_model=True)


class FakeRecord:
    """Only what a placement reads of a record (unit/record.py)."""

    def __init__(self, unit, home):
        self.unit, self.index, self.state_home, self.state_slot = unit, unit.index, home, None
        self.master = home.make_master(unit)
        self.gradient = SimpleNamespace(chunk=torch.linspace(-1, 1, unit.layout.chunk_numel))

    @property
    def master_is_model_storage(self) -> bool:
        return self.master.data_ptr() == self.unit.shard.data_ptr()

    def state_tensors(self, optimizer):
        return {k: v for k, v in optimizer.state.get(self.master, {}).items() if torch.is_tensor(v)}


def homes(tmp_path):
    return {"device": OnDevice(), "host": OnHost(pin_memory=False),
            "nvme": OnFile(str(tmp_path), 0, buffer_count=1, buffer_size=3 * N)}


def update(home, record, optimizer) -> None:
    with home.resident(record, optimizer):
        record.master.grad = home.stage_gradient(record)
        optimizer.step()
        record.master.grad = None
        home.publish(record)


@pytest.mark.parametrize("where", ["device", "host", "nvme"])
def test_a_placement_steps_a_fake_record_like_a_plain_optimizer(where, tmp_path):
    home = homes(tmp_path)[where]
    values = torch.randn(N, generator=torch.Generator().manual_seed(3))
    record = FakeRecord(fake_unit(values), home)
    optimizer = torch.optim.AdamW([record.master], lr=0.1)
    plain = torch.nn.Parameter(values.clone())
    reference = torch.optim.AdamW([plain], lr=0.1)
    for _ in range(3):
        update(home, record, optimizer)
        plain.grad = record.gradient.chunk.clone()
        reference.step()
    assert torch.equal(record.unit.shard, plain.detach())
    home.settle([record])
    held = home.nbytes([record], optimizer)
    # fp32 on the device: the master is the model's chunk, so the two moments and Adam's step
    # count; on the host master + moments + step; NVMe's file holds master + moments, and its
    # host memory is its one buffer.
    expected = {"device": {"device": 2 * N * 4 + 4, "host": 0, "nvme": 0},
                "host": {"device": 0, "host": 3 * N * 4 + 4, "nvme": 0},
                "nvme": {"device": 0, "host": 3 * N * 4, "nvme": 3 * N * 4}}[where]
    assert held == expected
    if where == "nvme":  # nothing resident between updates; the state keeps its keys and sizes
        assert record.master.numel() == 0
        assert {k: v.numel() for k, v in optimizer.state[record.master].items() if k != "step"} == {
            "exp_avg": N, "exp_avg_sq": N}


def test_an_optimizer_with_too_much_state_for_the_file_gives_its_buffer_back(tmp_path):
    home = homes(tmp_path)["nvme"]
    record = FakeRecord(fake_unit(torch.ones(N)), home)
    optimizer = torch.optim.Adam([record.master], lr=0.1, amsgrad=True)  # three state tensors
    with pytest.raises(RuntimeConfigError, match="keeps 3 state tensors"):
        update(home, record, optimizer)
    assert len(home.pool._free) == home.pool.count  # the one buffer is back in the pool
    assert record.master.numel() == 0


@pytest.mark.parametrize("where", ["device", "host", "nvme"])
def test_a_parameter_chunk_lives_in_its_home_and_writes_through(where, tmp_path):
    home = homes(tmp_path)[where]
    chunk = torch.arange(N, dtype=torch.float32)
    placed = home.place_shard(chunk, 5)
    assert torch.equal(placed, chunk)
    placed.add_(1)
    if where == "nvme":
        on_disk = torch.from_file(str(home.directory / "unit5.bin"), size=N, dtype=torch.float32)
        assert torch.equal(on_disk, chunk + 1)
    assert (placed.data_ptr() == chunk.data_ptr()) is (where == "device")
