"""``engine.config`` as DeepSpeed code reads it: a dict shaped like DeepSpeed's config, which still
answers zerorun's typed fields.

    pytest tests/unit/test_deepspeed_surface.py -k config

DeepSpeed's engine exposes its config as the dict it was given (transformers' Trainer asks
``engine.config.get("zero_optimization", {}).get("stage")``); zerorun's engine exposes its typed
``ZerorunConfig`` (``engine.config.zero.stage``). An engine built by ``deepspeed.initialize`` gets
this view: ``dict`` access gives the given DeepSpeed dict with the values the engine settled on
written over it (batch sizes derived for the world, stage, precision, clipping: no "auto" left in
them), and attribute access falls through to the typed config, so zerorun's own code and users
of the typed fields are unaffected.
"""

from __future__ import annotations

import copy
from typing import Any


def deepspeed_shaped(typed, given: dict | None) -> dict:
    """``given`` (a DeepSpeed dict, or None) with the settled values of ``typed`` written over it."""
    out = copy.deepcopy(given) if isinstance(given, dict) else {}
    batch = typed.batch
    out.update(train_batch_size=batch.train_batch_size, train_micro_batch_size_per_gpu=batch.micro_batch_size,
               gradient_accumulation_steps=typed.gradient_accumulation_steps,
               gradient_clipping=typed.gradient_clipping)
    zero = out.get("zero_optimization")
    if not isinstance(zero, dict):
        zero = out["zero_optimization"] = {}
    zero["stage"] = typed.zero.stage
    for key in [key for key, value in zero.items() if value == "auto"]:
        del zero[key]  # DeepSpeed drops them too: its default applied
    for name in ("fp16", "bf16"):
        section = out.get(name)
        if not isinstance(section, dict):
            section = out[name] = {}
        section["enabled"] = typed.precision.dtype == name
    if typed.optimizer is not None:
        out["optimizer"] = {"type": typed.optimizer.type, "params": dict(typed.optimizer.params)}
    return out


class DeepSpeedConfigView(dict):
    """DeepSpeed's dict for ``get``/``[]``/``in``; zerorun's ``ZerorunConfig`` for attributes."""

    def __init__(self, typed, given: dict | None = None):
        super().__init__(deepspeed_shaped(typed, given))
        self.typed = typed

    def __getattr__(self, name: str) -> Any:
        typed = self.__dict__.get("typed")
        if typed is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(typed, name)


def deepspeed_dict(config) -> dict:
    """The DeepSpeed-shaped dict of an engine's config, whether it is the view or the typed one."""
    return config if isinstance(config, dict) else deepspeed_shaped(config, None)
