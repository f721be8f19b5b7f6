"""Stage 3: modules gathered as one unit when they run, whatever their children do ("leaf" modules).

    pytest tests/unit/test_leaf_modules.py

Note [expert blocks]: a mixture-of-experts block runs only the experts its router picked for this
rank's tokens. If each expert were a unit of its own, a rank whose tokens skip an expert would
not gather it while another rank does: the ranks' all-gathers pair up wrongly (wrong values on
that rank from the first step, then a hang). So the whole block is one unit, gathered when the
block runs on every rank, as DeepSpeed's ``set_z3_leaf_modules`` does. A block is a leaf when:
- it looks like one (``looks_like_expert_block``): it holds a container (ModuleList or
  ModuleDict, a subclass included, as Switch Transformers' ``SwitchTransformersExperts``) whose
  attribute name says ``expert`` and which holds at least two submodules of one class with
  parameters: Switch Transformers, a plain per-expert ``nn.Linear`` MoE, and older Mixtral,
  Qwen2-MoE and OLMoE code; their current code in transformers keeps the experts in one fused
  module, which is one unit already;
- its class is set as a leaf (``set_z3_leaf_modules``: the instances carry ``_z3_leaf``, as
  DeepSpeed marks them), or named in the config's ``zero.leaf_modules``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zerorun.errors import RuntimeConfigError

LEAF_ATTRIBUTE = "_z3_leaf"  # DeepSpeed's marker: transformers and PEFT read it


def looks_like_expert_block(module: nn.Module) -> bool:
    """Note [expert blocks]: a container named *expert* of >= 2 same-class submodules with parameters."""
    for name, child in module.named_children():
        if "expert" not in name.lower() or not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            continue
        experts = list(child.children())
        if len(experts) >= 2 and len({type(e) for e in experts}) == 1 and \
                all(any(True for _ in e.parameters()) for e in experts):
            return True
    return False


def is_leaf(module: nn.Module, class_names: frozenset[str] = frozenset()) -> bool:
    return bool(getattr(module, LEAF_ATTRIBUTE, False)) or type(module).__name__ in class_names \
        or looks_like_expert_block(module)


def check_leaf_names(model: nn.Module, class_names: Iterable[str]) -> frozenset[str]:
    """The config's ``zero.leaf_modules``: each name must be the class of a module of ``model``
    (a typo would otherwise silently gather experts one by one)."""
    names = frozenset(class_names)
    found = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - found)
    if missing:
        raise RuntimeConfigError(
            f"zero.leaf_modules names {', '.join(missing)}, which no module of the model is",
            hint=f"use class names of the model's modules, e.g. {sorted(found)[:3]}")
    return names


def set_leaf_modules(model: nn.Module, classes: Iterable[type | str], flag: bool,
                     raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark (or unmark) every module of ``model`` that is an instance of one of ``classes``
    (classes, or class names as DeepSpeed also takes); returns them. Matching none is refused
    in one line unless ``raise_if_not_found`` is False."""
    wanted = list(classes)
    if not wanted or not all(isinstance(c, (type, str)) for c in wanted):
        raise RuntimeConfigError("set_z3_leaf_modules takes a list of module classes or class names",
                                 hint="pass classes, e.g. [SwitchTransformersSparseMLP], not instances")
    types = tuple(c for c in wanted if isinstance(c, type))
    names = {c for c in wanted if isinstance(c, str)}
    marked = [m for m in model.modules() if isinstance(m, types) or type(m).__name__ in names]
    if not marked and raise_if_not_found:
        listed = ", ".join(c if isinstance(c, str) else c.__name__ for c in wanted)
        raise RuntimeConfigError(f"no module of the model is a {listed}",
                                 hint="pass the classes of the model's expert blocks")
    for module in marked:
        setattr(module, LEAF_ATTRIBUTE, flag)
    return marked


def marked_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, LEAF_ATTRIBUTE, False)]
