"""Ranks with unequal work at stage 3: eval loops with uneven batches, and ``generate``.

    with engine.join():                  # or: with zerorun.uneven_inputs(engine):
        for batch in this_ranks_batches:  # 2 batches on one rank, 3 on another
            loss = engine(**batch).loss   # under torch.no_grad()

    pytest tests/distributed/test_uneven_inputs.py

At stage 3 every forward gathers its units collectively, so a rank that runs one forward more
than another pairs that forward's gathers with whatever the other rank does next; the ranks'
descriptor check stops the job there (Note [collective agreement] in comm/agreement.py). Two
ways to run uneven work correctly instead:

Note [uneven inputs]: in the spirit of torch's ``Join``, inside ``engine.join()`` each engine
forward first joins a one-element all-reduce that counts the ranks still working (1 from a rank
about to run a forward, 0 from one whose loop is over). A rank whose loop ended waits in the
context's exit, joining that all-reduce with 0 and, while some rank still works, running a
shadow forward: its own last batch again, output discarded, so it issues exactly the
collectives of the others' forward (same model, same units, same order). When every rank
counts 0 they leave together. Scope: eval forwards, with autograd off (``torch.no_grad()`` or
``torch.inference_mode()``), called through the engine (``engine(batch)``). A forward with
autograd on inside the context is refused in one line: training on uneven batches would
shadow a backward and a step too, and a shadow step would change the weights by a batch the
rank never had; stop the training loop at the shortest rank's length instead. A rank that had
no batch at all has nothing to shadow with and is refused too. At stages 0-2 and with one
rank, a forward issues no collective and the context does nothing.

Note [synced generate]: transformers' ``generate`` keeps every rank running forwards until all
are done when ``synced_gpus=True``, and turns it on by default when DeepSpeed ZeRO-3 (or FSDP)
is active with more than one rank. A zerorun engine is neither to transformers, so at stage 3
with more than one rank the engine gives every generation model in its module its own
``generate`` that passes ``synced_gpus=True`` unless the caller passed a value, and marks its
collectives as the ``generate`` phase (so a mismatch names it). An explicit
``synced_gpus=False`` is kept, and a mismatch it causes is caught and named.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from zerorun.errors import UsageError
from zerorun.zero.comm import agreement, collectives


class UnevenInputs:
    """The context ``engine.join()`` returns (Note [uneven inputs])."""

    def __init__(self, engine):
        self.engine = engine
        # only a stage-3 forward with more than one rank issues collectives
        self.active = engine.gatherer is not None and engine.world_size > 1
        self._last: tuple[tuple, dict] | None = None

    def __enter__(self) -> UnevenInputs:
        if self.engine._uneven is not None:
            raise UsageError("engine.join() is already open on this engine; nest no second one")
        self.engine._uneven = self
        return self

    def before_forward(self, args: tuple, kwargs: dict) -> None:
        """Called by the engine's forward inside the context: count this rank as working."""
        if not self.active:
            return
        if torch.is_grad_enabled():
            raise UsageError(
                "engine.join() shadows eval forwards only, and this forward has autograd on",
                hint="run the eval loop under torch.no_grad(); for training, stop every rank at the shortest "
                     "rank's number of batches (a shadowed step would train on a batch that rank never had)")
        self._working(1)
        self._last = (args, kwargs)

    def __exit__(self, kind, value, traceback) -> None:
        self.engine._uneven = None
        if kind is not None or not self.active:
            return  # a failing rank leaves; its peers learn of it from the launcher or the channel
        with torch.no_grad():
            while self._working(0):
                if self._last is None:
                    raise UsageError(
                        f"rank {self.engine.rank} had no batch inside engine.join() while other ranks had some",
                        hint="give every rank at least one batch (engine.join() repeats a rank's last batch "
                             "to shadow the others' forwards)")
                args, kwargs = self._last
                self.engine.module(*args, **kwargs)  # the others' forward's collectives; output discarded

    def _working(self, mine: int) -> int:
        """How many ranks are about to run a forward (Note [uneven inputs])."""
        count = torch.tensor([mine], dtype=torch.int64, device=self.engine.pg.device)
        with agreement.phase("eval"):
            collectives.all_reduce(count, group=self.engine.group)
        return int(count.item())


def uneven_inputs(engine) -> UnevenInputs:
    """``zerorun.uneven_inputs(engine)``: the same context as ``engine.join()``."""
    return UnevenInputs(engine)


def _synced_generate(self, *args, **kwargs):
    """Note [synced generate]: the class's ``generate``, with ``synced_gpus=True`` unless given."""
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    with agreement.phase("generate"):
        return type(self).generate(self, *args, **kwargs)


def sync_generate(module: nn.Module) -> int:
    """Give every transformers generation model in ``module`` the synced ``generate`` (Note
    [synced generate]); returns how many. A bound method, not a closure: ``copy.deepcopy`` of
    the model binds the copy's to the copy."""
    generation = sys.modules.get("transformers.generation.utils")
    mixin = getattr(generation, "GenerationMixin", None)
    if mixin is None:  # transformers not imported: no model here generates through it
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, mixin):
            sub.generate = types.MethodType(_synced_generate, sub)
            count += 1
    return count
