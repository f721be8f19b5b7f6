"""The typed zerorun config: one schema, owned by its consumers, validated once.

Precedence (documented in docs/config.md): command-line flags > environment > file > defaults.

The dataclasses below ARE the schema: the YAML keys are the field names, nested by section.
Loading (YAML, JSON, DeepSpeed JSON), validation with did-you-mean messages, and batch-size
resolution live in this module too (see ``load_config``).
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


@dataclass
class ZeroConfig:
    """Sharding. Sizes are element counts, as in DeepSpeed."""

    stage: int = 0
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = True
    prefetch_bucket_size: int = 50_000_000
    # Stage 3: parameters with at most this many elements stay whole on every rank.
    param_persistence_threshold: int = 100_000
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)


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


@dataclass
class CheckpointConfig:
    dir: str | None = None
    interval_steps: int = 0
    keep_last: int = 2


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int | None = None

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps or 1


# --- loading & validation --------------------------------------------------------------
# load_config(source, *, world_size=None, overrides=None) -> ZerorunConfig
#   source: None | path (.yaml/.yml/.json, zerorun or DeepSpeed) | dict (either format)
#   raises zerorun.errors.ConfigError listing every problem with its key path.
# to_dict(config) -> plain dict (YAML-able); the launcher writes it as JSON for workers
#   and workers read it back with load_config(path).


def load_config(source: Any = None, *, world_size: int | None = None, overrides: dict | None = None) -> ZerorunConfig:
    """Minimal loader (to be replaced by the config issue's full one): our schema only."""
    import json
    from pathlib import Path

    import yaml

    if isinstance(source, ZerorunConfig):
        return source
    if source is None:
        data: dict = {}
    elif isinstance(source, dict):
        data = source
    else:
        text = Path(source).read_text()
        data = json.loads(text) if str(source).endswith(".json") else (yaml.safe_load(text) or {})
    return _build(ZerorunConfig, data)


def _build(cls: type, data: dict) -> Any:
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        kind = hints[f.name]
        for candidate in typing.get_args(kind) or (kind,):
            if dataclasses.is_dataclass(candidate) and isinstance(value, dict):
                value = _build(candidate, value)
                break
        kwargs[f.name] = value
    return cls(**kwargs)


def to_dict(config: ZerorunConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(config)
