"""``load_config``: any config source -> one validated ZerorunConfig, or one ConfigError.

The chain: source -> plain dict (DeepSpeed keys translated) -> environment overrides -> command
line overrides -> typed build -> ranges, combinations, torch names -> batch rule. Problems from
every step are collected and raised together, each under the key path the user wrote.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from zerorun.config import build as typed
from zerorun.config import deepspeed, rules, sources, torch_signatures
from zerorun.config.problems import Problem, Problems
from zerorun.config.schema import ZerorunConfig
from zerorun.errors import ConfigError

# Sections that exist only in the zerorun format; next to DeepSpeed keys they mean a mixed file.
ZERORUN_ONLY_KEYS = frozenset({"zero", "precision", "batch", "telemetry", "monitor", "seed"})


def load_config(
    source: Any = None,
    *,
    world_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    torch_in_child: bool = False,
    hosts: Sequence[int] | None = None,
) -> ZerorunConfig:
    """Load, translate, override and validate a config; raise ConfigError listing every problem.

    source: None (defaults) | path to .yaml/.yml/.json | dict | ZerorunConfig; zerorun or
        DeepSpeed format, told apart by the keys.
    world_size: when given, the batch sizes are derived / checked against it.
    hosts: each rank's host index, when known (the launcher's plan, the worker's host map):
        hpZ's partition size is checked against it (rules.check_hpz).
    overrides: dotted key path -> value, from command-line flags (highest precedence).
    environ: where ZERORUN_<SECTION>__<KEY> variables are read; os.environ by default, {} to
        ignore the environment (a config the launcher already resolved). A ZerorunConfig source
        is already resolved, so by default the environment is not applied to it again.
    torch_in_child: unless torch is already imported here, check optimizer/scheduler names and
        keywords against a table instead of torch (the launcher: it never needs torch itself;
        the workers check the values, Note [no torch in the launcher] in torch_signatures.py).
    """
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)
                                   or world_size < 1):
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    if environ is None:
        environ = {} if isinstance(source, ZerorunConfig) else os.environ
    label, data, notes = _read_source(source)
    try:
        return _load(label, data, notes, world_size, overrides or {}, environ, torch_in_child, hosts)
    except RecursionError:
        raise ConfigError(f"invalid config {label}: nested too deeply to be a config") from None


def to_dict(config: ZerorunConfig) -> dict:
    """A plain dict of every key (YAML/JSON-ready) that load_config reads back to an equal config."""
    return typed.to_dict(config)


def _read_source(source: Any) -> tuple[str, Any, list[str]]:
    if source is None:
        return "(defaults)", {}, []
    if isinstance(source, ZerorunConfig):
        return "(ZerorunConfig object)", to_dict(source), list(source.notes)
    if isinstance(source, dict):
        return "(dict)", source, []
    if isinstance(source, (str, Path)):
        data = sources.read_file(source)
        empty = [f"config file {str(source)!r} is empty: the defaults apply"] if isinstance(data, sources.EmptyConfig) else []
        return repr(str(source)), data, empty
    raise ConfigError(f"a config must be a file path, a dict or a ZerorunConfig, not {type(source).__name__}")


def _load(label: str, data: Any, notes: list[str], world_size: int | None,
          overrides: Mapping[str, Any], environ: Mapping[str, str], torch_in_child: bool = False,
          hosts: Sequence[int] | None = None) -> ZerorunConfig:
    problems = Problems()
    aliases: dict[str, str] = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {label}: the top level must be a mapping of keys to values")
    if deepspeed.looks_like_deepspeed(data):
        for key in sorted(ZERORUN_ONLY_KEYS.intersection(data)):
            problems.add(key, "is a zerorun key in a DeepSpeed config; write the whole file in one "
                         "format (see docs/config.md for the mapping)")
        translation = deepspeed.translate({k: v for k, v in data.items() if k not in ZERORUN_ONLY_KEYS})
        problems.extend(translation.problems)
        notes = notes + translation.notes
        aliases = translation.aliases
        data = translation.data

    known_paths = typed.field_paths(ZerorunConfig)
    env_values = sources.env_overrides(environ, known_paths, problems)
    data = sources.apply_overrides(data, env_values, known_paths, "environment", problems)
    data = sources.apply_overrides(data, overrides, known_paths, "override", problems)
    for path in set(env_values) | set(overrides):
        aliases.pop(path, None)  # an overridden value is no longer the file's

    type_problems = Problems()
    config = typed.build(ZerorunConfig, data, "", type_problems)
    problems.extend(type_problems)
    # A badly typed value was replaced by its default, which is in range: ranges can run anyway.
    rules.check_ranges(config, problems)
    # Combinations would judge the stand-in default of a badly typed value: they wait for a clean
    # file. An unknown key stands in for nothing (its value is simply not used), so the rest is
    # judged now and every problem comes in one round.
    if not [p for p in type_problems.items if not p.message.startswith("unknown key")]:
        rules.check_combinations(config, problems)
        if torch_in_child and "torch" not in sys.modules:
            torch_signatures.check_names(config, problems)  # Note [no torch in the launcher]
        else:
            rules.check_torch_names(config, problems)
        rules.check_hpz(config.zero.hpz_partition_size, world_size, hosts, problems)
        if not any(p.path.startswith("batch.") for p in problems.items):
            config.batch = rules.resolve_batch(config.batch, world_size, problems)
    problems.items = [_as_written(problem, aliases) for problem in problems.items]
    problems.raise_if_any(label)
    checkpointing = config.activation_checkpointing
    if checkpointing.modules and not checkpointing.enabled:
        unused = (f"activation_checkpointing.modules lists {', '.join(checkpointing.modules)} but "
                  "activation_checkpointing.enabled is false: nothing is recomputed; set enabled: true")
        notes = notes + [unused] if unused not in notes else notes  # a config loaded again keeps its notes
    config.notes = notes
    return config


def _as_written(problem: Problem, aliases: dict[str, str]) -> Problem:
    """Name a problem by the DeepSpeed key the user wrote, with the zerorun key beside it."""
    ds_path = aliases.get(problem.path)
    if ds_path is None or ds_path == problem.path:
        return problem
    return Problem(f"{ds_path} (zerorun key {problem.path})", problem.message, problem.value)
