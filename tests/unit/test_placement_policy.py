"""pytest tests/unit/test_placement_policy.py — a per-unit placement policy is one small class.

The design test of docs/runtime.md (Offload): "embeddings on the device, the rest in NVMe
files" needs nothing but a callable from a unit to a placement, passed as
``initialize(state_home_for=...)``. One process, stage 3 (each module its own unit): the
embedding's master and state stay beside the model, the other units' live in files, and
three AdamW steps land where the same model without offload lands (to 1e-6: the offloaded
units update on the host's fused kernel, which agrees with the per-tensor path to float
rounding, Note [host optimizer kernels]).
"""

from __future__ import annotations

import torch
from torch import nn

from zerorun.zero.engine import initialize
from zerorun.zero.offload.placements import OnDevice, OnFile


class EmbeddingsOnDevice:
    """The embedding's unit on the device, every other unit in NVMe files."""

    def __init__(self, nvme_path: str):
        self.device = OnDevice()
        self.files = OnFile(nvme_path, 0, buffer_count=2, buffer_size=4096)

    def __call__(self, unit):
        return self.device if any(name.startswith("embed.") for name in unit.names) else self.files


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11))

    def forward(self, tokens):
        return self.body(self.embed(tokens))


CONFIG = {"zero": {"stage": 3, "param_persistence_threshold": 0}}


def _trained(state_home_for=None) :
    torch.manual_seed(0)
    model = Tiny()
    engine = initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG, state_home_for=state_home_for)
    tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        logits = engine(tokens)
        engine.backward(nn.functional.cross_entropy(logits.reshape(-1, 11), tokens.reshape(-1)))
        engine.step()
    engine.quiesce()
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}, engine


def test_embeddings_on_the_device_and_the_rest_on_nvme_is_one_small_class(tmp_path):
    policy = EmbeddingsOnDevice(str(tmp_path / "nvme"))
    placed, engine = _trained(policy)
    homes = {tuple(r.unit.names): r.state_home for r in engine.records}
    assert any(home is policy.device for home in homes.values())
    assert any(home is policy.files for home in homes.values())
    assert all((home is policy.device) == names[0].startswith("embed.") for names, home in homes.items())
    breakdown = engine.memory_breakdown()
    assert breakdown["optimizer_state"] > 0 and breakdown["offloaded_nvme"] > 0
    reference, _ = _trained()
    assert placed.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(placed[name], reference[name], rtol=1e-6, atol=1e-6, msg=name)
