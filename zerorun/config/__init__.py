"""The typed zerorun config: one schema, validated once, with fix-it messages.

    from zerorun.config import load_config, to_dict, ZerorunConfig
    config = load_config("zerorun.yaml", world_size=8, overrides={"zero.stage": 3})

Precedence (docs/config.md): command-line flags > environment > file > defaults.

    schema.py     the dataclasses: YAML keys are their field names, nested by section
    loader.py     load_config / to_dict: the chain from a source to a validated config
    sources.py    files, ZERORUN_<SECTION>__<KEY> environment variables, dotted overrides
    deepspeed.py  DeepSpeed JSON keys -> zerorun keys, notes, unsupported features
    build.py      dict <-> dataclass with type checking;  rules.py  ranges, combinations, batch rule
"""

from __future__ import annotations

from zerorun.config.loader import load_config, to_dict
from zerorun.config.schema import (
    ActivationCheckpointingConfig,
    BatchConfig,
    CheckpointConfig,
    Dtype,
    OffloadConfig,
    OffloadDevice,
    OptimizerConfig,
    PrecisionConfig,
    SchedulerConfig,
    TelemetryConfig,
    ZeroConfig,
    ZerorunConfig,
)
from zerorun.config.sources import config_env_names


def parse_settings(items: list[str]) -> dict:
    """``["zero.stage=3"]`` (repeated --set KEY=VALUE flags) -> the ``overrides`` of load_config."""
    from zerorun.config.build import field_paths
    from zerorun.config.sources import parse_assignments

    return parse_assignments(items, field_paths(ZerorunConfig))

__all__ = [
    "ActivationCheckpointingConfig", "BatchConfig", "CheckpointConfig", "Dtype", "OffloadConfig",
    "OffloadDevice", "OptimizerConfig", "PrecisionConfig", "SchedulerConfig", "TelemetryConfig",
    "ZeroConfig", "ZerorunConfig", "config_env_names", "load_config", "parse_settings", "to_dict",
]
