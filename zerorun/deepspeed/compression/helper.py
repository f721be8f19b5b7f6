"""``deepspeed.compression.helper``: the two attribute helpers DeepSpeed-Chat's LoRA module imports
(real, since they are plain module-tree utilities); every other name is a compression stand-in
that raises UnsupportedFeature on first use."""

from __future__ import annotations

from functools import reduce

from zerorun.deepspeed.unsupported import module_getattr


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name`` "a.b.c"."""
    return reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name: str, module) -> None:
    """Replace ``model.a.b.c`` by ``module`` for ``module_name`` "a.b.c"."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)


__getattr__ = module_getattr("deepspeed.compression.helper", "model compression")
