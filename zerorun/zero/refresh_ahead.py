"""Stages 1-2: the step's all-gather of updated chunks finishes while the next forward runs.

    pytest tests/distributed/test_refresh_ahead.py

Note [refresh on first read]: after the update each rank holds the new values of its own chunk
of every unit, and the other chunks arrive by an all-gather (``FlatUnit.start_refresh``). Waited
inside ``step()``, that all-gather is time the link works alone: 67 MB a rank for the 33.7M
bench GPT, 0.54 s at 1 Gbit/s, the difference between stages 1-2 and DDP between hosts (DDP's
all-reduce runs inside backward). So with ``zero.overlap_comm`` (the default) ``step()`` issues
the all-gathers, the first parameters' unit first (units are built in backward's order), and
returns; each unit's parameters take the class ``RefreshingParameter`` until their all-gather is
waited. Its ``__torch_function__`` sees every torch operation on them: one that reads values
(the next forward's ``F.embedding``, a script's EMA or norm of the weights, ``.data``,
``state_dict()``'s ``detach``, a pickle) first waits for that unit's all-gather and gives the
unit's parameters back their plain class; metadata (shape, dtype, ``.grad``) passes. So the
forward computes with the first units while the later ones are still on the wire, and no read
anywhere sees a value from before the step. The wait blocks only for this one collective, which
every rank issued in ``step()`` in the same order: a read on one rank never needs another rank.

Where the engine itself writes or reads the units' storage (the next update publishing into a
chunk, a checkpoint, the next backward), it first waits for everything still in flight
(``settle``): a chunk being sent must not change, and a unit the forward never read is current
before its gradient exists; so does the group's teardown (Note [settled before teardown] in
comm/process_group.py). A user's own subclass of ``nn.Parameter`` keeps its class: its unit
is waited inside ``step()`` as before. So is every unit of a compiled model (``torch.compile(model)``
before ``initialize``, ``model.compile()`` or a compiled block after it): dynamo would trace the
class's ``__torch_function__``, whose wait it cannot trace, and give up compiling that forward
for good (it runs eagerly from then on: the values stay right, the speed is lost). A function
compiled around the model (``torch.compile(step_fn)``) is not seen: set ``overlap_comm: false``.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils import _pytree as pytree

from zerorun.zero.comm import collectives
from zerorun.zero.comm.process_group import settle_before_teardown
from zerorun.zero.param_access import reads_no_values
from zerorun.zero.unit.storage import FlatUnit

# id(parameter) -> the refresh it waits for; an entry lives from ``step()`` to the first read.
_PENDING: dict[int, _UnitRefresh] = {}


class RefreshingParameter(nn.Parameter):
    """The class of a stage 1-2 parameter whose unit's refresh is still in flight."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not reads_no_values(func, getattr(func, "__name__", ""), args, kwargs):
            for leaf in pytree.tree_leaves((args, kwargs)):
                if type(leaf) is RefreshingParameter:
                    _PENDING[id(leaf)].wait()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # Pickling and deep-copying read the values without a torch function that says so.
    def __reduce_ex__(self, protocol):
        _PENDING[id(self)].wait()
        return nn.Parameter.__reduce_ex__(self, protocol)

    def __deepcopy__(self, memo):
        _PENDING[id(self)].wait()
        return nn.Parameter.__deepcopy__(self, memo)


class _UnitRefresh:
    """One unit's all-gather in flight and the parameters that wait for it."""

    __slots__ = ("_handle", "_params", "__weakref__")

    def __init__(self, handle: collectives.Issued, params: list[nn.Parameter]):
        self._handle: collectives.Issued | None = handle
        self._params = params
        for param in params:
            _PENDING[id(param)] = self
            param.__class__ = RefreshingParameter

    def wait(self) -> None:
        if self._handle is None:
            return
        self._handle.wait()
        self._handle = None
        for param in self._params:
            param.__class__ = nn.Parameter
            _PENDING.pop(id(param), None)
        self._params = []


def _plain(unit: FlatUnit) -> bool:
    """Can ``unit``'s parameters wait by class? A user's subclass of ``nn.Parameter`` keeps its own."""
    return all(type(p) is nn.Parameter for p in unit.params)


class EagerRefresh:
    """``zero.overlap_comm: false``: every all-gather is waited inside ``step()``."""

    def start(self, units: list[FlatUnit], group) -> None:
        handles = [unit.start_refresh(group) for unit in units]
        for handle in handles:
            handle.wait()

    def settle(self) -> None:
        pass

    # What the update asks of every refresh (update.py); stage 3's step gathers answer otherwise
    # (Note [next forward's gathers in the step] in step_gathers.py).
    def update_order(self, records: list) -> list:
        """The order to update ``records`` in: as they come."""
        return records

    def updated(self) -> None:
        """One optimizer call of the update is done."""


def compiled(model: nn.Module) -> bool:
    """Is ``model``, or any module in it, compiled (``torch.compile(model)``, ``module.compile()``)?"""
    return isinstance(model, OptimizedModule) or any(m._compiled_call_impl is not None for m in model.modules())


class RefreshAhead(EagerRefresh):
    """Note [refresh on first read]: the all-gathers are waited by the first read of each unit."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._in_flight: list[_UnitRefresh] = []
        weakref.finalize(self, _forget, self._in_flight)
        settle_before_teardown(self)  # Note [settled before teardown] in comm/process_group.py

    def start(self, units: list[FlatUnit], group) -> None:
        self.settle()
        if compiled(self._model):  # Note [refresh on first read]: dynamo would trace the waits
            EagerRefresh().start(units, group)
            return
        eager = []
        # Units are built in backward's order (unit/partition.py): the forward reads the last first.
        for unit in reversed(units):
            handle = unit.start_refresh(group)
            if handle is collectives.DONE or not _plain(unit):  # one rank: nothing in flight
                eager.append(handle)
            else:
                self._in_flight.append(_UnitRefresh(handle, list(unit.params)))
        for handle in eager:
            handle.wait()

    def settle(self) -> None:
        """Wait for every all-gather still in flight (issue order); the parameters become plain."""
        for refresh in self._in_flight:
            refresh.wait()
        self._in_flight.clear()

    def in_flight(self) -> int:
        """Units whose all-gather no read has waited for yet."""
        return sum(1 for refresh in self._in_flight if refresh._handle is not None)


def _forget(in_flight: list[_UnitRefresh]) -> None:
    """An engine that goes away with refreshes unwaited: its parameters become plain again and
    leave no entry behind (their values are whatever the all-gather wrote)."""
    for refresh in in_flight:
        for param in refresh._params:
            param.__class__ = nn.Parameter
            _PENDING.pop(id(param), None)
