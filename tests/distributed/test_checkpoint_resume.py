"""pytest tests/distributed/test_checkpoint_resume.py — a checkpoint resumes training exactly.

Per case (stages 0-3; CPU optimizer offload at stages 1-3; NVMe offload with accumulation and
clipping; stage 3 with accumulation and clipping), on 2 gloo ranks, fp32, CPU: 10 steps
straight against 5 steps, a save, and then, in a *fresh* process group (new processes, other
seeds), a fresh engine that loads the checkpoint and runs 5 more. The model has dropout, a
buffer that training changes, a tied head and a frozen layer; a StepLR scheduler moves the
learning rate; each step also draws from python's ``random`` and numpy's generator. Everything
must be identical (bitwise: ``==`` on losses and draws, ``torch.equal`` on parameters), since
the resumed run performs the same operations on the same values.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_harness as h

WORLD = 2


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    first = h.spawn(h.resume_first_world, WORLD, tmp)
    second = h.spawn(h.resume_second_world, WORLD, tmp)
    return first, second


CASES = [c.name for c in h.resume_cases("/unused")]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_resume_is_exact(worlds, name):
    first, second = worlds
    for rank in range(WORLD):
        straight, before, after = first[rank][name]["straight"], first[rank][name]["first"], second[rank][name]
        assert before["losses"] == straight["losses"][: h.HALF]
        assert after["losses"] == straight["losses"][h.HALF:], f"rank {rank}: losses after resume differ"
        assert after["draws"] == straight["draws"][h.HALF:], f"rank {rank}: python/numpy RNG not resumed"
        assert after["global_step"] == h.STEPS
        assert after["client"] == {"case": name, "next_step": h.HALF}
    final, resumed = first[0][name]["straight"]["final"], second[0][name]["final"]
    assert set(final) == set(resumed)
    for key, value in final.items():
        assert torch.equal(value, resumed[key]), f"{key} differs after resume"
    assert float(resumed["seen"]) == h.STEPS * h.resume_cases("/unused")[CASES.index(name)].accumulation


@pytest.mark.parametrize("dtype,stage,zero", [("bf16", 2, {}), ("fp16", 3, {"offload_optimizer": {"device": "cpu"}}),
                                              ("bf16", 1, {"offload_optimizer": "nvme"}),
                                              ("fp32", 3, {"offload_optimizer": {"device": "cpu"},
                                                           "offload_param": {"device": "cpu"}}),
                                              ("fp32", 3, {"offload_optimizer": "nvme", "offload_param": "nvme"})])
def test_mixed_precision_resumes_exactly_at_world_1(tmp_path, dtype, stage, zero):
    """World 1, in this process: bf16/fp16 masters, the loss scaler, offloaded optimizer state
    and stage-3 parameter offload resume bitwise (the model-dtype parameters are recomputed from the saved fp32 masters)."""
    import zerorun

    zero = {key: h.nvme(str(tmp_path)) if value == "nvme" else value for key, value in zero.items()}
    case = h.ResumeCase("p", stage, zero)
    config = {**case.config(), "precision": {"dtype": dtype, "initial_scale_power": 8}}

    def engine_for(seed):
        model = h.build_dropnet()
        h.seed_rank(seed)
        return zerorun.initialize(model, h.optimizer_for(model), config)

    straight = engine_for(0)
    want = h.run_steps(straight, case, 0, range(6))
    first = engine_for(0)
    h.run_steps(first, case, 0, range(3))
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = engine_for(5)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = h.run_steps(resumed, case, 0, range(3, 6))
    assert got["losses"] == want["losses"][3:] and got["draws"] == want["draws"][3:]
    assert resumed.loss_scale == straight.loss_scale
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_full_state_dict_gathers_one_unit_at_a_time(monkeypatch):
    """Stage 3: at most one partitioned unit is gathered at any moment of full_state_dict (it
    used to gather the whole model on every rank at once)."""
    import zerorun
    from zerorun.zero.unit.storage import FlatUnit, ParamState

    model = h.build_dropnet()
    engine = zerorun.initialize(model, h.optimizer_for(model), {"zero": {"stage": 3, "param_persistence_threshold": 0,
                                                                          "allgather_bucket_size": 10}})
    h.run_steps(engine, h.ResumeCase("g", 3), 0, range(1))
    units = [r.unit for r in engine.records if r.unit.partitioned]
    assert len(units) >= 4
    most = []
    real_gather = FlatUnit.gather

    def counting_gather(self, group):
        real_gather(self, group)
        most.append(sum(u.state is not ParamState.SHARDED for u in units))

    monkeypatch.setattr(FlatUnit, "gather", counting_gather)
    state = engine.full_state_dict()
    assert max(most) == 1 and len(most) >= len(units)
    assert all(u.state is ParamState.SHARDED for u in units)
    assert torch.equal(state["head.weight"], state["embed.weight"])
