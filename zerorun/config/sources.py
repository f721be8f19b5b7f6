"""Where config values come from: files, environment variables, command-line overrides.

Precedence: command-line flags > environment > file > defaults. Files may be zerorun YAML or
DeepSpeed JSON (either extension; the keys decide). Environment variables name a key path in
upper case with ``__`` between levels after the ``ZERORUN_`` prefix:

    ZERORUN_ZERO__STAGE=3   ZERORUN_ZERO__OFFLOAD_OPTIMIZER__DEVICE=cpu   ZERORUN_SEED=1

Other ZERORUN_ variables (ZERORUN_DEBUG, the launcher's own) have no ``__`` and are not config.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from zerorun.config.problems import Problems, did_you_mean, show
from zerorun.errors import ConfigError

ENV_PREFIX = "ZERORUN_"
ENV_SEPARATOR = "__"
# Top-level keys with a single-word env name (no "__" needed to reach them).
ENV_TOP_LEVEL = {"ZERORUN_SEED": "seed", "ZERORUN_GRADIENT_CLIPPING": "gradient_clipping"}
SUFFIXES = (".yaml", ".yml", ".json")
# The file a script run by hand reads (``zerorun init`` writes it); the launcher without --config
# reads the same one from its working directory, so both runs train with one config.
DEFAULT_CONFIG_NAME = "zerorun.yaml"
MAX_FILE_BYTES = 1 << 20  # a config is a few KB; anything larger is surely the wrong file
# Note [bounded YAML]: YAML aliases let 400 bytes stand for 10^8 values (each level of a
# "billion laughs" file repeats the previous one ten times). Parsing builds them shared and
# cheap; everything after (override copies, error messages) would expand them. The loader
# therefore counts the values a document stands for, aliases expanded, before building any.
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 64


def launcher_config_file(given: str | None, cwd: str, script: str | None = None) -> tuple[str | None, str | None]:
    """(the config file the launcher reads, a note saying where it came from) (pure but for
    ``isfile``). --config wins; without it, ``zerorun.yaml`` in the working directory, which is
    what the init template's ``python train.py`` reads, else the one beside the script (``zerorun
    init DIR`` writes both there, and ``zerorun --nproc 2 DIR/train.py`` is run from elsewhere);
    else none (defaults)."""
    import os

    if given:
        return os.path.join(cwd, given), None
    here = os.path.join(cwd, DEFAULT_CONFIG_NAME)
    if os.path.isfile(here):
        return here, f"using config {here} (no --config given: the {DEFAULT_CONFIG_NAME} of the working directory)"
    if script:
        beside = os.path.join(os.path.dirname(os.path.join(cwd, script)), DEFAULT_CONFIG_NAME)
        if os.path.isfile(beside):
            return beside, f"using config {beside} (no --config given: the {DEFAULT_CONFIG_NAME} beside the script)"
    return None, None


def read_small_file(path: str | Path, what: str, error=ConfigError, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes; one-line ``error`` otherwise.

    Opened first and checked on the open file (no race with a swap), read with a bound: a
    FIFO, ``/dev/zero`` or a symlink to either is refused without reading a byte of it.
    """
    import os
    import stat

    name = str(path)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{what} {name!r} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {name!r} is a directory, not a file") from None
    except OSError as err:
        raise error(f"cannot read {what} {name!r}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"{what} {name!r} is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {name!r} is not a regular file (a device, pipe or socket)")
        if info.st_size > limit:
            raise error(f"{what} {name!r} is larger than {limit >> 10} KiB; is it the right file?")
        with os.fdopen(fd, "rb", closefd=False) as stream:
            data = stream.read(limit + 1)
    except OSError as err:
        raise error(f"cannot read {what} {name!r}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > limit:  # grew since fstat (a file still being written)
        raise error(f"{what} {name!r} is larger than {limit >> 10} KiB; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"cannot read {what} {name!r}: not UTF-8 text (byte {err.start})") from None


def read_file(path: str | Path) -> dict:
    """Parse a config file into a dict; every failure is a one-line ConfigError."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"config file {str(path)!r} must end in .yaml, .yml or .json",
                          hint="zerorun reads zerorun YAML and DeepSpeed JSON configs")
    text = read_small_file(path, "config file")
    return parse_text(text, str(path), json_syntax=path.suffix.lower() == ".json")


def _bounded_yaml(text: str, name: str):
    """``yaml.safe_load`` that refuses documents standing for too many values (Note [bounded YAML])."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_size(node, name)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_yaml_size(root, name: str) -> None:
    """Count the values ``root`` expands to, each shared (aliased) node counted per use."""
    import yaml

    sizes: dict[int, int] = {}
    # Iterative post-order walk: (node, depth, children done?)
    stack = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if id(node) in sizes:
            continue
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"config file {name!r} is nested more than {MAX_YAML_DEPTH} levels deep; "
                              "a config is a few levels")
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
            _check_unique_keys(node, name)
        else:
            sizes[id(node)] = 1
            continue
        if done:
            total = 1 + sum(sizes.get(id(child), 1) for child in children)
            if total > MAX_YAML_VALUES:
                raise ConfigError(f"config file {name!r} stands for more than {MAX_YAML_VALUES:,} values "
                                  "once its aliases (*name) are expanded; a config is a few dozen",
                                  hint="is it the right file? YAML anchors (&name) and aliases (*name) "
                                       "repeat whole sections")
            sizes[id(node)] = total
        else:
            stack.append((node, depth, True))
            stack.extend((child, depth + 1, False) for child in children if id(child) not in sizes)


class EmptyConfig(dict):
    """What an empty config file (or one of comments only) reads as: no keys, so the defaults;
    load_config notes it, since a file that sets nothing is rarely the file meant."""


def _check_unique_keys(node, name: str) -> None:
    """A key written twice in one mapping: PyYAML keeps the last one without a word, so the
    first (often the one the user edited) would silently not count."""
    import yaml

    seen: dict = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode):
            if key.value in seen:
                raise ConfigError(f"config file {name!r}: key {key.value!r} appears twice in one mapping (lines "
                                  f"{seen[key.value] + 1} and {key.start_mark.line + 1}); only one of them can count")
            seen[key.value] = key.start_mark.line


def _unique_pairs(name: str):
    """json.loads' object_pairs_hook refusing a key written twice (json keeps the last silently)."""
    def pairs(items: list) -> dict:
        result: dict = {}
        for key, value in items:
            if key in result:
                raise ConfigError(f"config file {name!r}: key {key!r} appears twice in one object; "
                                  "only one of them can count")
            result[key] = value
        return result
    return pairs


def parse_text(text: str, name: str, *, json_syntax: bool) -> dict:
    import json

    import yaml

    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs(name)) if json_syntax else _bounded_yaml(text, name)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {name!r} is not valid JSON: {err.msg} at line {err.lineno} "
                          f"column {err.colno}") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where is not None else ""
        what = getattr(err, "problem", None) or "syntax error"
        raise ConfigError(f"config file {name!r} is not valid YAML: {what}{at}") from None
    except (RecursionError, ValueError, OverflowError) as err:
        raise ConfigError(f"config file {name!r} cannot be parsed: {type(err).__name__}") from None
    if data is None:  # an empty file (or only comments): the defaults, said once (load_config's note)
        return EmptyConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name!r} must hold a mapping of keys to values at the top, "
                          f"not {show(data)}")
    return data


def env_overrides(environ: Mapping[str, str], known_paths: Mapping[str, Any], problems: Problems) -> dict[str, Any]:
    """Dotted key path -> value for every config variable in ``environ``.

    ``known_paths`` maps each leaf key path to its type hint, so that text keys keep the text
    as written (ZERORUN_CHECKPOINT__DIR=2024 is a directory name, not a number).
    """
    overrides: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if name in ENV_TOP_LEVEL:
            path = ENV_TOP_LEVEL[name]
        elif name.startswith(ENV_PREFIX) and ENV_SEPARATOR in name[len(ENV_PREFIX):]:
            path = ".".join(name[len(ENV_PREFIX):].lower().split(ENV_SEPARATOR))
        else:
            continue
        if not _reachable(path, known_paths):
            problems.add(f"environment {name}", "names no config key" + did_you_mean(
                path, known_paths) + "; the form is ZERORUN_<SECTION>__<KEY>, e.g. ZERORUN_ZERO__STAGE")
            continue
        overrides[path] = _text_value(raw) if _is_text(known_paths.get(path)) else parse_scalar(raw)
    return overrides


def _is_text(hint: Any) -> bool:
    """``str`` or ``str | None`` (not list[str], whose text is YAML to parse)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return str in typing.get_args(hint)
    return hint is str


def _text_value(raw: str) -> str | None:
    return None if raw.strip() in ("null", "~") else raw


def parse_assignments(items: list[str], known_paths: Mapping[str, Any]) -> dict[str, Any]:
    """``["zero.stage=3", "precision.dtype=bf16"]`` (e.g. repeated ``--set`` flags) -> overrides.

    Values are read like environment values; unknown keys are reported by load_config.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise ConfigError(f"cannot read the setting {item!r}: write KEY=VALUE, e.g. zero.stage=3")
        path = path.strip()
        overrides[path] = _text_value(raw) if _is_text(known_paths.get(path)) else parse_scalar(raw)
    return overrides


def config_env_names(environ: Mapping[str, str]) -> list[str]:
    """Names of the variables env_overrides would read (for a launcher that resolves them once)."""
    return sorted(
        name for name in environ
        if name in ENV_TOP_LEVEL
        or (name.startswith(ENV_PREFIX) and ENV_SEPARATOR in name[len(ENV_PREFIX):])
    )


def parse_scalar(raw: str) -> Any:
    """An environment string read as YAML: "3" -> 3, "true" -> True, "null" -> None, "[a]" -> ["a"].

    Numbers PyYAML leaves as text ("3e-4": YAML 1.1 wants a dot) become numbers too, since a
    free-form value such as optimizer.params.lr is handed to torch as it is.
    """
    try:
        value = _bounded_yaml(raw, "(value)")
    except ConfigError:
        raise ConfigError(f"the value {raw[:40]!r}... stands for too many values once its YAML aliases "
                          "are expanded") from None
    except Exception:  # not YAML: the text itself (a path, a name)
        return raw
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value  # "nan", "inf": text, which a numeric key then rejects by name
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    return value if value is None or isinstance(value, (bool, int, float, list, dict)) else raw


def apply_overrides(data: dict, overrides: Mapping[str, Any], known_paths: Mapping[str, Any],
                    origin: str, problems: Problems) -> dict:
    """A copy of ``data`` with each dotted path set; free-form params accept any sub-key."""
    result = _deep_copy(data)
    for path, value in overrides.items():
        if not isinstance(path, str) or not _reachable(path, known_paths):
            problems.add(f"{origin} {path}", "names no config key" + did_you_mean(path, known_paths))
            continue
        target = result
        parts = path.split(".")
        for part in parts[:-1]:
            child = target.get(part)
            if not isinstance(child, dict):
                # a section set to null or a scalar in the file: the override replaces it
                child = {}
                target[part] = child
            target = child
        target[parts[-1]] = value
    return result


def _reachable(path: str, known_paths: Mapping[str, Any]) -> bool:
    """A leaf key path, a section path, or a key inside a free-form ``params`` mapping."""
    if path in known_paths:
        return True
    if any(known.startswith(path + ".") for known in known_paths):
        return True
    return any(path.startswith(known + ".") and known.endswith(".params") for known in known_paths)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value

