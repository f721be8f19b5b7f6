"""Where telemetry's knobs come from: explicit argument > environment > the run's config.json > default.

The launcher writes the validated config to RUN_DIR/config.json before it starts anything and
names it to workers as ZERORUN_CONFIG, so both sides read the ``telemetry`` section from there
(see zerorun.config.TelemetryConfig) and no extra plumbing is needed to honour it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from zerorun.config import TelemetryConfig
from zerorun.errors import ConfigError


def telemetry_config(config_path: str | Path | None) -> TelemetryConfig:
    """The telemetry section of a launcher-written config.json; defaults when absent or unreadable.

    The file was validated by the launcher when it wrote it, so a problem here means the run
    directory was tampered with or removed: telemetry falls back to defaults rather than failing.
    """
    if not config_path:
        return TelemetryConfig()
    try:
        section = json.loads(Path(config_path).read_text()).get("telemetry") or {}
        known = {f.name for f in dataclasses.fields(TelemetryConfig)}
        return TelemetryConfig(**{k: v for k, v in section.items() if k in known})
    except (OSError, ValueError, TypeError, AttributeError):
        return TelemetryConfig()


def env_number(name: str, kind, default=None, env=os.environ):
    """A positive number from the environment, ``default`` when unset; ConfigError when malformed."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a positive {'integer' if kind is int else 'number'}",
                          hint=f"unset {name} or set it to e.g. {'100' if kind is int else '30'}")
    return value


def monitor_section(config_path: str | Path | None) -> dict | None:
    """The ``monitor`` section of a launcher-written config.json when some sink in it is enabled."""
    if not config_path:
        return None
    try:
        section = json.loads(Path(config_path).read_text()).get("monitor") or {}
    except (OSError, ValueError, AttributeError):
        return None
    enabled = isinstance(section, dict) and any(
        isinstance(part, dict) and part.get("enabled") for part in section.values())
    return section if enabled else None
