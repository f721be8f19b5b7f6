"""Precision policy: model dtype per config, and the fp16 dynamic loss scaler.

The scaler is a small state machine with no tensors and no communication: the engine tells
it whether any rank overflowed (one all-reduced flag) and it answers whether to step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerorun.config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_dtype(precision: PrecisionConfig) -> torch.dtype:
    return DTYPES[precision.dtype]


@dataclass
class LossScaler:
    """Dynamic when ``dynamic``: halve on overflow (after ``hysteresis`` overflows in a row),
    double after ``window`` clean steps, never below ``min_scale``. Static otherwise."""

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, precision: PrecisionConfig) -> LossScaler:
        if precision.dtype != "fp16":
            return cls(scale=1.0, dynamic=False)
        if precision.loss_scale and precision.loss_scale > 0:
            return cls(scale=float(precision.loss_scale), dynamic=False)
        return cls(
            scale=float(2 ** precision.initial_scale_power), dynamic=True,
            window=precision.loss_scale_window, hysteresis=precision.hysteresis,
            min_scale=precision.min_loss_scale, hysteresis_left=precision.hysteresis,
        )

    def update(self, overflow: bool) -> bool:
        """Record one optimizer step's outcome; returns True when the step may be applied."""
        if not self.dynamic:
            return not overflow
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.hysteresis_left = self.hysteresis
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= 2.0
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
        return True
