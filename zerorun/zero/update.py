"""The update, unit by unit, with the user's own optimizer object.

The user's optimizer stays the one that steps: its param groups keep their hyper-parameters
(and any LR scheduler already built on it keeps editing them), and each group's ``params``
becomes the fp32 masters of that group's units on this rank (unit/record.py). Torch
optimizers skip a parameter whose ``.grad`` is None, so a subset of units is updated by
giving only their masters a gradient and calling ``optimizer.step()``: the same object, the
same per-parameter state, any subset at a time. Units on the device are updated in groups of
at most ``zero.update_bucket_size`` elements, one call each (the multi-tensor path, Note
[bounded update]); units whose home ``updates_alone`` (host, NVMe) one at a time.

Per unit: its state home (``record.state_home``, offload/placements.py) makes master and state
resident and stages the fp32 gradient chunk beside them; the gradient is unscaled by
1 / (data-parallel world x loss scale); clipped when asked; the optimizer steps; the master is
published into the model's chunk; and the home puts master and state away. This module alone
writes a record's ``update`` part (unit/parts.py): the norm piece, the update done, the pending work.

Note [update while backward runs]: with an offloaded optimizer the host would sit idle through
backward and the device through the update. So at an accumulation boundary each unit's work is
queued on one worker thread the moment its gradient chunk is final (grad_reduce calls
``unit_reduced``), while backward goes on for the other units. Exactness decides how far the
worker may go:
- with no clipping and no loss scale (``needs_norm`` false) the whole update of a unit depends
  only on that unit, so the worker stages, unscales, steps and publishes it at once;
- with clipping or fp16 scaling, every unit's update needs the global gradient norm (overflow
  is a global verdict, and the clip coefficient is global), which exists only after the last
  unit. The worker then computes each unit's sum of squares where its gradient is, and the
  updates wait in ``step()`` for the all-reduced norm. The sums are added in unit order on the
  main thread, so the norm is the same number whichever thread computed the pieces.

Note [norm in float64]: the pieces are one per unit and rank chunk, and the stage picks the
units (buckets at 0-2, modules at 3), so the same gradient is summed in other groups at each
stage. In fp32 those partial sums round differently; the clip coefficient then differs in its
last bits, the fp32 masters by an ulp, and now and then a published bf16 weight by one step,
after which Adam turns near-zero gradients' rounding noise into updates of about lr
(DeepSpeed-Chat SFT, bf16, clipping at 1.0: 659 of 45312 saved elements apart between stages 2
and 3, up to 8% of k_proj's bias's largest value). Squares are summed in float64 and the norm
taken there, so a grouping changes the norm by about 1e-16, below the fp32 rounding of the
coefficient: that run saves the same weights, bit for bit, at stages 2 and 3.
Either way a gradient is staged next to its master only inside that unit's update, one unit at
a time for offloaded placements (Note [unit-sized gradient staging] in offload/placements.py).
The engine's ``step()`` waits for the worker before returning, and collectives (the norm, the
stage 1-2 refresh: Note [refresh on first read] in refresh_ahead.py) are issued only from the
main thread, so every rank issues them in order.
A unit's values are no longer read by this backward once its gradient is final, which is what
makes writing its chunk early safe.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from zerorun.errors import InternalError, UsageError
from zerorun.zero.comm import collectives
from zerorun.zero.offload.grad_copy import final_event, wait_for_final
from zerorun.zero.offload.placements import device_gradient
from zerorun.zero.precision import LossScaler
from zerorun.zero.refresh_ahead import EagerRefresh
from zerorun.zero.unit.record import UnitRecord, by_state_home
from zerorun.zero.unit.storage import FlatUnit


@dataclass
class _Window:
    """What the boundary backward's unit work needs to know before the step runs."""

    inverse: float
    needs_norm: bool


def install_masters(optimizer: torch.optim.Optimizer, records: list[UnitRecord]) -> None:
    """Point each of the user's param groups at its units' masters (one per unit)."""
    for index, group in enumerate(optimizer.param_groups):
        group["params"] = [r.master for r in records if r.unit.group_index == index]
    optimizer.state.clear()  # state is per master from now on; nothing stepped the originals


def updates_on_host(record: UnitRecord) -> bool:
    """Note [host optimizer kernels] in offload/placements.py: an offloaded home updates on the
    host, and so does the device's home on a machine without a GPU."""
    return record.state_home.host_kernels or record.master.device.type == "cpu"


def prefer_fused_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Note [host optimizer kernels] in offload/placements.py: fused, where the class has it and the user
    chose no kernel."""
    for group in optimizer.param_groups:
        chosen = group.get("foreach") or group.get("differentiable") or group.get("capturable")
        if "fused" in group and group["fused"] is None and not chosen:
            group["fused"] = True


def square_sum(gradient: torch.Tensor) -> torch.Tensor:
    """The float64 sum of ``gradient``'s squares (Note [norm in float64]); each square is the
    tensor dtype's, so no float64 copy of the gradient is made."""
    return gradient.pow(2).sum(dtype=torch.float64)


def replicated_units(records: list[UnitRecord]) -> list[FlatUnit]:
    """Stages 1-2: the units whose updated chunks are spread to all ranks after an update."""
    return [r.unit for r in records if not r.unit.partitioned]


def update_batches(records: list[UnitRecord], cap: int) -> list[list[UnitRecord]]:
    """Optimizer calls over consecutive units whose homes take several at once, each call's
    masters at most ``cap`` elements in all (a larger unit alone), then one call per unit whose
    home updates it alone (Note [unit-sized gradient staging]).

    Note [bounded update]: a multi-tensor (foreach/fused) optimizer allocates its temporaries
    for every tensor of the call at once (AdamW: the denominator, 4 bytes per element; in
    bf16/fp16 at stages 0-1 also the fp32 copy of the model-dtype gradient), so one call over
    every unit grew the step's peak by a few bytes per parameter of the rank's whole share.
    Groups keep the multi-tensor kernels and bound that growth by one group: the temporaries of
    a call are freed before the next begins (each gradient handed to the optimizer is dropped
    after its call), so ``step()`` grows by a few bytes per element of ``cap`` plus one unit,
    whatever the model's size (tests/distributed/test_update_memory.py)."""
    batches: list[list[UnitRecord]] = []
    size = 0
    for record in (r for r in records if not r.state_home.updates_alone):
        numel = record.master.numel()
        if not batches or size + numel > cap:
            batches.append([])
            size = 0
        batches[-1].append(record)
        size += numel
    return batches + [[r] for r in records if r.state_home.updates_alone]


class UnitUpdater:
    def __init__(self, optimizer: torch.optim.Optimizer, records: list[UnitRecord], group, *,
                 data_parallel_world: int, shard_world: int, update_bucket_size: int = 6_250_000,
                 refresh: EagerRefresh | None = None):
        self.optimizer = optimizer
        # How the updated chunks reach every rank (Note [refresh on first read] in refresh_ahead.py;
        # stage 3: Note [next forward's gathers in the step] in step_gathers.py).
        self.refresh = refresh if refresh is not None else EagerRefresh()
        self.records = records
        self.group = group
        self.data_parallel_world = data_parallel_world
        self.shard_world = shard_world
        self.update_bucket_size = update_bucket_size  # Note [bounded update]
        install_masters(optimizer, records)
        if any(updates_on_host(r) for r in records):
            prefer_fused_kernels(optimizer)
        overlaps = any(r.state_home.overlaps_backward for r in records)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerorun-update") if overlaps else None
        self._window: _Window | None = None

    # -- the boundary backward ---------------------------------------------------------
    def open_window(self, loss_scaler: LossScaler, clip: float) -> _Window:
        """Before the boundary micro-step's backward: fix the unscale factor and whether the
        global norm is needed (Note [update while backward runs])."""
        if self._window is not None and any(r.update.pending is not None for r in self.records):
            # The first boundary backward's gradients already went into updates (or norm
            # pieces) on the worker; a second would step those units twice, so it is refused.
            raise UsageError(
                "engine.backward() ran twice at one accumulation boundary with an offloaded optimizer, which "
                "updates during the boundary backward: call engine.step() after each boundary backward, or "
                "raise gradient_accumulation_steps to accumulate the micro-batches")
        self._window = _Window(
            inverse=1.0 / (self.data_parallel_world * loss_scaler.scale),
            needs_norm=clip > 0 or loss_scaler.dynamic or loss_scaler.scale != 1.0,
        )
        return self._window

    def unit_reduced(self, record: UnitRecord) -> None:
        """grad_reduce: ``record``'s gradient chunk is final; start its work on the worker."""
        if self._worker is None or self._window is None or not record.state_home.overlaps_backward:
            return
        # Note [gradient copies] in offload/grad_copy.py: where, on the training stream, the
        # chunk is final; the worker's device work and the copy to the host wait for it.
        record.update.mark_final(final_event(record.unit.device))
        if not self._window.needs_norm:
            record.state_home.prefetch(record)  # host: the gradient's copy; NVMe: the file's read-ahead
        record.update.submit(self._worker.submit(self._early_work, record, self._window))

    def _early_work(self, record: UnitRecord, window: _Window) -> None:
        wait_for_final(record)
        if window.needs_norm:
            self._norm_piece(record, window)
        else:
            self._apply([record], window, coefficient=1.0)

    # -- the step ------------------------------------------------------------------------
    def step(self, *, loss_scaler: LossScaler, clip: float) -> tuple[bool, float | None]:
        """Unscale, check overflow, clip, update, spread. Returns (applied, grad_norm)."""
        window = self._window if self._window is not None else self.open_window(loss_scaler, clip)
        self.refresh.settle()  # the last step's all-gathers read the chunks this one rewrites
        self._wait_for_worker()
        if window.needs_norm:
            for record in self.records:
                if record.update.square is None:
                    self._norm_piece(record, window)
        norm: float | None = None
        overflow = False
        if window.needs_norm:
            norm = self._global_norm()
            overflow = not math.isfinite(norm)
        applied = loss_scaler.update(overflow)
        if applied:
            coefficient = clip / (norm + 1e-6) if clip > 0 and norm is not None and norm > clip else 1.0
            pending = self.refresh.update_order([r for r in self.records if not r.update.updated])
            for batch in update_batches(pending, self.update_bucket_size):
                self._apply(batch, window, coefficient)
                self.refresh.updated()  # Note [next forward's gathers in the step] in step_gathers.py
            self.refresh.start(replicated_units(self.records), self.group)
        for record in self.records:
            record.update.close_window()
        self._window = None
        return applied, norm

    def _wait_for_worker(self) -> None:
        for record in self.records:
            record.update.collect()  # re-raises what failed on the worker

    def _norm_piece(self, record: UnitRecord, window: _Window) -> None:
        """This unit's share of the squared norm, computed where the gradient already is (a
        unit-sized temporary, never a staged copy: Note [unit-sized gradient staging])."""
        unscaled = device_gradient(record) * window.inverse
        record.update.set_square(square_sum(unscaled))

    def _global_norm(self) -> float:
        """L2 norm over every rank's chunks; padding is zero, tied weights are counted once."""
        device = self.records[0].unit.device if self.records else torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float64, device=device)  # Note [norm in float64]
        for record in self.records:  # unit order, whichever thread computed each piece
            square = record.update.square
            if square is None:
                raise InternalError(f"unit {record.index}: the global norm was asked for before its piece")
            squares += square.to(device)
        if self.shard_world > 1:
            collectives.all_reduce(squares, group=self.group)
        return float(squares.sqrt())

    def _apply(self, records: list[UnitRecord], window: _Window, coefficient: float) -> None:
        """Stage, unscale and clip the gradients of ``records``, step them with the user's
        optimizer and publish them to the model. The unscale is the same multiplication as in
        ``_norm_piece``, so the norm describes exactly the gradient stepped."""
        with ExitStack() as resident:
            for record in records:
                resident.enter_context(record.state_home.resident(record, self.optimizer))
                grad = record.state_home.stage_gradient(record)
                grad.mul_(window.inverse)
                if coefficient != 1.0:
                    grad.mul_(coefficient)
                record.master.grad = grad
            self.optimizer.step()
            with torch.no_grad():
                for record in records:
                    record.master.grad = None
                    record.state_home.publish(record)
                    record.update.mark_updated()


    # -- inspection ----------------------------------------------------------------------
    def placed_nbytes(self) -> dict[str, int]:
        """Bytes of masters and optimizer state by location, summed over the homes."""
        total = {"device": 0, "host": 0, "nvme": 0}
        for home, records in by_state_home(self.records).items():
            for where, nbytes in home.nbytes(records, self.optimizer).items():
                total[where] += nbytes
        return total
