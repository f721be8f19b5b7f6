"""pytest tests/distributed/test_memory_formula.py — model-state bytes per rank follow GUIDE §5.

At world size N = 2, fp32 training with Adam, the bytes one rank holds for model states
(Ψ = trainable parameter count) must be:

    stage | parameters | gradients | optimizer state | total
      0   |    4Ψ      |    4Ψ     |      8Ψ         | 16Ψ
      1   |    4Ψ      |    4Ψ     |      8Ψ/N       | 8Ψ + 8Ψ/N
      2   |    4Ψ      |    4Ψ/N   |      8Ψ/N       | 4Ψ + 12Ψ/N
      3   |    4Ψ/N    |    4Ψ/N   |      8Ψ/N       | 16Ψ/N

The engine reports them in ``engine.memory_breakdown()``, counted from its tensors; each family
must be within 5% of the formula, and the communication buffers within the configured bucket
sizes. The optimizer state is also counted here independently, from the optimizer's own state
tensors, so the breakdown cannot simply restate the formula. Measured after the second backward:
Adam's state exists (it is created by the first step) and gradients are held (not yet stepped).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gloo_world import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

WORLD = 2
FP32 = 4
# Element counts. Small next to Ψ (~0.3M) but large enough that every bucket holds several
# parameters; the model-state families get no allowance for them.
BUCKET = 20_000
# (parameters, gradients, optimizer state) per Ψ-byte-unit, as multiples of 4Ψ bytes: the table.
FORMULA = {
    0: (1.0, 1.0, 2.0),
    1: (1.0, 1.0, 2.0 / WORLD),
    2: (1.0, 1.0 / WORLD, 2.0 / WORLD),
    3: (1.0 / WORLD, 1.0 / WORLD, 2.0 / WORLD),
}


def build_model():
    from gpt import GPT, GPTConfig

    # Odd sizes (vocab 101, width 36) so flat buffers need padding to split over the ranks.
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=101, seq_len=16, n_layer=3, n_head=4, d_model=36 * 2))


def planned_gathered_numel() -> int:
    """The planner's stage-3 bound on elements gathered at once, from the same model."""
    from zerorun.planner.counting import count_module
    from zerorun.planner.memory import Training, stage3_unit_sizes

    with torch.device("meta"):
        spec = count_module(build_model(), "gpt")
    training = Training(stage=3, precision="fp32", reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET,
                        prefetch_bucket_size=BUCKET, param_persistence_threshold=0)
    return stage3_unit_sizes(spec, training)[0]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state, each storage counted once."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.numel() > 1:  # skip Adam's scalar `step`
                key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total


def measure(stage: int, rank: int) -> dict:
    import zerorun
    from gpt import synthetic_batch

    model = build_model()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {"zero": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                       "prefetch_bucket_size": BUCKET, "param_persistence_threshold": 0}}
    engine = zerorun.initialize(model, optimizer, config)
    for step in range(2):
        tokens, targets = synthetic_batch(model.cfg, 2 * WORLD, step=step)
        rows = slice(rank * 2, rank * 2 + 2)
        engine.backward(engine(tokens[rows], targets[rows]))
        if step == 0:
            engine.step()
    breakdown = dict(engine.memory_breakdown())
    breakdown["optimizer_state_counted_here"] = optimizer_state_bytes(engine.optimizer)
    breakdown["psi"] = psi
    if stage == 3:
        breakdown["gathered_bound"] = planned_gathered_numel()
    engine.step()
    return breakdown


def measure_each_stage(rank: int) -> dict:
    torch.set_num_threads(1)
    return {stage: measure(stage, rank) for stage in FORMULA}


@pytest.fixture(scope="module")
def breakdowns(tmp_path_factory) -> dict:
    return run_ranks(measure_each_stage, WORLD, tmp_path_factory.mktemp("memory_formula"))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", sorted(FORMULA))
def test_model_state_bytes_per_rank_match_the_formula(breakdowns, stage):
    for rank in range(WORLD):
        got = breakdowns[rank][str(stage)]
        unit = FP32 * got["psi"]  # 4Ψ bytes
        expected = dict(zip(("parameters", "gradients", "optimizer_state"), FORMULA[stage], strict=True))
        for family, multiple in expected.items():
            want = multiple * unit
            assert abs(got[family] - want) <= 0.05 * want, (
                f"stage {stage} rank {rank} {family}: {got[family]:,} bytes, formula {want:,.0f} "
                f"({got[family] / unit:.3f} x 4Ψ instead of {multiple:.3f})"
            )
        assert got["optimizer_state_counted_here"] == pytest.approx(got["optimizer_state"], rel=0.05)
        bucket_bytes = 3 * BUCKET * FP32  # reduce + all-gather + prefetch buckets, at most
        # Stage 3 on CPU also pools the gathered units' buffers (Note [gather pool]): at most
        # what the planner says is gathered at once.
        bucket_bytes += FP32 * got.get("gathered_bound", 0)
        assert got["communication_buffers"] <= bucket_bytes
        want_total = sum(expected.values()) * unit
        assert abs(got["total"] - want_total) <= 0.05 * want_total + bucket_bytes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_stage_saves_what_it_promises(breakdowns):
    """Stage by stage the per-rank total must fall: a flat result would make the test above vacuous."""
    # Model state only: stage 3's pooled gather buffers are bounded by the test above.
    totals = [breakdowns[0][str(s)]["total"] - breakdowns[0][str(s)]["communication_buffers"] for s in sorted(FORMULA)]
    assert totals == sorted(totals, reverse=True) and totals[0] > 1.9 * totals[3]  # 16Ψ vs 16Ψ/N
