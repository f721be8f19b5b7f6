"""Warnings for a config value that silently loses: pure functions from configs to messages.

    pytest tests/unit/test_engine_batches_and_config_precedence.py tests/e2e/test_cli_run_messages.py

Two places where one source beats another without the user seeing it:
* a config given to ``zerorun.initialize(..., config=...)`` in the script replaces the
  launcher's ``--config`` (the script is closer to the code; it wins, but says so);
* ``optimizer.params`` in the config are used only when the script passes no optimizer: a
  script's own optimizer keeps its own learning rate.
The engine warns once each, from rank 0 (see zerorun.zero.engine.initialize).
"""

from __future__ import annotations

from zerorun.config.build import to_dict
from zerorun.config.schema import ZerorunConfig

# The first few differing keys are enough to recognise the clash; the rest would flood the line.
MAX_LISTED = 4
# Read by the launcher alone (its watchdog), never by a worker: --hang-timeout beside a config
# dict in the script is not replaced by it, so no warning may say it is.
LAUNCHER_ONLY = ("telemetry.hang_timeout_s", "telemetry.startup_timeout_s")


class ConfigPrecedenceWarning(UserWarning):
    """A config value that another source overrides."""


def _leaves(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("params",):
            flat.update(_leaves(value, path + "."))
        else:
            flat[path] = value
    return flat


def script_config_message(launcher_label: str, launcher: ZerorunConfig, script_label: str,
                          script: ZerorunConfig, defaults: ZerorunConfig | None = None) -> str | None:
    """The script's config replaces the launcher's: say so, with the values that differ.

    With ``defaults`` (the config nothing was given for), only what the launcher's config sets
    away from them counts: a launcher started without --config/--set holds only defaults, and a
    script's config replacing those replaces nothing the user gave (None: no message)."""
    ours, theirs = _leaves(to_dict(script)), _leaves(to_dict(launcher))
    for path in LAUNCHER_ONLY:  # the script's config cannot replace what only the launcher reads
        ours.pop(path, None)
        theirs.pop(path, None)
    if defaults is not None:
        default = _leaves(to_dict(defaults))
        theirs = {path: value for path, value in theirs.items() if default.get(path) != value}
        if not theirs:
            return None
    differing = [path for path in sorted(set(theirs) if defaults is not None else set(ours) | set(theirs))
                 if ours.get(path) != theirs.get(path)]
    head = (f"the config passed to zerorun.initialize() in the script ({script_label}) replaces the "
            f"launcher's --config (as resolved in {launcher_label})")
    if not differing:
        return None
    listed = ", ".join(f"{path}: script {ours.get(path)!r}, --config {theirs.get(path)!r}"
                       for path in differing[:MAX_LISTED])
    more = f" and {len(differing) - MAX_LISTED} more" if len(differing) > MAX_LISTED else ""
    return f"{head}; differing: {listed}{more}. Pass config=None to use --config"


def optimizer_params_message(config: ZerorunConfig, optimizer) -> str | None:
    """None unless the config sets optimizer.params.lr that the script's own optimizer overrides."""
    if config.optimizer is None or "lr" not in config.optimizer.params:
        return None
    lrs = sorted({group.get("lr") for group in optimizer.param_groups}, key=str)
    if lrs == [config.optimizer.params["lr"]]:
        return None  # built from the config (ZerorunTrainer's optimizer section): nothing lost
    mine = lrs[0] if len(lrs) == 1 else lrs
    return (f"optimizer.params.lr = {config.optimizer.params['lr']!r} in the config is ignored: the script "
            f"passes its own {type(optimizer).__name__}, which steps with lr = {mine!r}. Set the lr on that "
            "optimizer, or pass optimizer=None to build it from the config")


def warn_overridden(cfg: ZerorunConfig, optimizer, script_config, launcher_config: str | None,
                    *, world_size: int | None = None) -> None:
    """Warn (ConfigPrecedenceWarning) when ``script_config`` (the script's, given while the launcher
    named ``launcher_config``) beats values the user gave the launcher (--config, --set, environment),
    and when ``optimizer`` beats optimizer.params.lr. The launcher always resolves a config, so
    one holding only defaults (sized for ``world_size``) means nothing was given: no warning."""
    import os
    import warnings

    from zerorun.config.loader import load_config

    if script_config is not None and launcher_config:
        try:
            launcher_cfg = load_config(launcher_config, environ={})
        except Exception:
            launcher_cfg = None
        if launcher_cfg is not None:
            label = str(script_config) if isinstance(script_config, (str, os.PathLike)) else type(script_config).__name__
            defaults = load_config(None, world_size=world_size, environ={})
            message = script_config_message(launcher_config, launcher_cfg, label, cfg, defaults)
            if message:
                warnings.warn(message, ConfigPrecedenceWarning, stacklevel=4)
    message = optimizer_params_message(cfg, optimizer) if optimizer is not None else None
    if message:
        warnings.warn(message, ConfigPrecedenceWarning, stacklevel=4)
