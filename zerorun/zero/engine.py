"""The engine users hold: ``engine = zerorun.initialize(model, optimizer, config)``.

    loss = engine(*inputs); engine.backward(loss); engine.step()

It composes the parts and owns the step counters; the mechanisms live elsewhere:
unit/partition.py (which parameters form which unit), unit/storage.py (flat storage and gathering),
grad_reduce.py (gradient collectives), unit/record.py (one record per unit), update.py (the
unit-by-unit update with the user's optimizer), offload/placements.py (where masters and state live),
param_gather.py (stage 3 hooks), precision.py (dtypes and loss scaling).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerorun.config import ZerorunConfig, load_config
from zerorun.errors import RuntimeConfigError, UsageError, ZerorunError
from zerorun.telemetry import announce_monitor, get_recorder
from zerorun.worker import preemption_grace
from zerorun.zero import full_state, hpz, lookup_gradients, param_access
from zerorun.zero.lookup_rows import RowsFirst
from zerorun.zero.checkpoint import load as checkpoint_load
from zerorun.zero.checkpoint import save as checkpoint_save
from zerorun.zero.checkpoint import schedule as checkpoint_schedule
from zerorun.zero.comm import agreement, collectives, link_split
from zerorun.zero.engine_api import LIVE_ENGINES, DeepSpeedEngineAPI, engine_built
from zerorun.zero.activation_checkpointing import apply_from_config
from zerorun.zero.construct import Materializer
from zerorun.zero.host_memory import return_large_frees_to_os, trim_host_heap, trim_interval
from zerorun.zero.grad_reduce import GradReducer, ReducePolicy
from zerorun.zero.param_gather import ParamGatherer, tensors_in
from zerorun.zero.unit.leaf import check_leaf_names
from zerorun.zero.unit.partition import build_partition
from zerorun.zero.precision import LossScaler, model_dtype
from zerorun.zero.comm.process_group import ProcessGroupInfo, resolve_process_group
from zerorun.zero.offload.placements import placement_from_config
from zerorun.zero.unit.record import Home, UnitRecord, by_state_home
from zerorun.zero.unit.storage import FlatUnit
from zerorun.zero.train_state import TrainState
from zerorun.zero.refresh_ahead import EagerRefresh, RefreshAhead
from zerorun.zero.step_gathers import StepGathers
from zerorun.zero.update import UnitUpdater
from zerorun.zero import uneven
from zerorun.zero.unit.plan import STAGE3_UNIT_CAP
from zerorun.worker import device as worker_device

# Chunks are multiples of this many elements (16-32 bytes), so every rank's chunk of every unit
# starts aligned for vectorised kernels.
CHUNK_ALIGNMENT = 8
BROADCAST_BUCKET_NUMEL = 4_000_000


def initialize(model: nn.Module, optimizer=None, config=None, *, weights=None, param_init_fn=None,
               model_parameters=None, state_home_for: Callable[[FlatUnit], Home] | None = None) -> Engine:
    """Build the engine; ``config`` is None (the launcher's ZERORUN_CONFIG, else defaults), a dict,
    a YAML/JSON path or a ZerorunConfig.

    ``model`` may be built on the meta device: each unit is then materialized on its own, from
    ``weights`` (a .safetensors file, a Hugging Face checkpoint directory or a state dict) or by
    its modules' ``reset_parameters()`` / ``param_init_fn(module)`` (construct.py).

    ``state_home_for(unit)``: a per-unit placement policy for master and optimizer state
    (offload/placements.py); by default every unit gets the one ``zero.offload_optimizer`` names.

    The config is validated twice: once on its own, and once the process group exists, with the
    real world size, so the batch rule (train = micro x accumulation x world) is checked and the
    missing batch size derived even for scripts started without the launcher. The engine is
    built with that final config, and only then resumed (``checkpoint.resume``).
    """
    launcher_config = os.environ.get("ZERORUN_CONFIG")
    from_launcher = config is None and bool(launcher_config)
    source = launcher_config if from_launcher else config
    # The launcher already applied CLI > env > file; applying the environment again here could
    # let a stale variable beat a --set flag.
    cfg = load_config(source, environ={} if from_launcher else None)
    if cfg.zero.stage not in (0, 1, 2, 3):
        raise RuntimeConfigError(f"zero.stage is {cfg.zero.stage!r}; it must be 0, 1, 2 or 3")
    first = next(model.parameters(), None)
    if first is None:
        raise RuntimeConfigError("the model has no parameters to train")
    get_recorder()  # subscribed before any collective of ours: Note [every collective counted] in Engine
    pg = resolve_process_group(first.device)  # this worker's device: a model built elsewhere moves there
    cfg = load_config(cfg, world_size=pg.world_size, hosts=link_split.job_hosts(os.environ, pg.world_size))
    with agreement.phase("setup"):
        engine = Engine(model, optimizer, cfg, pg, weights=weights, param_init_fn=param_init_fn,
                        model_parameters=model_parameters, state_home_for=state_home_for)
    if engine.rank == 0:  # one warning per job, not one per rank
        from zerorun.config.precedence import warn_overridden

        if not from_launcher:  # the launcher printed its own config's notes before start
            for note in cfg.notes:
                print(f"zerorun: note: {note}", file=sys.stderr, flush=True)

        warn_overridden(engine.config, optimizer, config if launcher_config and not from_launcher else None,
                        launcher_config, world_size=engine.world_size)
        if not from_launcher:  # the launcher opened its own config's monitor files at start
            announce_monitor(engine.config.monitor, engine.rank)
    with agreement.phase("setup"):
        checkpoint_schedule.claim_on_start(engine)  # checkpoint.dir in use or unusable: refused now
        checkpoint_schedule.resume_from_config(engine)  # checkpoint.resume (zero/checkpoint/schedule.py)
    return engine


@contextlib.contextmanager
def _failing_together(pg, what: str, *, enabled: bool = True):
    """Every rank agrees on whether the block succeeded on all (one all-reduce after it): the
    rank that failed raises its own one-line error, every other rank one naming that rank. The
    NVMe free-space check failing on one rank only used to leave its peers to die later of a
    60-line gloo traceback. The block must run no collective of its own."""
    if not enabled or pg.world_size == 1:
        yield
        return
    failure: ZerorunError | None = None
    try:
        yield
    except ZerorunError as exc:
        failure = exc
    flags = torch.zeros(pg.world_size, dtype=torch.int32, device=pg.device)
    flags[pg.rank] = failure is not None
    collectives.all_reduce(flags, group=pg.group)
    if failure is not None:
        raise failure
    failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if failed:
        raise RuntimeConfigError(f"rank {pg.rank}: {what} failed on rank {failed[0]} (its error says why)",
                                 hint="nothing was started; fix that rank's problem and start again")


def _optimizer_from_config(model: nn.Module, cfg: ZerorunConfig, params=None) -> torch.optim.Optimizer:
    """The config's optimizer over ``params`` (tensors or param-group dicts, as DeepSpeed's
    ``model_parameters``), else over the model's trainable parameters."""
    trainable = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer is None and not trainable:
        # A wholly frozen model (a DPO reference, an evaluation model) needs no optimizer, as
        # DeepSpeed's initialize allows: one empty group that never steps anything.
        return torch.optim.SGD([{"params": []}], lr=0.0)
    if cfg.optimizer is None:
        raise RuntimeConfigError(
            "initialize() got no optimizer and the config has no 'optimizer' section",
            hint="pass optimizer=torch.optim.AdamW(model.parameters()) or add optimizer: {type: AdamW}",
        )
    cls = getattr(torch.optim, cfg.optimizer.type, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RuntimeConfigError(f"optimizer.type {cfg.optimizer.type!r} is not a torch.optim optimizer")
    return cls(trainable, **cfg.optimizer.params)


def _broadcast_state(model: nn.Module, group) -> None:
    """Start every rank from rank 0's parameters and buffers: tensors of one dtype are packed
    into buckets of at most BROADCAST_BUCKET_NUMEL elements, one collective per bucket, so the
    packing copy stays small next to the model (a single flat copy raised stage 3's peak)."""
    if collectives.group_size(group) == 1:
        return
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        lists = buckets.setdefault(tensor.dtype, [[]])
        if lists[-1] and sum(t.numel() for t in lists[-1]) + tensor.numel() > BROADCAST_BUCKET_NUMEL:
            lists.append([])
        lists[-1].append(tensor)
    with torch.no_grad():
        for bucket in (b for lists in buckets.values() for b in lists):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                collectives.broadcast(bucket[0], src=0, group=group)
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            collectives.broadcast(flat, src=0, group=group)
            for tensor, piece in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(piece.view_as(tensor))


def _compute_device(model_device: torch.device) -> torch.device:
    """Where the model trains, wherever it was built (``model_device``): this worker's device by
    Note [device contract] in zerorun/worker/device.py. A CPU-built model moves to the GPU, as
    DeepSpeed moves it; one built on the meta device is materialized there."""
    return worker_device.this_worker(built_on=str(model_device)).torch_device()


def _train_state_field(name: str) -> property:
    return property(lambda self: getattr(self.train_state, name), lambda self, v: setattr(self.train_state, name, v))


class Engine(DeepSpeedEngineAPI):  # DeepSpeed's accessor names: engine_api.py
    """Built by ``initialize`` with the final config (world size known) and process group."""

    global_step = _train_state_field("global_step")
    micro_steps = _train_state_field("micro_steps")
    skipped_steps = _train_state_field("skipped_steps")
    # The config's accumulation steps; DeepSpeed's gradient_accumulation_steps() reads it (engine_api.py).
    accumulation_steps = _train_state_field("gradient_accumulation_steps")
    loss_scaler = _train_state_field("loss_scaler")
    lr_scheduler = _train_state_field("lr_scheduler")

    def __init__(self, model: nn.Module, optimizer, cfg: ZerorunConfig, pg: ProcessGroupInfo, *, weights=None,
                 param_init_fn=None, model_parameters=None,
                 state_home_for: Callable[[FlatUnit], Home] | None = None):
        self.config = cfg
        self.pg = pg
        # Note [every collective counted]: the worker's recorder subscribes to our collectives
        # before the first one (initialize's process group, the broadcast below). Subscribed
        # later, a rank counted that broadcast only when its sampling thread happened to subscribe
        # first, and the summary showed "-" for the other rank.
        self._recorder = get_recorder()
        first = next(model.parameters())
        materializer = None
        on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        if on_meta or weights is not None:  # Note [materialize per unit] in construct.py
            materializer = Materializer(model, self.pg.device, weights=weights, param_init_fn=param_init_fn,
                                        seed=cfg.seed if cfg.seed is not None else 0)
        if self.pg.device != first.device and not on_meta:
            model.to(self.pg.device)
        self.group = self.pg.group
        self.dtype = model_dtype(cfg.precision)
        if self.dtype != torch.float32:
            model.to(self.dtype)
        if optimizer is None:
            optimizer = _optimizer_from_config(model, cfg, model_parameters)
        if cfg.zero.stage == 3 and self.pg.device.type == "cpu":
            return_large_frees_to_os()  # opt-in (ZERORUN_HOST_MALLOC_TUNING=1), see host_memory.py
        if not on_meta:  # a meta model: Note [same values on every rank] in construct.py
            _broadcast_state(model, self.group)  # (with weights=, the loaded tensors then overwrite)
        # Before any hook or partition: they must see the final module classes.
        apply_from_config(model, cfg.activation_checkpointing)
        self.module = model
        self.stage = cfg.zero.stage
        with _failing_together(self.pg, "setting up NVMe offload",
                               enabled=state_home_for is not None
                               or "nvme" in (cfg.zero.offload_param.device, cfg.zero.offload_optimizer.device)):
            partition = self._build_units(model, optimizer, cfg, materializer, state_home_for)
        # Note [collective agreement] in comm/agreement.py: what this engine's collectives say
        self.collective_number = agreement.new_engine_number()
        units = [record.unit for record in self.records + self.frozen_records]
        for unit in units:
            unit.collective_id = (self.collective_number, unit.index)
        agreement.register_units(self.collective_number, {unit.index: agreement.unit_label(unit.names) for unit in units})
        self._uneven: uneven.UnevenInputs | None = None  # engine.join() while open
        if self.stage == 3 and self.pg.world_size > 1:
            uneven.sync_generate(model)  # Note [synced generate] in uneven.py
        self.gatherer = None
        if self.stage == 3 and partition.module_units:
            record_of = {r.index: r for r in self.records + self.frozen_records}
            module_records = {m: [record_of[u.index] for u in us] for m, us in partition.module_units.items()}
            holder_records = {m: [record_of[u.index] for u in us] for m, us in partition.holder_units.items()}
            self.gatherer = ParamGatherer(model, module_records, self.group,
                                          max_reuse_distance=cfg.zero.max_reuse_distance,
                                          holder_records=holder_records, leaf_units=partition.leaf_units,
                                          prefetch_elements=cfg.zero.prefetch_bucket_size,
                                          turn_elements=cfg.zero.turn_prefetch_bucket_size,
                                          max_live_elements=cfg.zero.max_live_parameters)
        self.hpz_groups = (None, None)  # ZeRO++ hpZ (zero/hpz.py): the host group, the group across hosts
        if self.gatherer is not None and cfg.zero.hpz_partition_size > 1:
            self.hpz_groups = hpz.attach(self.gatherer, cfg.zero.hpz_partition_size, self.pg.world_size, self.pg.rank)
        self.updater = UnitUpdater(
            optimizer, self.records, self.group,
            data_parallel_world=self.pg.world_size, shard_world=1 if self.stage == 0 else self.pg.world_size,
            update_bucket_size=cfg.zero.update_bucket_size, refresh=self._refresh(cfg.zero),
        )
        policy = ReducePolicy.for_stage(self.stage)  # Note [scatter in place] in grad_reduce.py (stage 1)
        self.reducer = GradReducer(
            self.records, partition.reduce_order, policy, self.group,
            on_unit_complete=self.gatherer.unit_grads_done if self.gatherer else None,
            on_unit_reduced=self.updater.unit_reduced,
            lazy_gradients=self.stage >= 1,  # Note [lazy gradient shards] in grad_reduce.py
            closed_by_module=partition.leaf_units if self.gatherer else frozenset(),
            arrivals_per_param=self.gatherer.arrivals_per_param if self.gatherer else None,
        )
        if self.gatherer is not None:  # Note [expert gradients] in grad_reduce.py
            self.gatherer.on_backward_over = self.reducer.close_unit
        if self.gatherer is not None and cfg.zero.tied_embedding_rows:
            self._tied_lookups_as_rows(model, self.gatherer)
        self._quantize_collectives(cfg.zero)
        if self.hpz_groups[1] is not None:  # ZeRO++ hpZ over several hosts
            self.reducer.hierarchy = self.hpz_groups
        self.optimizer = optimizer  # the user's object steps the masters (update.py)
        from zerorun.schedulers import build_scheduler  # torch's classes and DeepSpeed's five

        self.train_state = TrainState(optimizer, LossScaler.from_config(cfg.precision),
                                      build_scheduler(optimizer, cfg.scheduler), cfg.gradient_accumulation_steps)
        self._boundary_override: bool | None = None
        self._step_applied = False
        self.last_grad_norm: float | None = None
        # The window's summed loss: a 0-d tensor while it runs (no sync per micro-step), 0.0 between.
        self._window_loss: torch.Tensor | float = 0.0
        self._window_samples = 0
        self._step_started = time.perf_counter()
        # Note [trim after step] in host_memory.py; 0 = never.
        self._trim_every = trim_interval(os.environ) if self.stage == 3 and self.pg.device.type == "cpu" else 0
        param_access.refuse_resizing(model, self.stage)  # Note [resize before initialize]
        engine_built(self)  # Note [engine hooks] in engine_api.py (DeepSpeed's ds_* attributes)
        LIVE_ENGINES.add(self)  # deepspeed.zero.GatheredParameters finds units here

    def _refresh(self, zero) -> EagerRefresh:
        """How the step's updated values reach the ranks. Stages 1-2: Note [refresh on first read]
        (refresh_ahead.py); stage 3 with a prefetch budget: Note [next forward's gathers in the
        step] (step_gathers.py), its replicated (persistent) units refreshed inside the step;
        otherwise (stage 0 has nothing to spread) inside the step."""
        if zero.overlap_comm and self.stage in (1, 2):
            return RefreshAhead(self.module)
        if zero.overlap_comm and self.gatherer is not None and zero.prefetch_bucket_size > 0 and self.pg.world_size > 1:
            return StepGathers(self.gatherer)
        return EagerRefresh()

    def _tied_lookups_as_rows(self, model: nn.Module, gatherer: ParamGatherer) -> None:
        """Tied embeddings' lookups as rows: their gradient (Note [lookup gradients] in
        lookup_gradients.py: the dense share reduced where the head registers it) and the rows
        they read (Note [lookup rows first] in lookup_rows.py)."""
        tied = lookup_gradients.tied_lookups(model, self.records)
        if tied:
            self.reducer.lookups = lookup_gradients.LookupGradients(tied, self.group)
            gatherer.rows_first = RowsFirst(tied, self.group, model)
            self.reducer.order = lookup_gradients.reduce_order(self.reducer.order, self.records, model,
                                                               set(self.reducer.lookups.units))

    def _quantize_collectives(self, zero) -> None:
        """ZeRO++ (Note [quantized collectives] in comm/quantized_collectives.py): which stage-3 units
        gather int8 blocks (all with qwZ, the all-frozen ones with quantized_nontrainable_weights),
        and whether gradients reduce-scatter them (qgZ). The config allows these only at the
        stages that have those collectives (config/rules.py)."""
        block = zero.quantization_block_size
        for record in self.records + self.frozen_records:
            frozen = not any(p.requires_grad for p in record.unit.params)
            if record.unit.partitioned and (zero.quantized_weights or (zero.quantized_nontrainable_weights and frozen)):
                record.unit.quantize_block = block
        if zero.quantized_gradients:
            self.reducer.quantize_block = block

    def _build_units(self, model, optimizer, cfg, materializer, state_home_for):
        """The partition into units and one record per unit (unit/record.py), the one unit list
        every pass walks, with each unit's parameter chunk and master placed."""
        param_home = placement_from_config(cfg.zero.offload_param, rank=self.pg.rank, role="param")
        partition = build_partition(
            model, optimizer, stage=self.stage, world_size=self.pg.world_size, rank=self.pg.rank,
            bucket_numel=cfg.zero.reduce_bucket_size,
            persistence_threshold=cfg.zero.param_persistence_threshold,
            min_unit_numel=min(cfg.zero.allgather_bucket_size, STAGE3_UNIT_CAP), alignment=CHUNK_ALIGNMENT,
            leaf_names=check_leaf_names(model, cfg.zero.leaf_modules),
            shard_home=param_home,
            before_unit=materializer.ensure if materializer else None,
        )
        if materializer is not None:
            materializer.finish()
        if state_home_for is None:
            placement = placement_from_config(cfg.zero.offload_optimizer, rank=self.pg.rank)
            state_home_for = lambda unit: placement
        self.records: list[UnitRecord] = []
        for unit in partition.units:
            home = state_home_for(unit)
            segments = tuple(unit.layout.segments(unit.rank))  # the pieces this rank's chunk holds
            self.records.append(UnitRecord(unit, segments, home.make_master(unit), home, param_home))
        # Note [frozen units] in unit/partition.py: gathered like the rest, in no other pass; no
        # master (the "master" is the chunk itself, which nothing steps) and no optimizer state.
        self.frozen_records: list[UnitRecord] = [
            UnitRecord(unit, tuple(unit.layout.segments(unit.rank)), unit.shard, param_home, param_home)
            for unit in partition.frozen]
        return partition

    # -- the training loop ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def world_size(self) -> int:
        return self.pg.world_size

    @property
    def rank(self) -> int:
        return self.pg.rank

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's override: the caller says whether the next backward/step ends the
        accumulation window (None returns to counting micro-steps)."""
        self._boundary_override = is_boundary

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self.dtype != torch.float32:
            args, kwargs = _cast_floating((args, kwargs), self.dtype)
        if self._uneven is not None:  # Note [uneven inputs] in uneven.py
            self._uneven.before_forward(args, kwargs)
        tensors = tensors_in((args, kwargs))  # a tuple batch counts its first tensor
        if tensors and tensors[0].dim() > 0:
            self._window_samples += tensors[0].shape[0]
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backpropagate ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        ``scale_wrt_gas=False`` skips the division, as in DeepSpeed."""
        with agreement.phase("backward"):
            self._backward(loss, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        # A unit the forward never read is current before its gradient exists, and an offloaded
        # update may publish into a chunk during this backward (Note [refresh on first read]).
        self.updater.refresh.settle()
        boundary = self.is_gradient_accumulation_boundary()
        self.reducer.communicate = boundary
        if boundary:
            self.updater.open_window(self.loss_scaler, self.config.gradient_clipping)
        # No sync per micro-step. scale_wrt_gas=False: the caller divided by the accumulation
        # steps (Trainer), so the micro-batch's loss, the one recorded, is loss x steps.
        self._window_loss = self._window_loss + loss.detach().float() * (1 if scale_wrt_gas else self.accumulation_steps)
        factor = self.loss_scaler.scale / (self.accumulation_steps if scale_wrt_gas else 1)
        (loss.float() * factor).backward()
        self.reducer.finish_backward()
        if self.gatherer is not None:
            self.gatherer.finish_backward()

    def step(self) -> None:
        """Apply the optimizer at an accumulation boundary; a no-op on other micro-steps."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with agreement.phase("step"):
            self._step()

    def _step(self) -> None:
        if self.gatherer is not None:
            # Nothing gathered may outlive the update unrefreshed, and the gather pool goes:
            # between steps a unit is its shard alone (Note [gather pool] in unit/storage.py).
            self.gatherer.release_all()
        applied, self.last_grad_norm = self.updater.step(
            loss_scaler=self.loss_scaler, clip=self.config.gradient_clipping
        )
        self.reducer.zero()
        self.global_step += 1
        if self._trim_every and (self.global_step == 1 or self.global_step % self._trim_every == 0):
            trim_host_heap()  # Note [trim after step] in host_memory.py
        self._step_applied = applied
        self.optimizer.overflow = not applied  # DeepSpeed's optimizers say so (Accelerate reads it)
        if not applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        now = time.perf_counter()
        # Only when something records: float() of the loss waits for the device, and the
        # breakdown walks every unit and optimizer state.
        if self._recorder.enabled:
            self._recorder.record_step(
                step=self.global_step,
                loss=float(self._window_loss) / self.accumulation_steps,
                loss_scale=self.loss_scale,
                lr=self.optimizer.param_groups[0]["lr"],
                samples=self._window_samples,  # this rank's; the collector sums ranks
                step_time_s=now - self._step_started,
            )
            self._recorder.set_memory_breakdown(self.memory_breakdown())
        self._note_grace(now - self._step_started)
        self._window_loss, self._window_samples, self._step_started = 0.0, 0, now
        checkpoint_schedule.save_on_interval(self)  # checkpoint.interval_steps (zero/checkpoint/schedule.py)

    def _note_grace(self, step_s: float) -> None:
        """Note [preemption grace]: whether one step (plus a save) fits in Slurm's grace time."""
        line = preemption_grace.note_step_time(step_s)
        if line is not None and self.pg.rank == 0:
            print(line, file=sys.stderr, flush=True)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def join(self) -> uneven.UnevenInputs:
        """``with engine.join(): for batch in mine: engine(batch)`` under no_grad: ranks with
        fewer eval batches shadow the others' forwards (Note [uneven inputs] in uneven.py)."""
        return uneven.UnevenInputs(self)

    # -- inspection -----------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last step (computed when clipping or fp16 scaling is on)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """False after a step that fp16 overflow skipped."""
        return self._step_applied

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds right now, counted from the tensors' storages."""
        in_units = {id(p) for record in self.frozen_records for p in record.unit.params}
        frozen = sum(p.numel() * p.element_size() for p in self.module.parameters()
                     if not p.requires_grad and id(p) not in in_units)  # below stage 3: whole
        params = {"device": frozen, "host": 0, "nvme": 0}
        for record in self.records + self.frozen_records:  # a stage-3 chunk counts where its param home keeps it
            params[record.param_home.location if record.unit.partitioned else "device"] += record.unit.param_nbytes()
        gradients, transient = self.reducer.nbytes()
        if self.gatherer is not None:  # gathered copies are transient, as the estimate counts them
            transient += self.gatherer.pool_nbytes() + sum(r.unit.gathered_nbytes() for r in self.gatherer.records)
        placed = self.updater.placed_nbytes()
        breakdown = {
            "parameters": params["device"],
            "gradients": gradients,
            "optimizer_state": placed["device"],
            "communication_buffers": transient,
        }
        if self.hpz_groups[0] is not None:  # ZeRO++ hpZ: the host-local copies backward gathers from
            breakdown["secondary_parameters"] = hpz.secondary_nbytes(self.records + self.frozen_records)
        breakdown["total"] = sum(breakdown.values())
        # Offloaded state (offload/placements.py): host memory and NVMe files, outside the device total.
        breakdown["offloaded_host"] = placed["host"] + params["host"]
        breakdown["offloaded_nvme"] = placed["nvme"] + params["nvme"]
        return breakdown

    def quiesce(self) -> None:
        """Before a checkpoint reads or rewrites the records: no unit left gathered (stage 3),
        every write behind on disk (NVMe), every refreshed chunk arrived (stages 1-2)."""
        self.updater.refresh.settle()
        if self.gatherer is not None:
            self.gatherer.release_all()
        for home, records in by_state_home(self.records).items():
            home.settle(records)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole, unsharded model state dict (every rank must call this); stage 3 gathers
        one unit at a time (zero/full_state.py)."""
        with agreement.phase("checkpoint"):
            return full_state.full_state_dict(self, rank0_only)

    # -- checkpoints (zero/checkpoint/save.py, load.py) ------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
        """Write a sharded checkpoint to ``save_dir/tag`` (default ``global_step{N}``); every rank."""
        with agreement.phase("checkpoint"):
            self._check_same_checkpoint_dir(save_dir, tag)
            return checkpoint_save.save_checkpoint(self, save_dir, tag, client_state, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True):
        """Load ``load_dir/tag`` (default: the ``latest`` one) at any world size, stage or offload;
        returns (path, client_state), (None, None) when there is no checkpoint yet.
        ``load_module_strict`` (DeepSpeed's keyword, passed by Trainer) is accepted: a zerorun
        checkpoint of this model holds every parameter, so the load is always strict."""
        with agreement.phase("checkpoint"):
            return checkpoint_load.load_checkpoint(self, load_dir, tag, load_optimizer_states=load_optimizer_states,
                                                   load_lr_scheduler_states=load_lr_scheduler_states,
                                                   load_module_only=load_module_only)

    def set_total_steps(self, n: int) -> None:
        """Tell the dashboard how many optimizer steps the run will take (progress bar and ETA)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"set_total_steps needs a positive number of steps, got {n!r}")
        self._recorder.set_total_steps(n)


def _cast_floating(value, dtype: torch.dtype):
    """Floating tensors, also inside tuples, lists, dicts and namedtuples (torch's pytree), cast
    to ``dtype``; integer tensors (token ids, labels) and everything else as they are."""
    cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t
    return pytree.tree_map(cast, value)
