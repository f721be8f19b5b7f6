"""The memory model: bytes per GPU, per host and on NVMe for one training configuration (pure).

Symbols (docs/estimate.md writes each formula out): Ψ parameters, N ranks in the job,
p bytes per parameter and per gradient (2 in bf16/fp16 training, 4 in fp32), K bytes of
optimizer state per parameter (Adam: fp32 momentum + variance = 8, plus a 4-byte fp32 master
copy when the parameters are 16-bit, so K = 12 there and 8 in fp32 training).

    stage 0: params pΨ     grads pΨ     optimizer KΨ
    stage 1: params pΨ     grads pΨ     optimizer KΨ/N
    stage 2: params pΨ     grads pΨ/N   optimizer KΨ/N
    stage 3: params pΨ/N   grads pΨ/N   optimizer KΨ/N
             (+ pΨ/h in params with hpZ's secondary copies, partition size h)

Shards are ceil(Ψ/N) elements (the flat buffers pad to a multiple of N). Communication
buffers and activations are separate columns so the model-state column is the textbook one.

Frozen parameters (a LoRA base; known where a real module was counted) are in Ψ for the
params column only: no gradient, no optimizer state. Below stage 3 they are whole on every
rank; at stage 3 they are partitioned in units of their own, in the model dtype (Note [frozen
units] in zero/unit/partition.py), and gathered beside the trained units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zerorun.errors import PlannerError
from zerorun.planner.activations import ActivationJob, activation_bytes
from zerorun.planner.architecture import ModelSpec

Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu-optimizer", "cpu-optimizer+params", "nvme"]
OFFLOADS: tuple[Offload, ...] = ("none", "cpu-optimizer", "cpu-optimizer+params", "nvme")
STAGES = (0, 1, 2, 3)
ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq per parameter
MASTER_COPY_BYTES = 4  # fp32 master weights, only when the trained parameters are 16-bit
# Note [engine buffers]: these mirror zerorun/zero. grad_reduce.MAX_IN_FLIGHT reduce-scatters
# may be outstanding while one more bucket fills; param_gather keeps the running module's
# parameters and, in backward, unit_plan.BACKWARD_PREFETCH prefetched modules' gathered.
GRADIENT_BUCKETS_IN_FLIGHT = 2
GATHERED_LAYERS = 3


@dataclass(frozen=True)
class Job:
    """Where the job runs: ``gpus_per_node`` ranks on each of ``nodes`` hosts.

    A hostfile with uneven slots sets ``total_ranks`` (the sum) and ``gpus_per_node`` to the
    largest host, so per-host figures are for the fullest host.
    """

    gpus_per_node: int
    nodes: int = 1
    total_ranks: int | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise PlannerError(f"--gpus must be at least 1 (got {self.gpus_per_node})")
        if self.nodes < 1:
            raise PlannerError(f"--nodes must be at least 1 (got {self.nodes})")

    @property
    def world_size(self) -> int:
        return self.total_ranks or self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Training:
    """How the job trains. Bucket sizes are element counts, as in ``config.zero``."""

    stage: int = 0
    precision: Precision = "bf16"
    offload: Offload = "none"
    reduce_bucket_size: int = 6_250_000  # config.ZeroConfig's default
    allgather_bucket_size: int = 50_000_000
    prefetch_bucket_size: int = 0  # config.ZeroConfig's default (Note [prefetch budget])
    turn_prefetch_bucket_size: int | None = None  # None: prefetch_bucket_size (Note [forward runs on into backward])
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 0
    update_bucket_size: int = 6_250_000  # master elements per optimizer call (Note [bounded update])
    device: Literal["cuda", "cpu"] = "cuda"  # where the step runs: decides Adam's temporaries
    # NVMe offload: the host buffers master and state stream through (zero.offload_optimizer's
    # buffer_count buffers of buffer_size fp32 elements, or of what the largest unit needs).
    nvme_buffer_count: int = 4
    nvme_buffer_size: int = 100_000_000
    # Stage 3: parameter chunks in memory-mapped files (zero.offload_param.device: nvme).
    nvme_params: bool = False
    # zero.offload_optimizer.pin_memory: an offloaded run on CUDA pins its host tensors from
    # one arena per placement (Note [pinned arena]); a CPU run pins nothing whatever it says.
    pin_memory: bool = True
    # ZeRO++ hpZ (zero.hpz_partition_size), stage 3: each rank also holds 1/h of every sharded
    # unit in the gather dtype (Note [secondary copy] in zero/unit/secondary.py), in params.
    hpz_partition_size: int = 1
    # zero.leaf_modules: class names whose modules stage 3 gathers whole (Note [leaf units] in
    # zero/unit/plan.py), beside those the model's own structure or marks make leaves.
    leaf_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise PlannerError(f"ZeRO stage must be 0, 1, 2 or 3 (got {self.stage})")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise PlannerError(f"precision must be fp32, bf16 or fp16 (got {self.precision!r})")
        if self.offload not in OFFLOADS:
            raise PlannerError(f"offload must be one of {', '.join(OFFLOADS)} (got {self.offload!r})")

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        master = 0 if self.precision == "fp32" else MASTER_COPY_BYTES
        return ADAM_STATE_BYTES + master


def offload_supported(stage: int, offload: Offload) -> bool:
    """Offload moves *sharded* state: optimizer offload needs stage >= 1, parameter offload stage 3."""
    if offload == "none":
        return True
    if offload == "cpu-optimizer+params":
        return stage == 3
    return stage >= 1


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes for one rank (GPU and its share of host/NVMe) and the per-host/NVMe totals."""

    stage: int
    offload: Offload
    params: float
    grads: float
    optimizer: float
    comm_buffers: float
    workspace: float
    backward_workspace: float
    activations: float | None
    host_per_rank: float
    nvme_per_rank: float
    ranks_per_host: int
    unreduced_gradients: float = 0.0
    pinned_slack: float = 0.0  # already in host_per_rank: what the pinned arenas hold beyond their pieces
    turn_buffers: float = 0.0  # stage 3 with a prefetch budget, at the turn into backward (turn_buffer_bytes)

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def buffers(self) -> float:
        """Transient memory at its peak, not model state. Backward's buckets and gathers are
        all freed before the optimizer step allocates its workspace, so the two phases' peaks
        do not add: the larger one counts (docs/estimate.md). At backward's peak the gradient
        shards of the units still gathered do not exist yet (stage 3), so they come off it.
        With a stage-3 prefetch budget the turn into backward is a third candidate."""
        backward = self.comm_buffers + self.backward_workspace - self.unreduced_gradients
        return max(backward, self.workspace, self.turn_buffers)

    @property
    def gpu_total(self) -> float:
        return self.model_state + self.buffers + (self.activations or 0.0)

    @property
    def host_per_node(self) -> float:
        return self.host_per_rank * self.ranks_per_host

    @property
    def nvme_per_node(self) -> float:
        return self.nvme_per_rank * self.ranks_per_host


def shard(elements: int, world_size: int) -> int:
    """Elements of one rank's shard: the flat buffer is padded to a multiple of N."""
    return math.ceil(elements / world_size)


def estimate(model: ModelSpec, job: Job, training: Training,
             activation_job: ActivationJob | None = None) -> MemoryEstimate:
    if not offload_supported(training.stage, training.offload):
        raise PlannerError(
            f"offload {training.offload!r} is not available at ZeRO stage {training.stage}",
            hint="optimizer offload needs stage 1-3; parameter offload needs stage 3",
        )
    n, psi, stage = job.world_size, model.num_params, training.stage
    trained = model.trained_params
    p, k = training.param_bytes, training.optimizer_bytes
    # Stage 3 keeps small units whole on every rank (their gradients and optimizer state
    # are still sharded: they live in ordinary stage-2 style buckets); frozen ones too.
    persistent = _persistent_elements(model, training) if stage == 3 else 0
    frozen_kept = _stage3_frozen_plan(model, training)[1] if stage == 3 else 0
    sharded = trained - persistent
    frozen_sharded = model.frozen_params - frozen_kept

    params = p * (psi if stage < 3 else shard(sharded, n) + persistent + shard(frozen_sharded, n) + frozen_kept)
    grads = p * (trained if stage < 2 else shard(trained, n))
    optimizer: float = k * (trained if stage == 0 else shard(trained, n))
    if stage == 3 and p != 4 and training.offload == "none":
        # Note [fp32 shard] (zero/unit/storage.py): a 16-bit stage-3 chunk is kept in fp32 and
        # IS its master, so it counts 4 bytes as a parameter and no master beside it. A frozen
        # chunk has no master: it stays in the model dtype.
        params += (4 - p) * shard(sharded, n)
        optimizer -= MASTER_COPY_BYTES * shard(sharded, n)
    if stage == 3 and training.hpz_partition_size > 1:
        params += p * secondary_elements(sharded + frozen_sharded, n, training.hpz_partition_size)
    host = nvme = 0.0
    if training.offload != "none":
        # An offloaded master is always a tensor of its own (make_master in zerorun/zero/offload/master.py), even in
        # fp32, where without offload the parameter storage doubles as the master.
        offloaded = optimizer + (MASTER_COPY_BYTES * shard(trained, n) if training.precision == "fp32" else 0)
        optimizer = 0.0
        if training.offload == "nvme":
            nvme, host = offloaded, _offload_staging_bytes(model, job, training)
        else:
            host = offloaded + _offload_staging_bytes(model, job, training)
        host += pinned_slack_bytes(model, job, training)
    # Parameters on NVMe (a config's offload_param) go with an offloaded optimizer: a row
    # labelled "none" offloads nothing, whatever the config held.
    nvme_params = training.nvme_params and training.offload != "none"
    if stage == 3 and (training.offload == "cpu-optimizer+params" or nvme_params):
        moved = p * (shard(sharded, n) + shard(frozen_sharded, n))  # frozen chunks share the param home
        params -= moved
        if nvme_params:
            nvme += moved
        else:
            host += moved
    return MemoryEstimate(
        stage=stage,
        offload=training.offload,
        params=float(params),
        grads=float(grads),
        optimizer=float(optimizer),
        comm_buffers=float(communication_buffer_bytes(model, job, training)),
        workspace=float(step_workspace_bytes(model, job, training)),
        backward_workspace=float(backward_workspace_bytes(model, job, training)),
        unreduced_gradients=float(unreduced_gradient_bytes(model, job, training)),
        turn_buffers=float(turn_buffer_bytes(model, job, training)),
        activations=_activations(model, training, activation_job),
        host_per_rank=float(host),
        pinned_slack=float(pinned_slack_bytes(model, job, training)),
        nvme_per_rank=float(nvme),
        ranks_per_host=job.gpus_per_node,
    )


def secondary_elements(sharded: int, world_size: int, hpz: int) -> int:
    """hpZ's secondary copy per rank: 1/h of the sharded elements as the layout pads them (to a
    multiple of N, so of h), the engine's ``secondary_parameters`` line in elements."""
    return shard(sharded, world_size) * world_size // hpz


def _stage3_plan(model: ModelSpec, training: Training) -> tuple[list | None, int]:
    """(the units stage 3 partitions, the elements it keeps whole on every rank). A unit of at
    most ``param_persistence_threshold`` elements stays whole (Note [persistent units] in
    zero/unit/plan.py). With the module tree, the engine's own units; without it (None, 0): its
    units are taken to be layers, far above the threshold."""
    from zerorun.zero.unit import plan as unit_plan

    tree = _module_tree(model, training)
    if tree is None:
        return None, 0
    sharded = unit_plan.stage3_units(tree, training.param_persistence_threshold, _stage3_min_unit(training))
    return sharded, unit_plan.trainable_numel(tree) - sum(u.numel for u in sharded)


def _module_tree(model: ModelSpec, training: Training):
    """The counted model's module tree with the config's leaf classes marked, or None (no real
    module was counted). A class name no module has is refused, as the engine refuses it."""
    from zerorun.zero.unit import plan as unit_plan

    tree = model.module_tree
    if not isinstance(tree, unit_plan.ModuleNode):
        return None
    if not training.leaf_modules:
        return tree
    missing = sorted(set(training.leaf_modules) - unit_plan.tree_kinds(tree))
    if missing:
        raise PlannerError(f"zero.leaf_modules names {', '.join(missing)}, which no module of the model is",
                           hint="use class names of the model's modules (its expert blocks)")
    return unit_plan.with_leaves(tree, frozenset(training.leaf_modules))


def _persistent_elements(model: ModelSpec, training: Training) -> int:
    return _stage3_plan(model, training)[1]


def _stage3_frozen_plan(model: ModelSpec, training: Training) -> tuple[list, int]:
    """(the units of frozen parameters stage 3 partitions, the frozen elements it keeps whole):
    Note [frozen units] in zero/unit/partition.py, the engine's own rule. Without the module
    tree no parameter is known to be frozen: ([], 0)."""
    from zerorun.zero.unit import plan as unit_plan

    tree = _module_tree(model, training)
    if tree is None:
        return [], 0
    units = unit_plan.stage3_frozen_units(tree, training.param_persistence_threshold, _stage3_min_unit(training))
    return units, unit_plan.trainable_numel(tree, trainable=False) - sum(u.numel for u in units)


def _stage3_min_unit(training: Training) -> int:
    from zerorun.zero.unit.plan import STAGE3_UNIT_CAP

    return min(training.allgather_bucket_size, STAGE3_UNIT_CAP)


def largest_parameter(model: ModelSpec) -> int:
    """The largest trained parameter (the largest one autograd makes a gradient for)."""
    return max(model.param_sizes, default=0 if model.frozen_params else model.largest_layer_params)


def bucket_elements(model: ModelSpec, training: Training) -> int:
    """Elements of the biggest gradient bucket (a stage 0-2 unit): parameters are packed whole,
    so a parameter larger than ``reduce_bucket_size`` makes a bucket of its own."""
    return min(max(training.reduce_bucket_size, largest_parameter(model)), model.trained_params)


def communication_buffer_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Transient buffers the collectives need, at their peak (see Note [engine buffers]).

    stage 0/1: 0. Gradients are all-reduced in place in the persistent gradient buffer (stage
               1: reduce-scattered into its own chunk, Note [scatter in place] in
               zero/grad_reduce.py; only the CPU ring between hosts keeps a receive slice per
               reduce-scatter in flight, not counted), and the updated parameters are
               all-gathered in place into the parameter buffer.
    stage 2:   gradient buckets of p·B bytes: up to (in-flight + 1) alive, one filling while
               the others are reduce-scattered, each in-flight one with its p·B/N output;
               never more buckets than the model has (Ψ/B of them).
    stage 3:   the same with layer-sized buckets (B = L, the largest layer), plus three gathered
               layers of p·L (the running one and, in backward, the two prefetched next).
    A single rank communicates nothing.
    """
    if job.world_size == 1 or training.stage <= 1:
        return 0
    p, n = training.param_bytes, job.world_size
    if training.stage == 2:
        return _gradient_bucket_bytes(gradient_bucket_sizes(model, training), p, n)
    gathered, bucket, units = stage3_unit_sizes(model, training)
    return p * gathered + _gradient_bucket_bytes([bucket] * units, p, n)


def gradient_bucket_sizes(model: ModelSpec, training: Training) -> list[int]:
    """Elements of each stage 0-2 gradient bucket. With the parameter sizes known, the
    engine's own packing (zero/sharding.pack_buckets, backward order); else ⌈Ψ/B⌉ buckets of B."""
    from zerorun.zero.unit.layout import ParamSpec, pack_buckets

    if model.param_sizes or model.frozen_params:  # only trained parameters are bucketed
        specs = [ParamSpec(str(i), size) for i, size in enumerate(reversed(model.param_sizes))]
        return [sum(spec.numel for spec in bucket) for bucket in pack_buckets(specs, training.reduce_bucket_size)]
    bucket = bucket_elements(model, training)
    return [bucket] * math.ceil(model.trained_params / bucket)


def stage3_unit_sizes(model: ModelSpec, training: Training, turn: bool = False) -> tuple[int, int, int]:
    """(elements gathered at once at worst, largest gradient bucket, number of units) at stage 3.

    With the module tree (a real model was counted) these come from the engine's own unit
    rules (zero/unit/plan.py): gathered = the largest (nesting depth + 3) units, bucket = the
    largest unit (a lone parameter's gradient is reduced in place, but is just as alive).
    Without it: units of max(L, min(allgather_bucket_size, STAGE3_UNIT_CAP)) elements, three
    of them gathered (the running module and, in backward, the two prefetched next). Either
    way, a prefetch budget (prefetch_bucket_size, Note [prefetch budget] in
    zero/gather_prefetch.py) adds up to that many elements ahead, and at the ``turn`` into
    backward (``turn_buffer_bytes``) backward's own window besides (turn_prefetch_bucket_size,
    or the budget again), and no more than max_live_parameters.
    """
    gathered, bucket, units = _stage3_unit_sizes(model, training)
    ahead = training.prefetch_bucket_size + (turn_window(training) if turn else 0)
    extra = min(ahead, training.max_live_parameters, model.num_params)
    return min(gathered + max(0, extra), max(gathered, model.num_params)), bucket, units


def turn_window(training: Training) -> int:
    """Elements of backward's own window at the turn: turn_prefetch_bucket_size T, or B."""
    turn = training.turn_prefetch_bucket_size
    return training.prefetch_bucket_size if turn is None else turn


def turn_buffer_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Stage 3 with a prefetch budget B, at forward's last call (Note [forward runs on into
    backward] in zero/gather_prefetch.py): up to B + T elements gathered ahead, the B held from
    forward and backward's own window T (turn_prefetch_bucket_size, B when unset), beside the G
    of the fixed lookahead, p·(G + B + T) bytes.
    No gradient exists yet then (Note [lazy gradient shards]): no bucket, no backward
    workspace, and the gradient column's p·⌈Ψₜ/N⌉ comes off. At backward's own peak the
    window holds at most B ahead (``communication_buffer_bytes``). Zero without a budget or
    on one rank."""
    if training.stage != 3 or training.prefetch_bucket_size <= 0 or job.world_size == 1:
        return 0
    gathered, _bucket, _units = stage3_unit_sizes(model, training, turn=True)
    p = training.param_bytes
    return p * gathered - p * shard(model.trained_params, job.world_size)


def _stage3_unit_sizes(model: ModelSpec, training: Training, trained_only: bool = False) -> tuple[int, int, int]:
    """stage3_unit_sizes without the prefetch budget. The gathered units are the trained ones
    and the frozen ones (Note [frozen units]: gathered by the same hooks), unless
    ``trained_only``; the buckets and their count are the trained units' alone (a frozen unit is
    never reduced)."""
    from zerorun.zero.unit import plan as unit_plan

    planned, persistent = _stage3_plan(model, training)
    frozen = [] if trained_only else _stage3_frozen_plan(model, training)[0]
    if planned or frozen:
        trained = planned or []  # a wholly frozen model: no trained unit
        bucket = max((u.numel for u in trained), default=0)
        if persistent:
            bucket = max(bucket, min(training.reduce_bucket_size, persistent))
        return unit_plan.max_gathered_numel(unit_plan.gathered_together(trained, frozen)), bucket, len(trained)
    layer = max(model.largest_layer_params or bucket_elements(model, training), _stage3_min_unit(training))
    layer = min(layer, model.num_params)
    units = (max(1, math.ceil((model.num_params - persistent) / layer)) if model.param_sizes
             else GATHERED_LAYERS + GRADIENT_BUCKETS_IN_FLIGHT + 1)
    return min(GATHERED_LAYERS, units) * layer, layer, units


def _gradient_bucket_bytes(buckets: list[int], p: int, n: int) -> int:
    """The largest F + 1 buckets alive (F in flight, one filling), each in-flight one with its
    receive slice of ⌈B/N⌉."""
    largest = sorted(buckets, reverse=True)
    alive = largest[: GRADIENT_BUCKETS_IN_FLIGHT + 1]
    in_flight = largest[:GRADIENT_BUCKETS_IN_FLIGHT]
    return p * sum(alive) + p * sum(shard(b, n) for b in in_flight)


def backward_workspace_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """What backward holds beside the buckets: autograd's fresh gradient of the largest
    parameter (p·P) and, 16-bit at stage 2/3, the fp32 gradient accumulators ((4 - p)·S).

    16-bit at stage 2/3, one more: a bucket's fp32 accumulator is made from its finished
    16-bit reduce-scatter output while that output is still alive, so for that moment the
    credit of ``unreduced_gradient_bytes`` (no accumulator for a bucket still alive) is one
    largest bucket's shard too generous: 4·⌈B/N⌉. The per-tensor CPU Adam's temporaries used to
    hide this (8.4M-parameter MLP, bf16, stage 2: measured 104.7 MB against 94.5 estimated
    without it)."""
    p, stage = training.param_bytes, training.stage
    total = p * largest_parameter(model)
    if p != 4 and stage >= 2 and training.offload == "none":
        total += (4 - p) * shard(model.trained_params, job.world_size)
        if job.world_size > 1:
            total += 4 * shard(_largest_reduced_bucket(model, training), job.world_size)
    return total


def _largest_reduced_bucket(model: ModelSpec, training: Training) -> int:
    """The largest gradient bucket backward reduce-scatters: stage 2's, or a stage-3 unit."""
    if training.stage == 2:
        return max(gradient_bucket_sizes(model, training), default=0)
    _gathered, bucket, units = stage3_unit_sizes(model, training)
    return bucket if units else 0


def unreduced_gradient_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Gradient-shard bytes the grads column counts but that do not exist at backward's peak.

    Stages 2-3 create a unit's fp32 shard accumulator at its first reduce-scatter and drop it
    after the step (Note [lazy gradient shards], zero/grad_reduce.py), so the units whose
    gradients are still being collected or reduced have none yet. Stage 3: a unit still
    gathered for backward has not been reduced, so while the G gathered elements are alive
    their shards, 4·⌈G/N⌉ bytes (fp32 accumulators in every precision), are not; nor are those
    of the F units in flight, whose outputs the buckets column counts (in fp32 the output
    becomes the accumulator: counting both overstated the 8.4M MLP's stage 3 by 4.2 MB).
    Stage 2: the F + 1 buckets alive (F in flight, one filling) have no shard yet, 4·Σ⌈B/N⌉.
    Stages 0-1 reduce full buffers in place (no buckets to credit against), and a single rank
    communicates nothing.
    """
    if training.stage < 2 or job.world_size == 1 or training.offload != "none":
        return 0
    if training.stage == 2:
        alive = sorted(gradient_bucket_sizes(model, training), reverse=True)[: GRADIENT_BUCKETS_IN_FLIGHT + 1]
        return 4 * sum(shard(b, job.world_size) for b in alive)
    gathered, bucket, units = stage3_unit_sizes(model, training)
    # Only trained units have gradient shards to be missing (a frozen one never has one).
    gathered = min(gathered, _stage3_unit_sizes(model, training, trained_only=True)[0])
    return 4 * shard(gathered, job.world_size) + 4 * stage3_units_in_flight(units) * shard(bucket, job.world_size)


def stage3_units_in_flight(units: int) -> int:
    """Units being reduce-scattered at stage 3's backward peak: F, from those not gathered."""
    return min(GRADIENT_BUCKETS_IN_FLIGHT, max(0, units - GATHERED_LAYERS))


def step_workspace_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Working memory of backward and the optimizer step beyond the model states.

    - autograd's fresh gradient of one parameter before it is added into its buffer: p·P
      (P = the largest parameter);
    - 16-bit training, stage 0/1: the step upcasts the gradient slices of one optimizer call
      to fp32, 4·G; stage 2/3: gradients are accumulated in fp32 shards, (4 - p)·S more than
      the p·S the gradient column counts (S = this rank's share: Ψ at stage 0, ceil(Ψ/N)
      above; G = one call's elements: min(S, max(update_bucket_size, C)), Note [bounded
      update] in zero/update.py);
    - Adam's temporaries: on CUDA torch uses the multi-tensor ("foreach") update, which
      allocates one fp32 temporary per state element of the call: 4·G; on CPU the engine runs
      torch's fused kernel (Note [host optimizer kernels] in zero/offload/placements.py), which
      updates in place and allocates nothing (the per-tensor path it replaces held 8·C, two
      fp32 temporaries of the largest chunk C).
    - stage 3 with a prefetch budget B: the next forward's first gathers, issued during the
      update (Note [next forward's gathers in the step] in zero/step_gathers.py), p·(L + max(B, L))
      at most (L = the largest unit: the first call's, then the window it prefetches).
    With the optimizer offloaded, only the first and last items stay on the GPU.
    """
    p, stage, n = training.param_bytes, training.stage, job.world_size
    share = model.trained_params if stage == 0 else shard(model.trained_params, n)
    total = p * largest_parameter(model)
    if stage == 3 and training.prefetch_bucket_size > 0 and n > 1:
        largest_unit = _stage3_unit_sizes(model, training)[1]
        total += p * min(largest_unit + max(training.prefetch_bucket_size, largest_unit), model.num_params)
    if training.offload != "none":
        return total  # the fp32 gradient and Adam's temporaries live with the offloaded step
    unit = model.largest_layer_params if stage == 3 and model.largest_layer_params else bucket_elements(model, training)
    chunk = unit if stage == 0 else shard(unit, n)
    group = min(share, max(training.update_bucket_size, chunk))
    if p != 4:
        total += 4 * group if stage <= 1 else (4 - p) * share
    if training.device == "cuda":
        total += 4 * group
    return total


def _offload_staging_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Host memory an offloaded update streams through: one unit's fp32 gradient chunk at a
    time (cpu: Note [unit-sized gradient staging] in zerorun/zero/offload/placements.py), or the
    configured buffers that master and state are read into (nvme: Note [file buffers])."""
    if training.offload == "none":
        return 0
    unit = model.largest_layer_params if training.stage == 3 and model.largest_layer_params else bucket_elements(model, training)
    chunk = shard(unit, job.world_size)
    if training.offload == "nvme":  # a master and Adam's two moments per buffer
        return 4 * training.nvme_buffer_count * min(training.nvme_buffer_size, 3 * chunk)
    return 4 * chunk


def pinned_slack_bytes(model: ModelSpec, job: Job, training: Training) -> int:
    """Host bytes the pinned arenas reserve beyond the pieces they hand out (Note [pinned
    arena] in zero/offload/pinned.py), from the arena's own block rule (``reserved_for``).

    Only an offloaded run on CUDA with ``pin_memory`` pins: a CPU worker never does. Each
    placement has its own arena: ``cpu-optimizer`` carves one fp32 master of 4·⌈U/N⌉ bytes
    per unit U, in unit order; ``cpu-optimizer+params`` also carves each stage-3 unit's
    p·⌈U/N⌉ host chunk from the parameter placement's arena; ``nvme`` carves its buffer pool
    (the staging buffers the host column already counts; masters go to files unpinned).
    The pieces themselves are counted in the host column already: only the slack is added."""
    from zerorun.zero.offload.pinned import reserved_for

    if training.offload == "none" or training.device != "cuda" or not training.pin_memory:
        return 0
    n = job.world_size

    def slack(pieces: list[int]) -> int:
        return reserved_for(pieces) - sum(pieces)

    if training.offload == "nvme":
        buffer = _offload_staging_bytes(model, job, training) // training.nvme_buffer_count
        return slack([buffer] * training.nvme_buffer_count)
    units = _offload_unit_elements(model, training)
    total = slack([4 * shard(u, n) for u in units])
    if training.offload == "cpu-optimizer+params":  # frozen chunks too, after the trained (engine order)
        chunks = _stage3_sharded_units(model, training) + [u.numel for u in _stage3_frozen_plan(model, training)[0]]
        total += slack([training.param_bytes * shard(u, n) for u in chunks])
    return total


def _offload_unit_elements(model: ModelSpec, training: Training) -> list[int]:
    """Elements of each unit whose master an offloaded optimizer holds, in the engine's
    order: stage 1-2 buckets (``gradient_bucket_sizes``); stage 3 units (the engine's plan,
    else layer-sized units), then the whole-kept ones in reduce_bucket_size buckets."""
    if training.stage < 3:
        return gradient_bucket_sizes(model, training)
    persistent = _persistent_elements(model, training)
    return _stage3_sharded_units(model, training) + _split(persistent, training.reduce_bucket_size)


def _stage3_sharded_units(model: ModelSpec, training: Training) -> list[int]:
    """Elements of each unit stage 3 partitions: the engine's plan, else layer-sized units."""
    planned, _persistent = _stage3_plan(model, training)
    if planned:
        return [u.numel for u in planned]
    _gathered, layer, _units = stage3_unit_sizes(model, training)
    return _split(model.num_params, layer)


def _split(elements: int, size: int) -> list[int]:
    """``elements`` in pieces of ``size`` (the last one the remainder)."""
    return [min(size, elements - start) for start in range(0, elements, max(1, size))]


def _activations(model: ModelSpec, training: Training, job: ActivationJob | None) -> float | None:
    if job is None:
        return None
    if model.shape is None:
        return None  # unknown architecture: the table says "n/a" rather than guessing
    q = training.param_bytes
    return float(activation_bytes(model.shape, job, q))
