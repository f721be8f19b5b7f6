"""Stage 3: which module calls enclose the uses of a unit (Note [gather follows use] in param_gather.py).

    pytest tests/unit/test_gather_use.py

``CallObserver`` keeps the stack of the model's module calls now running, while a forward is
observed (the first one, and any after a use the plan did not foresee); ``common_caller`` is the
pure rule that picks, from the stacks seen at each use of a unit, the module whose call encloses
them all.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from torch import nn
from torch.nn.modules import module as module_hooks


class CallObserver:
    """The stack of ``root``'s module calls now running, from process-wide module hooks that
    exist only between ``start`` and ``stop`` (they would slow every module call otherwise).
    Modules of other models are ignored; a module whose ``forward`` is called directly, not
    through ``__call__``, fires no hook and never appears."""

    def __init__(self, root: nn.Module):
        self._root = root
        self._ids: set[int] = set()
        self._stack: list[nn.Module] = []
        self._handles: list = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def start(self) -> None:
        self._ids = {id(m) for m in self._root.modules()}
        self._stack = []
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._enter),
            module_hooks.register_module_forward_hook(self._leave, always_call=True),
        ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    def stack(self) -> tuple[nn.Module, ...]:
        return tuple(self._stack)

    def _enter(self, module: nn.Module, args) -> None:
        if id(module) in self._ids:
            self._stack.append(module)

    def _leave(self, module: nn.Module, args, output) -> None:
        if id(module) in self._ids and self._stack and self._stack[-1] is module:
            self._stack.pop()


def common_caller(stacks: Sequence[Sequence[Hashable]]):
    """Pure: the innermost entry that every call stack (outermost first) shares at the same
    depth: the call that was running at every use. None when they share none."""
    if not stacks:
        return None
    found = None
    for entries in zip(*stacks, strict=False):
        first = entries[0]
        if any(entry is not first for entry in entries[1:]):
            break
        found = first
    return found
