"""pytest tests/integrations/test_routing.py — how the Accelerate/Trainer wrappers drive the engine.

No process group: a recording stand-in for the engine checks the call contract (one
engine.step() after every backward, the loss handed over unscaled or pre-scaled, clipping
settings checked against the config, hyper-parameters carried to the engine's optimizer).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import warnings

import torch

from zerorun.errors import ConfigError
from zerorun.integrations.accelerate import EngineOptimizer, EngineRouter, fill_for_accelerator


class RecordingEngine:
    def __init__(self, accumulation=2, clipping=0.5, optimizer=None):
        self.calls = []
        self.accumulation_steps = accumulation
        self.micro_steps = 0
        self.skipped_steps = 0
        self.config = SimpleNamespace(gradient_clipping=clipping)
        self.last_grad_norm = None
        self.lr_scheduler = None
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = optimizer or torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.boundary_override = None

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def gradient_accumulation_steps(self):  # a method, as on DeepSpeed's engine and zerorun's
        return self.accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.boundary_override = is_boundary

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append(("backward", float(loss)) if scale_wrt_gas else ("backward", float(loss), False))

    def step(self):
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if boundary:
            self.last_grad_norm = 2.0
        self.calls.append(("step", boundary))

    def was_step_applied(self):
        return self.skipped_steps == 0

    def get_global_grad_norm(self):
        return self.last_grad_norm


def router_for(engine, *, step_in_backward=False, scaled=False, sync=True):
    router = EngineRouter(engine, sync_gradients=lambda: sync, step_in_backward=step_in_backward,
                          loss_scaled_for_accumulation=scaled)
    router.optimizer = EngineOptimizer(engine, router)
    return router


def test_every_backward_gets_exactly_one_engine_step():
    engine = RecordingEngine()
    router = router_for(engine)
    router.backward(torch.tensor(1.0))
    router.backward(torch.tensor(2.0))  # no optimizer.step() in between: the step comes first
    router.optimizer.step()
    router.optimizer.step()  # a second call without a backward does nothing
    assert engine.calls == [("backward", 1.0), ("step", False), ("backward", 2.0), ("step", True)]


def test_a_loss_already_divided_by_the_caller_is_not_divided_again():
    engine = RecordingEngine(accumulation=4)
    router_for(engine, scaled=True).backward(torch.tensor(0.25))
    assert engine.calls[0] == ("backward", 0.25, False)
    unscaled = RecordingEngine(accumulation=4)
    router_for(unscaled).backward(torch.tensor(0.25))
    assert unscaled.calls[0] == ("backward", 0.25)  # the engine divides by its 4


def test_clip_grad_norm_checks_the_config_and_returns_the_steps_norm():
    engine = RecordingEngine(accumulation=1, clipping=0.5)
    router = router_for(engine)
    router.backward(torch.tensor(1.0))
    with pytest.raises(ConfigError, match=r"max_norm=1.0\) but the zerorun config's gradient_clipping is 0.5"):
        router.clip_grad_norm_(engine.module.parameters(), 1.0)
    with pytest.raises(ConfigError, match="L2"):
        router.clip_grad_norm_(engine.module.parameters(), 0.5, norm_type=1)
    norm = router.clip_grad_norm_(engine.module.parameters(), 0.5)
    assert float(norm) == 2.0 and engine.calls[-1] == ("step", True)
    router.optimizer.step()  # the step already ran
    assert [c for c in engine.calls if c[0] == "step"] == [("step", True)]
    assert float(router.clip_grad_norm_(None, float("inf"))) == 2.0  # a plain norm query is always fine


def test_trainer_mode_steps_in_backward_so_the_norm_is_known_before_optimizer_step():
    engine = RecordingEngine(accumulation=1)
    router = router_for(engine, step_in_backward=True, scaled=True)
    router.backward(torch.tensor(1.0))
    assert engine.calls[-1] == ("step", True)
    assert float(router.clip_grad_norm_(None, float("inf"))) == 2.0


def test_schedulers_on_the_users_optimizer_drive_the_update_and_skips_are_reported():
    model = torch.nn.Linear(2, 2)
    user = torch.optim.AdamW([{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 2.0}])
    engine = RecordingEngine(accumulation=1, optimizer=user)  # the engine steps the user's object
    router = EngineRouter(engine, sync_gradients=lambda: True, step_in_backward=False,
                          loss_scaled_for_accumulation=False)
    wrapper = EngineOptimizer(engine, router)
    router.optimizer = wrapper
    scheduler = torch.optim.lr_scheduler.LambdaLR(user, lambda step: 0.5 ** step)
    router.backward(torch.tensor(1.0))
    wrapper.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about the order: the engine's update is the step
        scheduler.step()
    router.backward(torch.tensor(1.0))
    wrapper.step()
    assert [g["lr"] for g in user.param_groups] == [0.5, 1.0]
    assert wrapper.param_groups is user.param_groups and wrapper.optimizer is user
    assert wrapper.step_was_skipped is False
    engine.step = lambda: (setattr(engine, "skipped_steps", engine.skipped_steps + 1), engine.calls.append("skip"))
    router.backward(torch.tensor(1.0))
    wrapper.step()
    assert wrapper.step_was_skipped is True


def test_accelerator_values_fill_the_config_and_conflicts_name_both():
    assert fill_for_accelerator({"zero_optimization": {"stage": 2}}, 4, None) == {
        "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    assert fill_for_accelerator({"zero": {"stage": 3}}, 2, None) == {
        "zero": {"stage": 3}, "batch": {"gradient_accumulation_steps": 2}}
    assert fill_for_accelerator({"gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}, 2, 1.0) == {
        "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=8 .* gradient_accumulation_steps=2"):
        fill_for_accelerator({"gradient_accumulation_steps": 8}, 2, None)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        fill_for_accelerator({"gradient_clipping": "auto"}, 1, None)
