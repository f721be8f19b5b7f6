"""Decide which parameters form which unit, per stage, and build the units.

Stages 0-2: each optimizer param group's trainable parameters, in reverse registration order
(roughly the order backward produces their gradients), packed into buckets of
``reduce_bucket_size`` elements.
Stage 3: trainable parameters are partitioned into units of whole modules chosen by
unit/plan.py (one unit per param group per owner), and the owner gathers them around its
forward and backward. The parameters of a unit of at most ``param_persistence_threshold``
elements stay whole on every rank instead and are bucketed as in stage 2 (Note [persistent
units] in unit/plan.py).

Note [frozen units]: at stage 3 frozen parameters (a LoRA base, a DPO reference model) are
partitioned too, as DeepSpeed partitions them: planned by the same rules over the frozen
parameters alone (so the trainable plan is what it was), one unit per owner and dtype, gathered
by the same hooks and released after the module's backward (param_gather.py), but never in the
optimizer, never reduced and never stepped: the engine keeps their records apart
(``engine.frozen_records``), outside every pass but gathering. A frozen unit of at most
``param_persistence_threshold`` elements stays whole, bucketed like the trainable ones, so that
every stage-3 parameter is in a unit (and carries DeepSpeed's attributes). Below stage 3 frozen
parameters belong to no unit: whole on every rank and never communicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Hashable

import torch
from torch import nn

from zerorun.errors import RuntimeConfigError
from zerorun.zero.unit.layout import ParamSpec, pack_buckets
from zerorun.zero.unit.leaf import is_leaf
from zerorun.zero.unit.storage import FROZEN_GROUP, FlatUnit

from zerorun.zero.unit.plan import ModuleNode, ParamNode, stage3_frozen_units, stage3_units


@dataclass
class Partition:
    units: list[FlatUnit]
    # Order in which gradient collectives are issued (Note [launch order] in grad_reduce).
    reduce_order: list[int]
    # Stage 3 only: the partitioned units each module needs gathered to run.
    module_units: dict[nn.Module, list[FlatUnit]] = field(default_factory=dict)
    # Stage 3 only: the partitioned units of each module's own parameters (its direct
    # ``parameters(recurse=False)``), whoever owns them: Note [gather follows use] in param_gather.py.
    holder_units: dict[nn.Module, list[FlatUnit]] = field(default_factory=dict)
    # Stage 3 only: the units of frozen parameters (Note [frozen units]), indexed after ``units``.
    frozen: list[FlatUnit] = field(default_factory=list)
    # Stage 3 only: the units holding a leaf module's parameters, whose gradients are complete
    # when its backward is over (Note [expert gradients] in grad_reduce.py).
    leaf_units: frozenset[int] = frozenset()


def group_of_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """Map each trainable parameter (by ``id``) to its optimizer group, checking the two agree."""
    model_params = {id(p) for p in model.parameters()}
    group_of: dict[int, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in model_params:
                raise RuntimeConfigError(
                    f"the optimizer's param group {index} holds a tensor of shape {tuple(param.shape)} "
                    "that is not a parameter of the model",
                    hint="build the optimizer from model.parameters() (or named groups of them)",
                )
            group_of[id(param)] = index
    for name, param in model.named_parameters():
        if param.requires_grad and id(param) not in group_of:
            raise RuntimeConfigError(
                f"parameter {name!r} requires grad but is in no optimizer param group",
                hint="add it to the optimizer, or set requires_grad=False to freeze it",
            )
    return group_of


def build_partition(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stage: int,
    world_size: int,
    rank: int,
    bucket_numel: int,
    persistence_threshold: int,
    min_unit_numel: int = 0,
    leaf_names: frozenset[str] = frozenset(),
    alignment: int = 1,
    shard_home=None,
    before_unit: Callable[[list[nn.Parameter]], None] | None = None,
) -> Partition:
    """``before_unit(params)`` runs just before each unit copies its parameters in (sharded
    construction gives meta parameters their values there: construct.py)."""
    group_of = group_of_params(model, optimizer)
    named = list(model.named_parameters())
    registration = {id(p): i for i, (_, p) in enumerate(named)}
    name_of = {id(p): n for n, p in named}
    shard_world, shard_rank = (1, 0) if stage == 0 else (world_size, rank)
    units: list[FlatUnit] = []
    module_units: dict[nn.Module, list[FlatUnit]] = {}
    holder_units: dict[nn.Module, list[FlatUnit]] = {}

    def add_unit(members: list[tuple[str, nn.Parameter]], group_index: int, partitioned: bool) -> FlatUnit:
        if before_unit is not None:
            before_unit([p for _, p in members])
        unit = FlatUnit(len(units), group_index, members, shard_world, shard_rank,
                        partition_params=partitioned, alignment=alignment, shard_home=shard_home)
        units.append(unit)
        return unit

    assigned: set[int] = set()
    if stage == 3:
        for owner, members in _coalesce_modules(model, persistence_threshold, min_unit_numel, leaf_names=leaf_names):
            by_group: dict[int, list[tuple[str, nn.Parameter]]] = {}
            for param in members:
                assigned.add(id(param))
                by_group.setdefault(group_of[id(param)], []).append((name_of[id(param)], param))
            module_units[owner] = [add_unit(m, g, partitioned=True) for g, m in sorted(by_group.items())]

    for group_index in range(len(optimizer.param_groups)):
        rest = [(n, p) for n, p in reversed(named)
                if p.requires_grad and group_of[id(p)] == group_index and id(p) not in assigned]
        for bucket in _buckets(rest, bucket_numel):
            add_unit(bucket, group_index, partitioned=False)

    # Gradients of later-registered parameters come first in backward.
    reduce_order = sorted(range(len(units)), key=lambda i: -min(registration[id(p)] for p in units[i].params))
    trainable = list(units)
    if stage == 3:  # Note [frozen units]: after the trainable ones, so those keep their indices
        for owner, members in _coalesce_modules(model, persistence_threshold, min_unit_numel, trainable=False,
                                                leaf_names=leaf_names):
            by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
            for param in members:
                assigned.add(id(param))
                by_dtype.setdefault(param.dtype, []).append((name_of[id(param)], param))
            module_units.setdefault(owner, []).extend(
                add_unit(m, FROZEN_GROUP, partitioned=True) for m in by_dtype.values())
        rest = [(n, p) for n, p in reversed(named) if not p.requires_grad and id(p) not in assigned]
        for dtype in dict.fromkeys(p.dtype for _, p in rest):
            for bucket in _buckets([(n, p) for n, p in rest if p.dtype == dtype], bucket_numel):
                add_unit(bucket, FROZEN_GROUP, partitioned=False)
        _add_outside_users(model, [u for u in units if u.partitioned], module_units)
        holder_units = _holder_units(model, units)
    in_leaf = {id(p) for m in model.modules() if is_leaf(m, leaf_names) for p in m.parameters()}
    leaf_units = frozenset(u.index for u in trainable if u.partitioned and any(id(p) in in_leaf for p in u.params))
    return Partition(trainable, reduce_order, module_units, holder_units, frozen=units[len(trainable):],
                     leaf_units=leaf_units if stage == 3 else frozenset())


def _buckets(named: list[tuple[str, nn.Parameter]], bucket_numel: int) -> list[list[tuple[str, nn.Parameter]]]:
    by_name = dict(named)
    return [[(spec.name, by_name[spec.name]) for spec in bucket]
            for bucket in pack_buckets([ParamSpec(n, p.numel()) for n, p in named], bucket_numel)]


def module_tree(model: nn.Module, leaf_names: frozenset[str] = frozenset()) -> ModuleNode:
    """The model as plain data for unit_plan.coalesce_units; a module reached twice appears once,
    and a tied parameter has the same key wherever it is registered. Leaves: unit/leaf.py."""
    seen: set[int] = set()

    def node(module: nn.Module, name: str) -> ModuleNode:
        seen.add(id(module))
        children = tuple(
            node(child, f"{name}.{child_name}" if name else child_name)
            for child_name, child in module.named_children() if id(child) not in seen
        )
        params = tuple(ParamNode(id(p), p.numel(), p.requires_grad, p.is_floating_point())
                       for p in module.parameters(recurse=False))
        callable_ = not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        return ModuleNode(name, callable_, params, children, leaf=callable_ and is_leaf(module, leaf_names),
                          kind=type(module).__name__)

    return node(model, "")


def _coalesce_modules(model: nn.Module, persistence_threshold: int, min_numel: int,
                      trainable: bool = True, leaf_names: frozenset[str] = frozenset(),
                      ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(owner module, parameters) of each partitioned unit from unit/plan.py's rules, over the
    trainable parameters or the frozen ones (Note [frozen units]); each parameter appears once."""
    modules = dict(model.named_modules())
    params: dict[Hashable, nn.Parameter] = {id(p): p for p in model.parameters()}
    tree = module_tree(model, leaf_names)
    if trainable:
        planned = stage3_units(tree, persistence_threshold, min_numel)
    else:
        planned = stage3_frozen_units(tree, persistence_threshold, min_numel)
    return [(modules[u.owner], [params[p.key] for p in u.params]) for u in planned]


def _add_outside_users(model: nn.Module, units: list[FlatUnit], module_units: dict) -> None:
    """A module using a parameter of a unit owned outside its ancestors (a tied output head)
    must gather that unit itself."""
    owner_of_unit = {u.index: m for m, us in module_units.items() for u in us}
    unit_of_param = {id(p): u for u in units for p in u.params}
    covered_by: dict[int, set[int]] = {}
    for owner in set(owner_of_unit.values()):
        for inner in owner.modules():
            covered_by.setdefault(id(inner), set()).update(u.index for u in module_units[owner])
    for module in model.modules():
        for param in module.parameters(recurse=False):
            unit = unit_of_param.get(id(param))
            if unit is not None and unit.index not in covered_by.get(id(module), set()):
                module_units.setdefault(module, [])
                if unit not in module_units[module]:
                    module_units[module].append(unit)


def _holder_units(model: nn.Module, units: list[FlatUnit]) -> dict[nn.Module, list[FlatUnit]]:
    """Every module that directly holds a parameter of a partitioned unit, with those units
    (a tied parameter: every module that registers it)."""
    unit_of_param = {id(p): u for u in units if u.partitioned for p in u.params}
    holders: dict[nn.Module, list[FlatUnit]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            unit = unit_of_param.get(id(param))
            if unit is not None and unit not in holders.setdefault(module, []):
                holders[module].append(unit)
        if not holders.get(module, True):
            del holders[module]
    return holders
