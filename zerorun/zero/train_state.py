"""What an exact resume restores beside the records: the step counters, where the accumulation
window stands, the loss scaler, the LR scheduler and the param groups' hyper-parameters. The
engine owns one (``engine.train_state``; its counters read and write it), and a checkpoint
saves and loads it (zero/checkpoint/save.py, load.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.reshard import micro_steps_after_load
from zerorun.zero.precision import LossScaler


class Scheduler(Protocol):
    """What a resume needs of an LR scheduler: torch's LRScheduler, or the user's own object."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclasses.dataclass(eq=False)
class TrainState:
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    lr_scheduler: Scheduler | None
    gradient_accumulation_steps: int  # the engine's final config's
    global_step: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {
            "global_step": self.global_step, "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "loss_scaler": dataclasses.asdict(self.loss_scaler),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    def load_state_dict(self, saved: dict, *, load_scheduler: bool = True) -> None:
        """Restore what ``state_dict`` saved; a different accumulation setting now puts the
        window at the boundary of the saved optimizer step."""
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this one "
                                  f"{len(self.optimizer.param_groups)}", hint="build the optimizer with the same groups")
        for group, hyper in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            group.update(hyper)
        self.global_step = saved["global_step"]
        self.skipped_steps = saved["skipped_steps"]
        self.micro_steps = micro_steps_after_load(saved["micro_steps"], saved["gradient_accumulation_steps"],
                                                  saved["global_step"], self.gradient_accumulation_steps)
        for key, value in saved["loss_scaler"].items():
            setattr(self.loss_scaler, key, value)
        if load_scheduler and self.lr_scheduler is not None and saved["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
