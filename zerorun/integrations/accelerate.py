"""Run an Accelerate training loop on a zerorun engine, keeping the loop as it is.

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = zerorun.integrations.accelerate.prepare(accelerator, model, optimizer, "ds.json")
    loader, scheduler = accelerator.prepare(loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)              # -> engine.backward
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # -> the engine's clipping
            optimizer.step()                        # -> engine.step
            scheduler.step()
            optimizer.zero_grad()                   # no-op: the engine owns the gradients

What each call does (docs/integrations.md has the same table):

- ``model(...)`` runs ``engine(...)``; ``model.module`` is the user's model, other attributes
  (``config``, ``generate``) are looked up on it. ``save_pretrained`` gathers the whole model
  first (stage 3 holds shards).
- ``accelerator.backward(loss)`` runs ``engine.backward(loss)``. The engine divides by its
  accumulation steps, which must equal the Accelerator's (``"auto"`` in the config takes the
  Accelerator's; a different number is an error naming both), so the gradients are the ones
  Accelerate's own division would give. The accumulation boundary is the Accelerator's
  ``sync_gradients``.
- ``optimizer.step()`` runs ``engine.step()`` (a counter on micro-steps between boundaries, the
  update at a boundary); ``optimizer.zero_grad()`` does nothing.
- ``accelerator.clip_grad_norm_(params, max_norm)``: the engine clips at its step by the
  config's ``gradient_clipping``, over the whole sharded gradient. ``max_norm`` must equal it
  (``inf``, a plain norm query, is always fine); the call runs the engine's step at once, so it
  can return that step's gradient norm (before clipping, as ``torch.nn.utils.clip_grad_norm_``
  returns), and the ``optimizer.step()`` that follows does nothing. Off a boundary, or when the
  engine computed no norm (fp32 without clipping), it returns None. ``"auto"`` for ``gradient_clipping`` is filled from ``prepare(..., max_grad_norm=)``.
- A scheduler built on the optimizer (the user's, before or after ``prepare``, or the returned
  one) drives the engine's learning rate; a scheduler section in the config is built and stepped
  by the engine instead. ``optimizer.step_was_skipped`` tells Accelerate's prepared scheduler
  whether the engine skipped the update (fp16 overflow).
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

import torch
from torch import nn

# Hugging Face's libraries read ds_status/ds_id once they see ZeRO-3: the shim attaches them to
# the engines this integration builds (Note [attributes from the shim] in zerorun/deepspeed/ds_params.py).
import zerorun.deepspeed  # noqa: F401
from zerorun.errors import ConfigError


class EngineModule(nn.Module):
    """The model a wrapped loop holds: forward is the engine's forward."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module  # a registered submodule: parameters(), train() and eval() reach it
        object.__setattr__(self, "engine", engine)  # not a submodule: it is no nn.Module

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine frees or keeps gradients by its own accumulation boundaries."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on rank 0 ({} elsewhere), tied weights once; every rank must call it."""
        return whole_model_state(self.engine)

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """``save_pretrained`` of the whole model, written by rank 0 (collective: call on every rank)."""
        state = self.full_state_dict()
        if self.engine.rank == 0:
            self.module.save_pretrained(save_directory, state_dict=state, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer a wrapped loop holds. A torch Optimizer by type, so torch and transformers
    schedulers accept it; it owns no state (``super().__init__`` is deliberately not called).

    Its ``param_groups`` are the engine's optimizer's, which is the user's own object (the
    engine steps it: zerorun/zero/update.py), so a scheduler built on the user's optimizer,
    on this wrapper or by the config drives the same groups."""

    def __init__(self, engine, router: EngineRouter):
        self.engine = engine
        self._router = router
        self.step_was_skipped = False

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def defaults(self):
        return self.engine.optimizer.defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose groups this one shows (Accelerate matches schedulers by it)."""
        return self.engine.optimizer

    @property
    def state(self):
        return self.engine.optimizer.state

    def step(self, closure: Callable | None = None):
        loss = closure() if closure is not None else None
        self._router.optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: the engine owns the gradients."""

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the engine's last update."""
        return _grad_norm(self.engine)

    def mark_stepped(self) -> None:
        """A torch scheduler warns that it steps before its optimizer unless that optimizer's
        step ran; the engine's update is that step."""
        self.engine.optimizer._opt_called = True

    def state_dict(self):
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.engine.optimizer).__name__}, stage {getattr(self.engine, 'stage', '?')})"

    def __getstate__(self):
        raise TypeError("an EngineOptimizer routes to a live engine and cannot be pickled")


class EngineRouter:
    """Calls the engine's backward and step in the order its contract asks: every backward is
    followed by exactly one ``engine.step()`` (a counter off a boundary, the update at one)
    before the next backward.

    ``step_in_backward``: the step runs right after backward (as DeepSpeed's does under
    Accelerate); Trainer needs that, because it reads the gradient norm before calling
    ``optimizer.step()``. Otherwise the step waits for ``optimizer.step()`` or
    ``clip_grad_norm_``, and a loop that skips ``optimizer.step()`` on micro-steps gets it at
    its next backward.

    ``loss_scaled_for_accumulation``: the caller already divided the loss by the accumulation
    steps (Trainer does), so the engine must not divide again.
    """

    def __init__(self, engine, *, sync_gradients: Callable[[], bool], step_in_backward: bool,
                 loss_scaled_for_accumulation: bool):
        self.engine = engine
        self._sync_gradients = sync_gradients
        self.step_in_backward = step_in_backward
        self.loss_scaled = loss_scaled_for_accumulation
        self.optimizer: EngineOptimizer | None = None
        self._pending = False  # a backward ran and its engine.step() has not yet
        self._just_updated = False  # the last engine.step() was an update
        self.update_lrs: list[float] | None = None  # learning rates of the last update, per group

    def backward(self, loss: torch.Tensor) -> None:
        if self._pending:
            self._step()
        self.engine.set_gradient_accumulation_boundary(bool(self._sync_gradients()))
        self.engine.backward(loss, scale_wrt_gas=not self.loss_scaled)
        self._pending = True
        if self.step_in_backward:
            self._step()

    def optimizer_step(self) -> None:
        if self._pending:
            self._step()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0):
        if float(norm_type) != 2.0:
            raise ConfigError(f"clip_grad_norm_(norm_type={norm_type!r}): the zerorun engine clips by the L2 norm",
                              hint="call it with norm_type=2 (the default)")
        configured = float(self.engine.config.gradient_clipping)
        if not math.isinf(float(max_norm)) and float(max_norm) != configured:
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}) but the zerorun config's gradient_clipping is "
                f"{configured}: the engine clips at its step by the config",
                hint=f"set gradient_clipping: {max_norm} in the zerorun config (0 turns clipping off)")
        if self._pending and self.engine.is_gradient_accumulation_boundary():
            self._step()
        elif not self._just_updated:
            return None
        norm = _grad_norm(self.engine)
        return None if norm is None else torch.tensor(float(norm))

    def _step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary and self.optimizer is not None:
            self.optimizer.mark_stepped()
        if boundary:
            # The engine steps its own scheduler inside step(): keep the rates this update used.
            self.update_lrs = [group["lr"] for group in self.engine.optimizer.param_groups]
        self.engine.step()
        self._pending = False
        self._just_updated = boundary
        if boundary and self.optimizer is not None:
            self.optimizer.step_was_skipped = not self.engine.was_step_applied()


def whole_model_state(engine) -> dict[str, torch.Tensor]:
    """``engine.full_state_dict()`` on rank 0 ({} elsewhere; collective) with each tied parameter
    under its first name only: the gathered copies no longer share storage, so
    ``save_pretrained`` could not tell a tied output head from a trained one, and would write it
    twice."""
    state = engine.full_state_dict(rank0_only=True)
    seen: set[int] = set()
    for name, parameter in engine.module.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            state.pop(name, None)
        seen.add(id(parameter))
    return state


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def fill_for_accelerator(config: dict, accelerator_gradient_accumulation_steps: int,
                         max_grad_norm: float | None) -> dict:
    """The config's autos an Accelerate script can decide (pure): accumulation steps from the
    Accelerator, gradient_clipping from ``max_grad_norm``. The accumulation steps are written when
    the config has none, so the engine and the Accelerator count the same window."""
    from types import SimpleNamespace

    from zerorun.config.deepspeed import looks_like_deepspeed
    from zerorun.integrations.hf_auto import Rule, apply_rules, parent_of

    rules = [Rule("gradient_accumulation_steps", "batch.gradient_accumulation_steps",
                  "gradient_accumulation_steps", lambda a, f: a.gradient_accumulation_steps)]
    if max_grad_norm is not None:
        rules.append(Rule("gradient_clipping", "gradient_clipping", "max_grad_norm", lambda a, f: a.max_grad_norm))
    values = SimpleNamespace(gradient_accumulation_steps=accelerator_gradient_accumulation_steps,
                             max_grad_norm=max_grad_norm)
    out = apply_rules(config, values, {}, rules, source="the Accelerator / prepare()")
    deepspeed = looks_like_deepspeed(out)
    parent, leaf = parent_of(out, "gradient_clipping")
    if parent is not None and parent.get(leaf) == "auto":
        raise ConfigError("gradient_clipping is 'auto' but prepare() got no max_grad_norm to fill it with",
                          hint="pass prepare(..., max_grad_norm=1.0) or write a number in the config")
    if deepspeed:
        out.setdefault("gradient_accumulation_steps", accelerator_gradient_accumulation_steps)
    else:
        out.setdefault("batch", {}).setdefault("gradient_accumulation_steps", accelerator_gradient_accumulation_steps)
    return out


def prepare(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer | None, config: Any = None, *,
            max_grad_norm: float | None = None) -> tuple[EngineModule, EngineOptimizer]:
    """Build the engine for ``model``/``optimizer`` and route ``accelerator``'s backward and
    clip_grad_norm_ to it. Returns (model, optimizer) wrappers; prepare dataloaders and
    schedulers with ``accelerator.prepare`` as usual (after this call, so a prepared scheduler
    sees the wrapper's skipped-step flag).

    ``config``: a zerorun YAML / DeepSpeed JSON path, JSON text or dict. The Accelerator must
    not wrap the model itself: call this instead of ``accelerator.prepare(model, optimizer)``.
    """
    import zerorun
    from zerorun.integrations.hf_auto import read_config

    raw = read_config(config) if config is not None else {}
    steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    filled = fill_for_accelerator(raw, steps, max_grad_norm)
    engine = zerorun.initialize(model, optimizer, filled)
    if engine.gradient_accumulation_steps() != steps:
        raise ConfigError(f"the engine accumulates {engine.gradient_accumulation_steps()} micro-steps but "
                          f"Accelerator(gradient_accumulation_steps={steps})",
                          hint="make the config's accumulation steps 'auto' or equal to the Accelerator's")
    router = EngineRouter(engine, sync_gradients=lambda: accelerator.sync_gradients,
                          step_in_backward=False, loss_scaled_for_accumulation=False)
    wrapped_optimizer = EngineOptimizer(engine, router)
    router.optimizer = wrapped_optimizer
    route_accelerator(accelerator, router)
    accelerator._optimizers.append(wrapped_optimizer)  # its step_was_skipped gates prepared schedulers
    return EngineModule(engine), wrapped_optimizer


def route_accelerator(accelerator, router: EngineRouter) -> None:
    """Point this Accelerator's backward and clip_grad_norm_ at the engine (instance attributes:
    other Accelerator objects are untouched)."""
    accelerator.backward = lambda loss, **kwargs: router.backward(loss)
    accelerator.clip_grad_norm_ = router.clip_grad_norm_
    accelerator.zerorun_engine = router.engine
