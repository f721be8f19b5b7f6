"""Pure: which modules own which stage-3 gather units, planned over a plain-data module tree.

The engine (unit/partition.py) builds the tree from the real model; the memory planner builds it
from the model on the meta device (planner/counting.py). Both then call ``coalesce_units``,
so the planner's gather and bucket sizes are the engine's by construction, not by imitation.

Rules, bottom-up over the tree. A module's leftovers (its own eligible parameters plus what
its children left) form one unit it owns as soon as they reach ``min_numel`` elements: every
gather is a sync point of all ranks, and one per Linear made stage 3 1.8x DDP's step on a
busy CPU; one per transformer block is what FSDP2 users wrap by hand. Smaller leftovers
travel upward as *pieces*, each remembering the callable module it came from; containers
(ModuleList/ModuleDict) are never called, so they only pass pieces on; the root takes the rest.

Note [leaf units]: a leaf module (an expert block: Note [expert blocks] in unit/leaf.py) is
planned as if all of its subtree's parameters were its own: nothing inside it owns a unit, so
whatever its children do, its parameters are gathered by its own call (or by an enclosing call
that merged it as a piece), on every rank alike.

Note [persistent units]: ``param_persistence_threshold`` applies to units, not to single
parameters. A LayerNorm's weight inside a transformer block rides the block's gather at no
extra cost, so it is sharded with the block (as FSDP2 shards it); kept whole it would cost every
rank a full 16-bit copy beside its fp32 shard, which made stage 3 1.002x FSDP2's model state.
What the threshold still saves is a gather of its own for a unit that is tiny (a root holding
only the final norm): such a unit stays whole on every rank, bucketed as at stage 2.

Note [no catch-all unit]: when the pieces reaching a module add up to more than
``UNIT_OVERFLOW * min_numel``, merging them would make one unit that stays gathered for the
whole of that module's run. Each piece then becomes a unit of its own module instead. The
root never merges its children's pieces: its unit would stay gathered for all of forward and
backward. On the 33.7M GPT the root had collected every
attention layer, 8.4M elements gathered for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Callable, Hashable

UNIT_OVERFLOW = 2
# Stage 3 gathers modules' parameters in units of at least min(allgather_bucket_size, this)
# elements: about one transformer block of width 512, so a gather is large enough to amortise
# its sync point yet small next to the model.
STAGE3_UNIT_CAP = 2_000_000
# Modules whose units stage 3 prefetches ahead in backward (forward: one); param_gather.py
# uses it, and the gathered bound below counts it.
BACKWARD_PREFETCH = 2


@dataclass(frozen=True)
class ParamNode:
    key: Hashable      # identity of the parameter (a tied parameter has one key everywhere)
    numel: int
    trainable: bool = True
    floating: bool = True  # an integer parameter (always frozen) is never partitioned


@dataclass(frozen=True)
class ModuleNode:
    name: str                          # dotted path; "" for the root
    callable: bool                     # False for containers that are never called
    params: tuple[ParamNode, ...]      # the module's own parameters, registration order
    children: tuple[ModuleNode, ...]
    leaf: bool = False                 # gathered whole when it runs (Note [leaf units])
    kind: str = ""                     # the module's class name (a config's zero.leaf_modules names it)


@dataclass(frozen=True)
class PlannedUnit:
    owner: str                          # name of the module that gathers it
    params: tuple[ParamNode, ...]
    depth: int                          # owners of units enclosing this one (0 = outermost)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def coalesce_units(root: ModuleNode, eligible: Callable[[ParamNode], bool], min_numel: int) -> list[PlannedUnit]:
    """(owner, parameters) per unit, each eligible parameter in exactly one unit."""
    seen: set = set()
    planned: list[tuple[str, list[ParamNode]]] = []

    def visit(node: ModuleNode) -> list[tuple[str | None, list[ParamNode]]]:
        pieces: list[tuple[str | None, list[ParamNode]]] = []
        if not node.leaf:
            for child in node.children:
                pieces += visit(child)
        own = []
        for param in (_subtree_params(node) if node.leaf else node.params):
            if eligible(param) and param.key not in seen:
                seen.add(param.key)
                own.append(param)
        if not node.callable:
            return pieces + ([(None, own)] if own else [])
        total = sum(p.numel for _, ps in pieces for p in ps) + sum(p.numel for p in own)
        if node is root or total > UNIT_OVERFLOW * min_numel:
            for owner, params in pieces:
                if owner is None:
                    own += params  # a container's own parameters: this module runs them
                else:
                    planned.append((owner, params))
            pieces = []
        merged = [p for _, ps in pieces for p in ps] + own
        if merged and (node is root or sum(p.numel for p in merged) >= min_numel):
            planned.append((node.name, merged))
            return []
        return [(node.name, merged)] if merged else []

    visit(root)
    owners = {name for name, _ in planned}
    return [PlannedUnit(name, tuple(params), _enclosing_owners(name, owners)) for name, params in planned]


def _subtree_params(node: ModuleNode) -> list[ParamNode]:
    """Note [leaf units]: a leaf's parameters, its children's included, in registration order."""
    return list(node.params) + [p for child in node.children for p in _subtree_params(child)]


def with_leaves(root: ModuleNode, class_names: frozenset[str]) -> ModuleNode:
    """The tree with every callable module of a class in ``class_names`` a leaf too (the config's
    ``zero.leaf_modules``, which the engine reads as unit/leaf.py ``is_leaf`` does)."""
    return replace(root, children=tuple(with_leaves(child, class_names) for child in root.children),
                   leaf=root.leaf or (root.callable and root.kind in class_names))


def tree_kinds(root: ModuleNode) -> set[str]:
    """The class names of the tree's modules."""
    return {root.kind}.union(*(tree_kinds(child) for child in root.children))


def stage3_units(root: ModuleNode, persistence_threshold: int, min_numel: int) -> list[PlannedUnit]:
    """The units stage 3 partitions (Note [persistent units]): every trainable parameter is planned
    by ``coalesce_units``; a unit of at most ``persistence_threshold`` elements is left out and
    stays whole on every rank."""
    planned = coalesce_units(root, lambda param: param.trainable, min_numel)
    return [unit for unit in planned if unit.numel > persistence_threshold]


def stage3_frozen_units(root: ModuleNode, persistence_threshold: int, min_numel: int) -> list[PlannedUnit]:
    """Note [frozen units] (unit/partition.py): the units of frozen parameters, planned by the same
    rules over the frozen floating parameters alone; a unit of at most ``persistence_threshold``
    elements is left out and stays whole on every rank, as do integer parameters."""
    planned = coalesce_units(root, lambda param: not param.trainable and param.floating, min_numel)
    return [unit for unit in planned if unit.numel > persistence_threshold]


def trainable_numel(root: ModuleNode, trainable: bool = True) -> int:
    """Elements of the trainable parameters in the tree (``trainable=False``: the frozen ones),
    a tied parameter once."""
    seen: dict[Hashable, int] = {}

    def visit(node: ModuleNode) -> None:
        for param in node.params:
            if param.trainable == trainable:
                seen[param.key] = param.numel
        for child in node.children:
            visit(child)

    visit(root)
    return sum(seen.values())


def gathered_together(trained: list[PlannedUnit], frozen: list[PlannedUnit]) -> list[PlannedUnit]:
    """Both plans as the gatherer sees them: one list of units, each unit's depth counted over
    the owners of either plan (a frozen base's unit inside a block whose adapters the root owns
    is gathered within the root's)."""
    owners = {u.owner for u in trained + frozen}
    return [PlannedUnit(u.owner, u.params, _enclosing_owners(u.owner, owners)) for u in trained + frozen]


def _enclosing_owners(name: str, owners: set[str]) -> int:
    if name == "":
        return 0
    parts = name.split(".")
    prefixes = {""} | {".".join(parts[:i]) for i in range(1, len(parts))}
    return len(prefixes & owners)


def max_gathered_numel(units: list[PlannedUnit]) -> int:
    """Elements gathered at once at worst: a chain of nested units (a block and its MLP) run
    together, and in backward the next BACKWARD_PREFETCH modules' units are prefetched beside
    them (gather_prefetch.py, Note [execution order]). Bound: the largest (deepest chain + 1 +
    BACKWARD_PREFETCH) units."""
    if not units:
        return 0
    alive = max(u.depth for u in units) + 1 + BACKWARD_PREFETCH
    return sum(sorted((u.numel for u in units), reverse=True)[:alive])
