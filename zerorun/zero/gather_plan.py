"""Stage 3: the pure planning beside the gatherer (param_gather.py), and the small autograd
pieces its hooks use: which units to keep gathered between uses (Note [kept gathered] in
param_gather.py), how many
gathers of each size a pass still makes (Note [pools follow backward]), which modules read
parameters in backward, and where the tensors of a module's output are.

    pytest tests/unit/test_sharding_runtime.py tests/unit/test_host_pools.py
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils import _pytree as pytree


class AfterBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls ``callback`` (Note [shared units])."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        # Detached, not views: a view made inside a Function may not be changed in place, and
        # a module may add to its input in place (Switch Transformers' expert blocks under
        # checkpointing did: "Output 0 of AfterBackward is a view and is being modified
        # inplace"). A detached tensor shares the input's storage and version counter, so an
        # in-place change reaches the same values, and is caught by autograd where it
        # would be caught without this function.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def plan_kept_units(
    order_units: list[list[int]], numel: dict[int, int], max_reuse_distance: int
) -> tuple[dict[int, set[int]], set[int]]:
    """Pure: Note [kept gathered] over one recorded forward.

    ``order_units[p]`` lists the units the p-th module call gathers. Returns (position ->
    units to hold after that call, units to hold from the end of forward into backward).
    A unit is held after call p when a later call q uses it again and the other units gathered
    by calls p+1..q-1 add up to at most ``max_reuse_distance`` elements.
    """
    keep_after: dict[int, set[int]] = {}
    for p, units in enumerate(order_units):
        for unit in units:
            between: set[int] = set()
            for q in range(p + 1, len(order_units)):
                if unit in order_units[q]:
                    if sum(numel[u] for u in between - {unit}) <= max_reuse_distance:
                        keep_after.setdefault(p, set()).add(unit)
                    break
                between.update(order_units[q])
    calls_with_units = [p for p, units in enumerate(order_units) if units]
    if not calls_with_units:
        return keep_after, set()
    last = calls_with_units[-1]
    keep_after.setdefault(last, set()).update(order_units[last])
    return keep_after, set(order_units[last])


def prefetch_window(ahead: list[int], minimum: int, budget: int, room: int) -> int:
    """Pure: Note [prefetch budget] (gather_prefetch.py). ``ahead[i]`` is the number of elements of
    the units of the i-th module call after the running one (a unit counted at its first call
    only). Returns
    how many of those calls to prefetch: at least ``minimum`` (the fixed lookahead), then more
    while all of them together stay within ``budget`` elements (prefetch_bucket_size; 0 adds
    none); none past ``room``, the elements max_live_parameters leaves for them (every call's own gathers
    still happen when it runs, so ``room`` bounds only what is gathered early)."""
    count = total = 0
    for n in ahead:
        if total + n > room or (count >= minimum and total + n > budget):
            break
        count, total = count + 1, total + n
    return count


def gathers_still_wanted(sizes_by_position: list[list[int]]) -> list[dict[int, int]]:
    """Pure: for each position p of a recorded forward or backward (and one past the end), how
    many gathers of each byte size positions p, p+1, ... make (Note [pools follow backward]).
    ``sizes_by_position[p]`` lists the byte sizes of the partitioned units position p gathers."""
    wanted: list[dict[int, int]] = [{}]  # built from the end, then reversed
    for sizes in reversed(sizes_by_position):
        counts = dict(wanted[-1])
        for nbytes in sizes:
            counts[nbytes] = counts.get(nbytes, 0) + 1
        wanted.append(counts)
    return wanted[::-1]


def reads_params_in_backward(module: nn.Module) -> bool:
    """An Embedding's backward needs only the indices (Note [shared units])."""
    return not isinstance(module, nn.Embedding)


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor inside ``value``: torch's pytree walks tuples, lists, dicts, namedtuples and
    Hugging Face outputs; a plain dataclass (a leaf to pytree) is opened by its fields."""
    found = []
    for leaf in pytree.tree_leaves(value):
        if torch.is_tensor(leaf):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found
