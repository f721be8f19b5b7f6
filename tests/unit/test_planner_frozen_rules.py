"""pytest tests/unit/test_planner_frozen_rules.py — the planner's rules for frozen parameters and
leaf classes, on models counted on the meta device (no process group; the engine's own figures
are compared in tests/distributed/test_planner_frozen_leaf.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerorun.errors import PlannerError
from zerorun.planner.counting import count_module
from zerorun.planner.memory import Job, Training, estimate, gradient_bucket_sizes, stage3_unit_sizes


def adapter_model() -> nn.Module:
    """Four frozen 64x64 Linears, each with a trainable rank-2 pair beside it."""
    blocks = []
    for _ in range(4):
        base = nn.Linear(64, 64)
        base.requires_grad_(False)
        blocks += [base, nn.Linear(64, 2, bias=False), nn.Linear(2, 64, bias=False)]
    return nn.Sequential(*blocks)


def counted(build) -> object:
    with torch.device("meta"):
        return count_module(build(), "m")


FROZEN = 4 * (64 * 64 + 64)
TRAINED = 4 * 2 * 64 * 2


def test_frozen_parameters_count_as_parameters_only():
    spec = counted(adapter_model)
    assert (spec.num_params, spec.frozen_params, spec.trained_params) == (FROZEN + TRAINED, FROZEN, TRAINED)
    assert sorted(spec.param_sizes) == [128] * 8  # only trained tensors get gradient buckets
    for stage, (grads, optimizer) in {0: (TRAINED, TRAINED), 1: (TRAINED, TRAINED / 2),
                                      2: (TRAINED / 2, TRAINED / 2), 3: (TRAINED / 2, TRAINED / 2)}.items():
        est = estimate(spec, Job(2), Training(stage=stage, precision="fp32"))
        assert (est.grads, est.optimizer) == (4 * grads, 8 * optimizer), stage
        assert est.params == 4 * (FROZEN + TRAINED) / (2 if stage == 3 else 1)
    assert sum(gradient_bucket_sizes(spec, Training(stage=2))) == TRAINED


def test_a_frozen_stage3_chunk_stays_in_the_model_dtype():
    """Note [fp32 shard] is for trained chunks (they are their own master); a frozen chunk has
    no master and keeps bf16: 2 bytes per element, not 4."""
    est = estimate(counted(adapter_model), Job(2), Training(stage=3, precision="bf16"))
    assert est.params == 2 * FROZEN / 2 + 4 * TRAINED / 2
    assert est.optimizer == 8 * TRAINED / 2  # Adam's moments; the master is the fp32 chunk


def test_frozen_units_are_gathered_with_the_trained_ones():
    spec = counted(adapter_model)
    small = Training(stage=3, precision="fp32", allgather_bucket_size=1000, param_persistence_threshold=0)
    gathered, bucket, units = stage3_unit_sizes(spec, small)
    assert gathered >= 64 * 64 + 64  # a frozen base is gathered: on main only the adapters counted
    assert bucket == 64 * 2 and units == 8  # buckets: the trained units alone (the root merges no pieces)


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)


class Mixture(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffns = nn.ModuleList(Expert() for _ in range(4))  # not named "expert": no leaf by structure


def test_a_leaf_class_named_by_the_config_is_planned_as_one_unit():
    spec = counted(lambda: nn.Sequential(Mixture(), Mixture()))
    plain = Training(stage=3, precision="fp32", allgather_bucket_size=1000)
    one_expert = 32 * 64 + 64
    assert stage3_unit_sizes(spec, plain)[1] == one_expert
    leaves = Training(stage=3, precision="fp32", allgather_bucket_size=1000, leaf_modules=("Mixture",))
    assert stage3_unit_sizes(spec, leaves)[1] == 4 * one_expert  # the block, gathered whole
    with pytest.raises(PlannerError, match="zero.leaf_modules names Mixtur, which no module"):
        stage3_unit_sizes(spec, Training(stage=3, leaf_modules=("Mixtur",)))
