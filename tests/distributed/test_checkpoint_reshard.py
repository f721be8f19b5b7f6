"""pytest tests/distributed/test_checkpoint_reshard.py — a checkpoint loads at another world
size, stage or offload setting, with no offline step, and training goes on with parity.

Three cases of the parity model (tests/distributed/zero_parity_harness.py: odd sizes, a tied
head, a frozen and an unused layer, two param groups) train 5 steps at world 2 and save:
stage 1 AdamW, stage 3 AdamW with CPU optimizer offload, stage 2 SGD with momentum, gradient
accumulation 2 and clipping. They are loaded at world 3 (into stage 1, stage 3, stage 2 without
offload, and stage 3 with NVMe offload) and at world 1 (stage 0, stage 1 with CPU offload, and
stage 2 with accumulation 1) and run 5 more steps of the same global batch. Every continuation
must match a single-process fp32 reference of 10 steps: losses to 1e-5 relative every step,
parameters to 1e-5 absolute at the end (only summation order differs, as in test_zero_parity).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_harness as h
import zero_parity_harness as parity

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))
    saved = h.spawn(h.reshard_save_world, 2, tmp)[0]
    loaded = dict(h.spawn(h.reshard_load_world, 3, tmp)[0])
    loaded.update(h.reshard_load_world(0, 1, tmp))  # world 1: this process, no process group
    references = {c.name: parity.train_reference(c) for c in h.reshard_sources(tmp)}
    return saved, loaded, references


def _check(losses, final, reference, steps) -> tuple[float, float]:
    """Largest relative loss difference and largest parameter difference (printed with -s)."""
    worst_loss = worst_param = 0.0
    for step, got in zip(steps, losses, strict=True):
        want = reference["losses"][step]
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: loss {got!r} vs reference {want!r}"
        worst_loss = max(worst_loss, abs(got - want) / abs(want))
    for name, want in reference["final"].items():
        diff = (final[name] - want).abs().max().item()
        assert diff <= PARAM_ATOL, f"{name}: max difference {diff:.2e}"
        worst_param = max(worst_param, diff)
    return worst_loss, worst_param


LOADS = [(saved, f"{saved}->w{world}-s{case.stage}") for world in (3, 1) for saved, case in h.reshard_loads("/unused", world)]


@pytest.mark.slow
@pytest.mark.parametrize("saved,key", LOADS, ids=[key for _, key in LOADS])
def test_load_at_another_world_size_or_stage(runs, saved, key):
    before, loaded, references = runs
    reference = references[saved]
    for step, got in enumerate(before[saved]):
        assert abs(got - reference["losses"][step]) <= LOSS_RTOL * abs(reference["losses"][step])
    worst_loss, worst_param = _check(loaded[key]["losses"], loaded[key]["final"], reference, range(h.HALF, h.STEPS))
    print(f"\n{key}: loss rel diff <= {worst_loss:.1e}, param diff <= {worst_param:.1e}")
