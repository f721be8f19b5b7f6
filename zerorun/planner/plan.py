"""The planner's answer: every (stage, offload) option, whether it fits, and which to pick (pure).

"Cheapest" means least extra communication and data movement, in this order:
stage 0 < 1 < 2 < 3 without offload (stages 1 and 2 move the same bytes as plain
data parallelism, stage 3 gathers parameters again in forward and backward: 1.5x), then CPU
optimizer offload (stage 1, 2, 3), CPU optimizer+parameter offload (stage 3), then NVMe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zerorun.planner.activations import ActivationJob
from zerorun.planner.architecture import ModelSpec
from zerorun.planner.memory import (
    OFFLOADS,
    STAGES,
    Job,
    MemoryEstimate,
    Training,
    estimate,
    offload_supported,
)

_OFFLOAD_COST = {"none": 0, "cpu-optimizer": 1, "cpu-optimizer+params": 2, "nvme": 3}


@dataclass(frozen=True)
class Limits:
    """Memory available per GPU and per host, in bytes; None = not checked."""

    gpu_bytes: float | None = None
    host_bytes: float | None = None


@dataclass(frozen=True)
class Option:
    estimate: MemoryEstimate
    fits_gpu: bool | None  # None when no limit was given
    fits_host: bool | None

    @property
    def fits(self) -> bool | None:
        checks = [c for c in (self.fits_gpu, self.fits_host) if c is not None]
        return all(checks) if checks else None

    @property
    def label(self) -> str:
        return f"stage {self.estimate.stage} / {self.estimate.offload}"


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    job: Job
    training: Training  # the requested configuration (its stage/offload mark the "chosen" row)
    activation_job: ActivationJob | None
    limits: Limits
    options: tuple[Option, ...]

    @property
    def recommended(self) -> Option | None:
        """The cheapest option that fits; None if none fits or no limit was given."""
        fitting = [o for o in self.options if o.fits]
        return min(fitting, key=lambda o: cost_rank(o.estimate.stage, o.estimate.offload), default=None)

    @property
    def requested(self) -> Option | None:
        for option in self.options:
            if (option.estimate.stage, option.estimate.offload) == (self.training.stage, self.training.offload):
                return option
        return None


def cost_rank(stage: int, offload: str) -> tuple[int, int]:
    return (_OFFLOAD_COST[offload], stage)


def make_plan(model: ModelSpec, job: Job, training: Training,
              activation_job: ActivationJob | None = None, limits: Limits = Limits()) -> Plan:
    """Evaluate every supported (stage, offload) pair with the rest of ``training`` fixed."""
    options = []
    for offload in OFFLOADS:
        for stage in STAGES:
            if not offload_supported(stage, offload):
                continue
            est = estimate(model, job, replace(training, stage=stage, offload=offload), activation_job)
            options.append(_judge(est, limits))
    options.sort(key=lambda o: cost_rank(o.estimate.stage, o.estimate.offload))
    return Plan(model, job, training, activation_job, limits, tuple(options))


def _judge(est: MemoryEstimate, limits: Limits) -> Option:
    fits_gpu = None if limits.gpu_bytes is None else est.gpu_total <= limits.gpu_bytes
    fits_host = None if limits.host_bytes is None else est.host_per_node <= limits.host_bytes
    return Option(est, fits_gpu, fits_host)
