"""``deepspeed.zero``: ``Init`` (sharded construction) and ``GatheredParameters``.

    pytest tests/unit/test_deepspeed_module.py tests/distributed/test_deepspeed_zero.py

``Init`` builds the model on the meta device; ``deepspeed.initialize`` then gives it values unit
by unit (zero/construct.py Note [materialize per unit]), so no rank ever holds the whole model.
DeepSpeed partitions each parameter as its module is built instead; the result, a model whose
full parameters exist only one unit at a time, is the same.

``GatheredParameters(params, modifier_rank=None)`` makes the full values of ``params`` readable
inside the block. After ``initialize`` a stage-3 unit is all-gathered on entry and released on
exit. With ``modifier_rank=R`` what rank R wrote is broadcast on exit and written through: into
every rank's shard *and* into the fp32 master the optimizer steps (Note [write-through]).

Before ``initialize`` (a model built under ``Init``, loaded the way Hugging Face's
``from_pretrained`` loads under ZeRO-3: one module at a time inside
``GatheredParameters(..., modifier_rank=0)``), the meta parameters get real memory on entry, keeping
their identity (``torch.utils.swap_tensors``); with a ``modifier_rank`` they keep rank R's
values, broadcast on exit, and ``initialize`` places them unit by unit and initializes only what
is still on the meta device. Without one they go back to the meta device.

Note [write-through]: with fp32 training and the optimizer on the device, a unit's master *is*
its shard (unit/record.py Note [masters]), so writing the shard is enough; otherwise the master
is its own fp32 tensor (or lives in host memory or a file) and is refreshed from the shard
through its placement, exactly as loading a checkpoint does. DeepSpeed leaves the master alone,
so an update after the block there can undo the write; here it cannot.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn

from zerorun.zero.comm import collectives
from zerorun.zero.construct import meta_parameters, swap_values
from zerorun.zero.engine_api import LIVE_ENGINES
from zerorun.zero.unit.record import by_state_home
from zerorun.zero.unit.storage import ParamState


class Init(contextlib.ContextDecorator):
    """Build modules with their parameters on the meta device and everything else real: buffers
    a constructor computes (rotary ``inv_freq``, masks, ``position_ids``) keep their values
    (zero/construct.py ``meta_parameters``, Note [parameters only]). DeepSpeed's arguments are
    accepted; ``enabled=False`` builds modules normally. ``config_dict_or_path``/``config`` are
    read by ``initialize``, not here. Like DeepSpeed's, entering starts the process group when
    there is none yet, so loading under ``GatheredParameters`` can broadcast what the modifier
    rank read."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **ignored):
        self.enabled = enabled and module is None  # an already-built module is sharded by initialize
        self._context: contextlib.AbstractContextManager | None = None

    def __enter__(self):
        if self.enabled:
            from zerorun.deepspeed.comm import init_distributed

            init_distributed()
            self._context = meta_parameters()
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None
        return False


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """A no-op: zerorun's stage-3 hooks already gather a unit for every module that holds or
    reads one of its parameters (zero/param_gather.py, Note [gather follows use]; a read in
    another module's forward: zero/param_access.py, Note [reads outside forward])."""


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """A no-op, like ``register_external_parameter``."""


_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _owners(engine) -> dict[int, object]:
    """id(parameter) -> its UnitRecord (a frozen one at stage 3), or None for a parameter in no
    unit (a frozen one below stage 3)."""
    table = _OWNERS.get(engine)
    if table is None:
        table = {id(p): record for record in engine.records + engine.frozen_records for p in record.unit.params}
        table.update({id(p): None for p in engine.module.parameters() if id(p) not in table})
        _OWNERS[engine] = table
    return table


def _find_engine(param: torch.Tensor):
    for engine in list(LIVE_ENGINES):
        table = _owners(engine)
        if id(param) in table:
            return engine, table[id(param)]
    return None, None


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None] if enabled else []
        self.modifier_rank = modifier_rank
        self._engine = None
        self._records: list = []
        self._frozen: list[torch.Tensor] = []
        self._gathered: list = []
        self._materialized: list[tuple[nn.Parameter, torch.Tensor]] = []

    def __enter__(self):
        seen = set()
        for param in self.params:
            engine, record = _find_engine(param)
            if engine is not None:
                self._engine = engine
                if record is None:
                    self._frozen.append(param)
                elif id(record) not in seen:
                    seen.add(id(record))
                    self._records.append(record)
            elif param.is_meta:
                self._materialize(param)
        if self._engine is not None:  # stages 1-2: the last step's all-gathers write the buffers read here
            self._engine.updater.refresh.settle()
        with torch.no_grad():
            for record in self._records:
                if record.unit.state is ParamState.SHARDED:
                    with record.unit.exact_gathers():  # may be written back: not qwZ's copy
                        record.unit.gather(self._engine.group)
                    self._gathered.append(record.unit)
        return self

    def _materialize(self, param: nn.Parameter) -> None:
        """A meta parameter (built under Init) gets zeroed memory where initialize will put it."""
        from zerorun.zero.engine import _compute_device

        real = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=_compute_device(param.device)),
                            requires_grad=param.requires_grad)
        # ``real`` is now the meta tensor, kept to swap back; ``param`` keeps its attributes
        # (transformers marks a loaded parameter ``_is_hf_initialized`` before gathering it).
        swap_values(param, real)
        self._materialized.append((param, real))

    def __exit__(self, kind, value, traceback):
        try:
            if kind is None and self.modifier_rank is not None:
                self._write_through()
        finally:
            for unit in self._gathered:
                unit.release(detach=True)  # Note [detached release] in zero/unit/storage.py
            pool = self._engine.gatherer.pool if self._engine is not None and self._engine.gatherer else None
            if self._gathered and pool is not None:
                pool.clear()  # as full_state_dict does: no buffer per distinct unit size left behind
            if self.modifier_rank is None or kind is not None:
                for param, meta in self._materialized:
                    swap_values(param, meta)
        return False

    def _write_through(self) -> None:
        src = self.modifier_rank
        with torch.no_grad():
            if self._engine is not None:
                group = self._engine.group
                for tensor in [r.unit.full for r in self._records] + [p.data for p in self._frozen]:
                    collectives.broadcast(tensor, src=src, group=group)
                for record in self._records:
                    _refresh_from_full(record, self._engine.optimizer)
                # NVMe: the masters' writes land before anything reads the files.
                for home, records in by_state_home(self._records).items():
                    home.settle(records)
            if self._materialized and dist.is_initialized() and dist.get_world_size() > 1:
                for param, _ in self._materialized:
                    dist.broadcast(param.data, src=src)


def _refresh_from_full(record, optimizer) -> None:
    """Note [write-through]: the broadcast full buffer -> this rank's shard -> its fp32 master."""
    unit = record.unit
    if unit.partitioned:
        lo, hi = unit.layout.chunk_range(unit.rank)
        unit.shard.copy_(unit.full[lo:hi])
        if unit.secondary is not None:  # Note [secondary copy]: forward's values no longer
            unit.secondary.invalidate()
    if record.master_is_model_storage:
        return
    with record.state_home.resident(record, optimizer):
        record.master.copy_(unit.shard)
