"""pytest tests/unit/test_schedulers.py — DeepSpeed's five LR schedules: the lr at every step.

The expected values are written here from DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py),
independently of zerorun/schedulers.py, with DeepSpeed's numbering: iteration -1 at construction,
one more per step(). A few values are also checked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from zerorun.config import SchedulerConfig
from zerorun.errors import RuntimeConfigError
from zerorun.schedulers import (
    LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler,
)


def _optimizer(lr=0.1, kind=torch.optim.AdamW, groups=1):
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(groups)]
    return kind([{"params": [p]} for p in params], lr=lr)


def _lrs(scheduler, optimizer, steps):
    """The lr in force at construction, then after each of ``steps`` step() calls."""
    seen = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        seen.append(optimizer.param_groups[0]["lr"])
    return seen


def _ramp(it, warm, kind):
    warm = max(2, warm)
    return math.log(it + 1) / math.log(warm) if kind == "log" else it / warm


def expected_warmup(it, lo, hi, warm, kind):
    if it < 0:
        return lo
    gamma = _ramp(it, warm, kind) if it < max(2, warm) else 1.0
    return lo + (hi - lo) * gamma


def expected_warmup_decay(it, total, lo, hi, warm, kind):
    if it < 0:
        return lo
    warm2 = max(2, warm)
    if it < warm2:
        gamma = _ramp(it, warm, kind)
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warm2))
    return lo + (hi - lo) * gamma


def expected_cosine(it, base, total, min_ratio, warm, cos_min, kind):
    if it < 0:
        return 0.0
    warm2 = max(2, warm)
    if it < warm2:
        return base * (min_ratio + _ramp(it, warm, kind) * (1 - min_ratio))
    progress = min(1.0, (it - warm2 + 1) / max(1, total - warm2))
    return base * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def expected_range(it, lo, size, rate, stairs):
    if it < 0:
        return lo
    interval = (it + 1) / size
    return lo * (1 + rate * (math.floor(interval) if stairs else interval))


def expected_one_cycle(it, lo, hi, first, second, decay_rate=0.0, decay_size=0):
    if it < 0:
        return lo
    total = first + second
    if it < total:
        pos = it + 1
        x = 1 + pos / total - math.floor(1 + pos / total)
        ratio = first / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * scale
    if decay_size == 0 or decay_rate == 0:
        return lo
    return lo / (1 + decay_rate * (it - total + 1) / decay_size)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_every_step(kind):
    opt = _optimizer(lr=0.05)
    seen = _lrs(WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type=kind), opt, 25)
    for step, lr in enumerate(seen):
        assert lr == pytest.approx(expected_warmup(step - 1, 0.001, 0.01, 10, kind), rel=1e-12, abs=1e-15)


def test_warmup_lr_defaults_and_hand_values():
    opt = _optimizer(lr=0.01)
    seen = _lrs(WarmupLR(opt, warmup_num_steps=10), opt, 12)  # min 0, max = optimizer lr, log ramp
    assert seen[0] == 0.0 and seen[1] == 0.0  # log(1) = 0 for the first step too
    assert seen[2] == pytest.approx(0.01 * 0.30103, rel=1e-4)  # log 2 / log 10
    assert seen[10] == pytest.approx(0.01) and seen[12] == pytest.approx(0.01)
    assert WarmupLR(_optimizer(), warmup_num_steps=1).warmup_num_steps == 2  # as DeepSpeed


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_every_step(kind):
    opt = _optimizer()
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10,
                          warmup_type=kind)
    for step, lr in enumerate(_lrs(sched, opt, 30)):
        assert lr == pytest.approx(expected_warmup_decay(step - 1, 20, 0.0, 0.01, 10, kind), rel=1e-12, abs=1e-15)


def test_warmup_decay_hand_values_and_default_max():
    opt = _optimizer(lr=0.5)
    seen = _lrs(WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=10, warmup_type="linear"), opt, 26)
    assert seen[11] == pytest.approx(0.001)   # it 10: (20 - 10) / 10 of DeepSpeed's default max 0.001
    assert seen[16] == pytest.approx(0.0005)  # it 15: half way down
    assert seen[21] == 0.0 and seen[26] == 0.0


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_every_step(kind):
    opt = _optimizer(lr=0.1)
    sched = WarmupCosineLR(opt, total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=8,
                           cos_min_ratio=0.01, warmup_type=kind)
    for step, lr in enumerate(_lrs(sched, opt, 40)):
        assert lr == pytest.approx(expected_cosine(step - 1, 0.1, 30, 0.1, 8, 0.01, kind), rel=1e-12, abs=1e-15)


def test_warmup_cosine_hand_values():
    opt = _optimizer(lr=0.1)
    seen = _lrs(WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=10, cos_min_ratio=0.0,
                               warmup_type="linear"), opt, 25)
    assert seen[0] == 0.0
    assert seen[6] == pytest.approx(0.05)          # it 5: 5/10 of the warm-up
    assert seen[11] == pytest.approx(0.0975528, rel=1e-6)  # it 10: (1 + cos(0.1 pi)) / 2
    assert seen[20] == pytest.approx(0.0, abs=1e-12) and seen[25] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("stairs", [False, True])
def test_lr_range_test_every_step(stairs):
    opt = _optimizer()
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=10, lr_range_test_step_rate=1.0,
                        lr_range_test_staircase=stairs)
    seen = _lrs(sched, opt, 35)
    for step, lr in enumerate(seen):
        assert lr == pytest.approx(expected_range(step - 1, 1e-3, 10, 1.0, stairs), rel=1e-12)
    assert seen[10] == pytest.approx(2e-3)  # it 9: one whole interval
    assert seen[9] == pytest.approx(1e-3 if stairs else 1.9e-3)  # it 8: 0.9 of an interval


def test_one_cycle_every_step_and_momentum():
    opt = _optimizer()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10, cycle_second_step_size=6,
                     decay_lr_rate=0.5, decay_step_size=5, cycle_min_mom=0.85, cycle_max_mom=0.95)
    seen = _lrs(sched, opt, 30)
    for step, lr in enumerate(seen):
        assert lr == pytest.approx(expected_one_cycle(step - 1, 0.01, 0.1, 10, 6, 0.5, 5), rel=1e-12)
    assert opt.param_groups[0]["betas"][1] == 0.999  # beta2 is the optimizer's own


def test_one_cycle_hand_values():
    opt = _optimizer()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=10)
    assert opt.param_groups[0]["betas"][0] == 0.8  # construction: min momentum, min lr
    seen = _lrs(sched, opt, 25)
    assert seen[5] == pytest.approx(0.055)   # it 4: half way up
    assert seen[10] == pytest.approx(0.1)    # it 9: the peak
    assert seen[15] == pytest.approx(0.055)  # it 14: half way down
    assert seen[20] == pytest.approx(0.01) and seen[25] == pytest.approx(0.01)  # no decay by default
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9)  # after the cycle: max momentum


def test_one_cycle_stairs():
    opt = _optimizer()
    seen = _lrs(OneCycle(opt, 0.0, 1.0, cycle_first_step_size=10, cycle_first_stair_count=2), opt, 20)
    assert seen[4] == 0.0 and seen[5] == pytest.approx(0.5) and seen[10] == pytest.approx(1.0)


def test_per_group_lists_and_state_dict():
    opt = _optimizer(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4, warmup_type="linear")
    for _ in range(3):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])  # it 2 of 4
    state = sched.state_dict()
    again = WarmupLR(_optimizer(groups=2), warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4,
                     warmup_type="linear")
    again.load_state_dict(state)
    assert again.get_lr() == pytest.approx([0.5, 0.15])


def test_builder_takes_torch_and_deepspeed_names():
    opt = _optimizer()
    assert isinstance(build_scheduler(opt, SchedulerConfig("StepLR", {"step_size": 3})), torch.optim.lr_scheduler.StepLR)
    assert isinstance(build_scheduler(_optimizer(), SchedulerConfig("WarmupLR", {"warmup_num_steps": 5})), WarmupLR)
    assert build_scheduler(opt, None) is None


@pytest.mark.parametrize("spec, words", [
    (SchedulerConfig("WarmupLR", {"warmup_type": "cubic"}), "warmup_type must be 'log' or 'linear'"),
    (SchedulerConfig("WarmupDecayLR", {}), "total_num_steps"),
    (SchedulerConfig("WarmupDecayLR", {"total_num_steps": "auto"}), "scheduler.params.total_num_steps is 'auto'"),
    (SchedulerConfig("Nope", {}), "neither a torch.optim.lr_scheduler class"),
])
def test_builder_errors_name_the_problem(spec, words):
    with pytest.raises(RuntimeConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        build_scheduler(_optimizer(), spec)
