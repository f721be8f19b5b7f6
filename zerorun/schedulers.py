"""DeepSpeed's five learning-rate schedules as torch LR schedulers, and the config -> scheduler builder.

    pytest tests/unit/test_schedulers.py

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take the
parameter names and defaults of DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` and give the
same learning rate at every step, so a DeepSpeed config's ``scheduler`` section trains the same
here. They are ordinary ``torch.optim.lr_scheduler.LRScheduler`` subclasses on the user's own
optimizer: ``get_last_lr``, ``state_dict`` and ``load_state_dict`` work as for torch's.

Note [iteration numbering]: DeepSpeed counts ``last_batch_iteration`` from -1 (the value at
construction) and adds one per ``step()``; torch counts ``last_epoch`` from 0 after its own
construction step. So DeepSpeed's iteration is ``last_epoch - 1`` throughout, and each class
writes its formula as a pure function of that iteration (``lrs_at``), which is what the tests
compare against independently written formulas.

Where we differ on purpose: an unknown ``warmup_type`` is an error (DeepSpeed warns and uses
``log``); OneCycle cycles beta1 and keeps the optimizer's own beta2 (DeepSpeed sets it to 0.99).
"""

from __future__ import annotations

import math
import warnings
from typing import Any
from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from zerorun.errors import RuntimeConfigError

WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    """One value per param group: a scalar is repeated, a list must have one entry per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    # DeepSpeed warms up over at least 2 steps: log(1) would make the log ramp divide by zero.
    return max(2, warmup_num_steps)


def _check_fresh(last_batch_iteration: int) -> None:
    if last_batch_iteration != -1:
        raise ValueError("last_batch_iteration other than -1 is not supported; restore a scheduler "
                         "with load_state_dict instead")


def warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 -> 1 over the warm-up: log(it + 1) / log(W), or it / W."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class _DeepSpeedSchedule(LRScheduler):
    """Closed-form schedules: the learning rate is a function of DeepSpeed's iteration only."""

    def get_lr(self) -> list[float | torch.Tensor]:  # LRScheduler's type; these are plain floats
        return list(self.lrs_at(self.last_epoch - 1))  # Note [iteration numbering]

    def lrs_at(self, iteration: int) -> list[float]:  # pragma: no cover - every subclass overrides
        raise NotImplementedError


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps``, then constant."""

    def __init__(self, optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_fresh(last_batch_iteration)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``. ``warmup_max_lr`` defaults to
    0.001 here, as in DeepSpeed (not to the optimizer's lr)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {self.warmup_num_steps}", stacklevel=2)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, (self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_DeepSpeedSchedule):
    """A ratio of the optimizer's lr: ``warmup_min_ratio`` -> 1 over the warm-up, then a cosine down
    to ``cos_min_ratio`` at ``total_num_steps``. The ratio is 0 before the first step."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _check_fresh(last_batch_iteration)
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than "
                          f"warmup_num_steps {self.warmup_num_steps}", stacklevel=2)
        super().__init__(optimizer)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            ramp = warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ramp * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped at 1: past total_num_steps the ratio stays at cos_min_ratio instead of rising again.
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio(iteration)
        return [float(base) * ratio for base in self.base_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """lr = min_lr x (1 + step_rate x (it + 1) / step_size), the interval floored when staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        _check_fresh(last_batch_iteration)
        if (isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int)
                or lr_range_test_step_size <= 0):
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1.0 + self.step_rate * interval) for low in self.min_lrs]


class OneCycle(_DeepSpeedSchedule):
    """One triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` and back (optionally in stairs),
    then ``min_lr / (1 + decay_lr_rate x k / decay_step_size)``; beta1 cycles the other way."""

    def __init__(self, optimizer, cycle_min_lr: float | Sequence[float], cycle_max_lr: float | Sequence[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | Sequence[float] = 0.8,
                 cycle_max_mom: float | Sequence[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        _check_fresh(last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must not be negative, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        no_decay = math.isclose(decay_step_size, 0)
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        # As in DeepSpeed, momentum cycles only for optimizers with betas (Adam family).
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"OneCycle: {type(optimizer).__name__} has no betas; momentum is not cycled", stacklevel=2)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer)

    def scale(self, iteration: int) -> float:
        """Where in the triangle iteration ``iteration`` sits: 0 at the ends, 1 at the peak."""
        position = iteration + 1
        cycle = math.floor(1 + position / self.total_size)
        x = 1.0 + position / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs come from the integer position, not from the float scale: at a half-cycle
            # boundary the float can land a hair under a stair and floor a whole stair lower.
            in_cycle = position % self.total_size
            if in_cycle <= self.first_step_size:
                scale = math.floor(in_cycle * stairs / self.first_step_size) / stairs
            else:
                scale = math.floor((self.total_size - in_cycle) * stairs / self.second_step_size) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [low / factor for low in self.min_lrs]

    def moms_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self.scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * (iteration - self.total_size + 1) / self.decay_step_size
        return [high * factor for high in self.max_moms]

    def step(self, epoch=None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.moms_at(self.last_epoch - 1), strict=True):
                group["betas"] = (beta1, *tuple(group["betas"])[1:])


DEEPSPEED_SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def scheduler_classes() -> dict[str, type]:
    """Every scheduler a config may name: torch.optim.lr_scheduler's classes and DeepSpeed's five."""
    module = torch.optim.lr_scheduler
    classes = {
        name: obj for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, LRScheduler) and obj is not LRScheduler
        and not name.startswith("_")
    }
    classes.update(DEEPSPEED_SCHEDULERS)
    return classes


def build_scheduler(optimizer: torch.optim.Optimizer, spec) -> LRScheduler | None:
    """The scheduler a config's ``scheduler`` section names (``spec.type``, ``spec.params``), on
    ``optimizer``; None without a section. Bad values end in one RuntimeConfigError naming the key."""
    if spec is None:
        return None
    cls = scheduler_classes().get(spec.type)
    if cls is None:
        raise RuntimeConfigError(f"scheduler.type {spec.type!r} is neither a torch.optim.lr_scheduler class "
                                 f"nor one of DeepSpeed's ({', '.join(DEEPSPEED_SCHEDULERS)})")
    for key, value in spec.params.items():
        if value == "auto":
            raise RuntimeConfigError(
                f"scheduler.params.{key} is 'auto', which only the Hugging Face integration fills in",
                hint=f"give scheduler.params.{key} a value")
    try:
        return cls(optimizer, **spec.params)
    except (TypeError, ValueError) as err:
        raise RuntimeConfigError(f"scheduler {spec.type}: {err}",
                                 hint="check scheduler.params against the scheduler's arguments (docs/config.md)") from None
