"""pytest tests/unit/test_norm_grouping.py — the global gradient norm does not depend on how the
gradient is grouped into units (Note [norm in float64], zero/update.py).

Stages 2 and 3 group the same gradient into different units (buckets vs modules), one norm piece
per unit. Summed in fp32 the pieces round differently per grouping and the clip coefficient
moves in its last bits (DeepSpeed-Chat SFT then saved 659 of 45312 weights apart between the
stages); the float64 sums give the same fp32 coefficient."""

import torch

from zerorun.zero.update import square_sum


def coefficient(total: torch.Tensor) -> torch.Tensor:
    """The clip coefficient at 1.0 as update.py applies it: a Python float multiplied into fp32."""
    return torch.ones(1) * (1.0 / (float(total.sqrt()) + 1e-6))


def groupings(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gradient = torch.randn(45312, generator=torch.Generator().manual_seed(seed)) * 0.05
    return list(gradient.split(11328)), list(gradient.split([4096, 256, 8192, 32, 24000, 8736]))


def test_norm_is_the_same_for_every_grouping_of_the_gradient():
    differs = 0
    for seed in range(20):
        units_a, units_b = groupings(seed)
        a = sum(square_sum(p) for p in units_a)
        b = sum(square_sum(p) for p in units_b)
        assert a.dtype == torch.float64
        assert torch.equal(coefficient(a), coefficient(b)), seed
        # the premise: the same pieces summed in fp32, as before, do not always agree
        fp32_a = sum(p.pow(2).sum() for p in units_a)
        fp32_b = sum(p.pow(2).sum() for p in units_b)
        differs += not torch.equal(coefficient(fp32_a), coefficient(fp32_b))
    assert differs > 0
