"""Count a real ``nn.Module``'s parameters without allocating them: build it on the meta device.

``--model module:function`` (or ``path/to/file.py:function``) names a function that returns
the model; it is called under ``torch.device("meta")`` so a 70B model costs no memory.
Tied parameters (the same tensor reached twice, e.g. GPT-2's lm_head) count once. Frozen
parameters (``requires_grad=False``, a LoRA base) count in the total and apart: they get no
gradient and no optimizer state (Note [frozen units] in zerorun/zero/unit/partition.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from collections.abc import Callable

from zerorun.errors import PlannerError
from zerorun.planner.architecture import ModelSpec


def count_module(model, name: str) -> ModelSpec:
    """ModelSpec of a built module (meta or real): unique parameter tensors and the largest layer."""
    from zerorun.zero.unit.partition import module_tree

    sizes = unique_parameter_sizes(model)
    if not sizes:
        raise PlannerError(f"model {name!r} has no parameters")
    frozen = sum(p.numel() for _, p in model.named_parameters() if not p.requires_grad)
    return ModelSpec(
        name=name,
        num_params=sum(sizes),
        largest_layer_params=largest_layer_elements(model),
        param_sizes=tuple(unique_parameter_sizes(model, trained_only=True)),
        module_tree=module_tree(model),
        frozen_params=frozen,
    )


def largest_layer_elements(model) -> int:
    """Elements held directly by the biggest module (weight + bias of one Linear, say).

    ZeRO-3 gathers one module's own parameters at a time, so this is the smallest gather
    buffer that can work.
    """
    return max(
        (sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()),
        default=0,
    )


def unique_parameter_sizes(model, trained_only: bool = False) -> list[int]:
    # named_parameters() already skips repeats of the same Parameter object (tied weights).
    return [p.numel() for _, p in model.named_parameters() if p.requires_grad or not trained_only]


def load_factory(target: str) -> Callable:
    """``"pkg.module:fn"`` or ``"path/file.py:fn"`` -> the function (imported, not called)."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise PlannerError(
            f"--model {target!r} is not module:function",
            hint="e.g. --model mypkg.models:build or --model train.py:build_model",
        )
    module = _import(module_name, target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PlannerError(f"{module_name!r} has no function {attr!r} (from --model {target!r})")
    return factory


def _import(module_name: str, target: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise PlannerError(f"--model {target!r}: no file {module_name!r}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:  # a .py file always has one; said rather than asserted
            raise PlannerError(f"--model {target!r}: {module_name!r} cannot be imported as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            raise PlannerError(f"--model {target!r}: importing {module_name!r} failed: "
                               f"{type(err).__name__}: {err}") from None
        return module
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`, let the user's cwd be importable
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise PlannerError(f"--model {target!r}: cannot import {module_name!r} ({err})") from None


def required_arguments(factory: Callable) -> list[str]:
    """Names ``factory`` needs but --model cannot give (it is called with no arguments)."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return []
    return [p.name for p in signature.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def build_on_meta(factory: Callable, target: str | None = None):
    """Call ``factory()`` with the meta device as default: shapes only, no storage.

    A class or function that needs arguments (``examples/gpt.py:GPT`` takes a config) and any
    error while building end in one PlannerError line, not the user's traceback.
    """
    import torch

    name = target or getattr(factory, "__qualname__", repr(factory))
    missing = required_arguments(factory)
    if missing:
        what = getattr(factory, "__name__", "it")
        raise PlannerError(
            f"--model {name!r}: {what} needs argument{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}, but --model calls it with none",
            hint=f"point --model at a function without arguments that builds the model, "
                 f"e.g. def build(): return {what}(...)")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as err:
        raise PlannerError(f"--model {name!r}: building the model failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, torch.nn.Module):
        raise PlannerError(f"the --model function returned {type(model).__name__}, not a torch.nn.Module")
    return model


def spec_from_factory(target: str) -> ModelSpec:
    model = build_on_meta(load_factory(target), target)
    return count_module(model, target)
