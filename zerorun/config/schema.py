"""The zerorun config schema: these dataclasses ARE the schema.

The YAML keys are the field names, nested by section; docs/config.md lists every key with its
default. Loading and validation live beside this module (see zerorun.config.load_config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

OffloadDevice = Literal["none", "cpu", "nvme"]
Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass
class OffloadConfig:
    """Where a tensor family lives between uses: GPU ("none"), host memory, or an NVMe path."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    # NVMe only: host buffers that master and optimizer state stream through, and the size
    # of each in fp32 elements (one unit's master + state must fit in one buffer).
    buffer_count: int = 4
    buffer_size: int = 100_000_000


@dataclass
class ZeroConfig:
    """Sharding. Sizes are element counts, as in DeepSpeed."""

    stage: int = 0
    # About DDP's 25 MB bucket in fp32: small enough that reduction overlaps backward (one 50M
    # bucket held the whole 33.7M bench model: no overlap, stage 0 at 1.13x DDP), large enough
    # to amortise each collective. Measured: stage 0 1.13x -> 0.99x DDP CPU time.
    reduce_bucket_size: int = 6_250_000
    allgather_bucket_size: int = 50_000_000
    # Elements of this rank's fp32 masters per optimizer call when the state is not offloaded:
    # the multi-tensor update's temporaries are bounded by one group, not the model (update.py).
    update_bucket_size: int = 6_250_000
    overlap_comm: bool = True
    # Stage 3, Note [prefetch budget] in zero/gather_prefetch.py: elements prefetched beyond the
    # next module (two in backward) along the recorded order; 0 prefetches just those, the
    # least memory (FSDP2's lookahead). DeepSpeed's stage3_prefetch_bucket_size.
    prefetch_bucket_size: int = 0
    # Stage 3, Note [forward runs on into backward] in zero/gather_prefetch.py: with a budget,
    # elements of backward's units gathered at forward's last module, past those held from
    # forward, while the output head, the loss and backward's first modules compute. None: the
    # budget itself (prefetch_bucket_size). zerorun's own; DeepSpeed has no such key.
    turn_prefetch_bucket_size: int | None = None
    # Stage 3: no gather is issued early past this many elements gathered or in flight at
    # once (DeepSpeed's stage3_max_live_parameters, and its default).
    max_live_parameters: int = 1_000_000_000
    # Stage 3: a gather unit of at most this many elements stays whole on every rank (Note
    # [persistent units] in zero/unit/plan.py). 0: every unit is sharded, as FSDP2 shards every
    # module it wraps, so model state is never above FSDP2's (issue 20); a small unit then costs
    # one small gather per use instead of 2 bytes per element on every rank.
    param_persistence_threshold: int = 0
    # Stage 3: a unit used again within this many elements of other gathers stays gathered
    # between the two uses (DeepSpeed's stage3_max_reuse_distance, and its default).
    max_reuse_distance: int = 1_000_000_000
    # Stage 3: module class names gathered as one unit when they run (Note [expert blocks] in
    # zero/unit/leaf.py); expert blocks are found from their structure without it.
    leaf_modules: list[str] = field(default_factory=list)
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    # ZeRO++ (DeepSpeed's zero_quantized_*; Note [quantized collectives] in comm/quantized_collectives.py):
    # stage 3's parameter gathers (qwZ), and those of units whose parameters are all frozen,
    # move int8 blocks with one fp32 scale each; gradient reduce-scatters (qgZ, stages 2-3) too.
    # The masters stay exact. Off by default.
    quantized_weights: bool = False
    quantized_nontrainable_weights: bool = False
    quantized_gradients: bool = False
    # Elements per quantization block: each block's error is at most half its max |x| / 127.
    quantization_block_size: int = 2048
    # ZeRO++ hpZ (DeepSpeed's zero_hpz_partition_size; Note [secondary copy] in
    # zero/unit/secondary.py), stage 3: each rank also keeps 1/hpz of every gathered unit,
    # partitioned among groups of this many ranks on one host, and backward gathers from those
    # copies, within the host. 1: off. It must divide the ranks of every host.
    hpz_partition_size: int = 1
    # Stage 3: a token embedding tied to the head moves rows, not its table, where it can: its
    # lookup reads the rows of the tokens (Note [lookup rows first] in zero/lookup_rows.py) and
    # sends its gradient as those rows, the head's dense share reduced at backward's start
    # instead of its end (Note [lookup gradients] in zero/lookup_gradients.py). Off by default.
    tied_embedding_rows: bool = False


@dataclass
class PrecisionConfig:
    """Training precision. fp16 uses loss scaling: loss_scale 0 means dynamic."""

    dtype: Dtype = "fp32"
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class BatchConfig:
    """train_batch_size = micro_batch_size * gradient_accumulation_steps * world_size.

    Any one may be left out (None) and is derived from the other two and the world size.
    """

    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None


@dataclass
class OptimizerConfig:
    """Used only when ``initialize`` is given no optimizer: a torch.optim class name + kwargs."""

    type: str = "AdamW"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    """A torch.optim.lr_scheduler class name + kwargs, stepped once per optimizer step."""

    type: str = "LambdaLR"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActivationCheckpointingConfig:
    """Wrap every submodule whose class name is listed with torch.utils.checkpoint."""

    enabled: bool = False
    modules: list[str] = field(default_factory=list)


@dataclass
class TelemetryConfig:
    """Worker-side sampling; the launcher streams it to the dashboard and metrics.jsonl."""

    enabled: bool = True
    interval_s: float = 1.0
    # Total optimizer steps, when known, for the dashboard's progress bar.
    total_steps: int | None = None
    # A collective not finished on every rank after this long is reported as a hang.
    hang_after_s: float = 30.0
    # The launcher ends the job when no rank has made progress (output, steps, collectives) for
    # this long, naming the rank the others wait for; 0 = never. CLI: --hang-timeout.
    hang_timeout_s: float = 600.0
    # Seconds a rank may take to join the rendezvous before the job is ended as "still
    # starting"; 0 = never (Note [start-up is not a hang]). CLI: --startup-timeout.
    startup_timeout_s: float = 0.0


@dataclass
class TensorBoardConfig:
    """TensorBoard event files in ``output_path/job_name/`` (DeepSpeed's ``tensorboard`` section)."""

    enabled: bool = False
    # DeepSpeed's meaning: the parent folder, relative to where zerorun starts (empty: there).
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass
class CsvConfig:
    """One CSV file per series in ``output_path/job_name/`` (DeepSpeed's ``csv_monitor``)."""

    enabled: bool = False
    output_path: str = ""  # as tensorboard.output_path
    job_name: str = "DeepSpeedJobName"


@dataclass
class WandbConfig:
    """A Weights & Biases run (DeepSpeed's ``wandb``): needs ``pip install wandb``."""

    enabled: bool = False
    project: str = "deepspeed"
    group: str | None = None
    team: str | None = None  # the W&B entity


@dataclass
class MonitorConfig:
    """Training series exported by the launcher (telemetry/monitor.py, docs/telemetry.md)."""

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv: CsvConfig = field(default_factory=CsvConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @property
    def enabled(self) -> bool:
        return self.tensorboard.enabled or self.csv.enabled or self.wandb.enabled


@dataclass
class CheckpointConfig:
    """Sharded checkpoints: written every ``interval_steps`` optimizer steps (0 = only when asked)."""

    dir: str | None = None
    interval_steps: int = 0
    keep_last: int = 2
    # Load the latest checkpoint of ``dir`` when the engine starts (``zerorun --resume``).
    resume: bool = False
    # On SIGUSR1/SIGUSR2 (Slurm's warning before the time limit) save a checkpoint, then stop.
    on_signal: bool = False
    # After that save, ``scontrol requeue`` the Slurm job so its next start resumes from it.
    requeue: bool = False


@dataclass
class ZerorunConfig:
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int | None = None
    # What loading noticed but did not reject (DeepSpeed keys accepted without effect, "auto"
    # values replaced): not part of the schema, never written by to_dict, printed by the launcher.
    notes: list[str] = field(default_factory=list, compare=False, repr=False, metadata={"schema": False})

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps or 1
