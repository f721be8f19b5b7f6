"""Plain dict <-> typed config, driven by the dataclass type hints of zerorun.config.schema.

``build`` checks every key and type and records problems instead of raising, substituting the
field's default for a bad value so that checking can go on and report everything in one go.
Range and cross-field rules are not here: they live in rules.py and run on the built object.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import cache
from typing import Any, Literal

from zerorun.config.problems import Problems, did_you_mean, join_path, show, unknown_key_message

INVALID = object()
# Free-form sections (optimizer/scheduler params) are passed to torch as kwargs and written to
# JSON for the workers, so they may hold only JSON-like values, nested at most this deep.
MAX_FREEFORM_DEPTH = 8


@cache
def schema_fields(cls: type) -> tuple[tuple[str, Any, dataclasses.Field], ...]:
    """(name, type hint, field) for every schema field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f)
        for f in dataclasses.fields(cls)
        if f.metadata.get("schema", True)
    )


def field_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every leaf key path of the schema (``zero.offload_param.device``) -> its type hint."""
    paths: dict[str, Any] = {}
    for name, hint, _ in schema_fields(cls):
        path = join_path(prefix, name)
        section = section_class(hint)
        if section is not None:
            paths.update(field_paths(section, path))
        else:
            paths[path] = hint
    return paths


def section_class(hint: Any) -> type | None:
    """The dataclass inside ``X`` or ``X | None``, if the hint names a config section."""
    for candidate in _union_members(hint):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def build(cls: type, data: Any, path: str, problems: Problems) -> Any:
    """Construct ``cls`` from a plain mapping, recording every problem under ``path``."""
    if not isinstance(data, dict):
        problems.add(path, f"must be a mapping of keys to values, got {type_name(data)}", data)
        return cls()
    known = {name: (hint, f) for name, hint, f in schema_fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = join_path(path, key)
        if key not in known:
            problems.add(key_path, unknown_key_message(key, known))
            continue
        converted = convert(value, known[key][0], key_path, problems)
        if converted is not INVALID:
            kwargs[key] = converted
    return cls(**kwargs)


def convert(value: Any, hint: Any, path: str, problems: Problems) -> Any:
    """``value`` as the type ``hint`` asks for, or INVALID after recording why not."""
    members = _union_members(hint)
    if value is None:
        if type(None) in members:
            return None
        problems.add(path, f"must be {describe(hint)}, not null", value)
        return INVALID
    members = [m for m in members if m is not type(None)]
    section = section_class(hint)
    if section is not None:
        return build(section, value, path, problems)
    (kind,) = members  # the schema has no unions other than "X | None"
    result = _convert_one(value, kind)
    if result is INVALID and typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        problems.add(path, f"must be {describe(hint)}{did_you_mean(value, choices)}", value)
    elif result is INVALID and isinstance(value, str) and "\x00" in value and str in members:
        problems.add(path, "must not contain a NUL character (no path or name can)", value)
    elif result is INVALID:
        problems.add(path, f"must be {describe(hint)}, got {type_name(value)}", value)
    elif result is _NOT_JSON:
        problems.add(path, "may hold only strings, finite numbers, booleans, null, lists and mappings "
                     f"(nested at most {MAX_FREEFORM_DEPTH} deep)", value)
        return INVALID
    return result


_NOT_JSON = object()


def _convert_one(value: Any, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        return INVALID
    if kind is bool:
        return value if isinstance(value, bool) else INVALID
    if kind is int:
        number = _number(value)
        if isinstance(number, float) and number.is_integer():
            return int(number) if abs(number) < 2**63 else INVALID
        return number if isinstance(number, int) else INVALID
    if kind is float:
        number = _number(value)
        return INVALID if number is INVALID else float(number)
    if kind is str:
        # A NUL cannot be in a path or a name: every worker would fail on it after start.
        return value if isinstance(value, str) and "\x00" not in value else INVALID
    if origin is list:
        (item_kind,) = typing.get_args(kind)
        if not isinstance(value, list):
            return INVALID
        items = [_convert_one(item, item_kind) for item in value]
        return INVALID if any(item is INVALID for item in items) else items
    if origin is dict:
        if not isinstance(value, dict):
            return INVALID
        return dict(value) if is_plain_data(value) else _NOT_JSON
    raise TypeError(f"config schema uses an unsupported type {kind!r}")  # a bug in schema.py


def _number(value: Any) -> Any:
    """An int/float from a number or a numeric string; finite only.

    Strings are accepted because PyYAML reads ``5e8`` (no dot) as a string, and environment
    variables are always strings; both would otherwise be a baffling error for a plain number.
    """
    if isinstance(value, bool):
        return INVALID
    if isinstance(value, str):
        if not value.isascii():  # float() reads "２" (a full-width digit) as 2: a number is ASCII
            return INVALID
        try:
            value = float(value.strip())
        except ValueError:
            return INVALID
        if math.isfinite(value) and value.is_integer() and abs(value) < 2**63:
            value = int(value)
    if isinstance(value, int):
        # Beyond 64 bits no size or count makes sense, and float() of it would overflow.
        return value if abs(value) < 2**63 else INVALID
    if isinstance(value, float) and math.isfinite(value):
        return value
    return INVALID


def is_plain_data(value: Any, depth: int = 0) -> bool:
    """True for JSON-like data: what to_dict can write and load_config can read back."""
    if depth > MAX_FREEFORM_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(is_plain_data(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_data(v, depth + 1) for k, v in value.items())
    return False


def to_dict(config: Any) -> dict:
    """A plain dict of every schema field (nested sections as dicts), for YAML/JSON."""
    result: dict[str, Any] = {}
    section: type = type(config)
    for name, _, _ in schema_fields(section):
        value = getattr(config, name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, (dict, list)):
            value = _copy_plain(value)
        result[name] = value
    return result


def _copy_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    return value


def describe(hint: Any) -> str:
    """A type hint in the user's words: ``an integer``, ``one of 'fp32', 'bf16', 'fp16'``."""
    members = _union_members(hint)
    optional = type(None) in members
    members = [m for m in members if m is not type(None)]
    words = " or ".join(_describe_one(m) for m in members)
    return f"{words} or null" if optional else words


def _describe_one(kind: Any) -> str:
    if dataclasses.is_dataclass(kind):
        return "a mapping"
    origin = typing.get_origin(kind)
    if origin is Literal:
        return "one of " + ", ".join(show(c) for c in typing.get_args(kind))
    if origin is list:
        return "a list of strings"
    if origin is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    # Never the word the requirement used ("must be an integer, got an integer"): say what is wrong.
    if isinstance(value, int):
        return "an integer" if abs(value) < 2**63 else f"an integer of {len(str(abs(value)))} digits (beyond 64 bits)"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN (not a number)"
        if math.isinf(value):
            return "infinity"
        if value.is_integer():
            return "a number" if abs(value) < 2**63 else f"{value:g}, a number beyond 64-bit integers"
        return "a fractional number"
    if isinstance(value, str):
        if "\x00" in value:
            return "a string containing a NUL character"
        try:
            number = float(value)
        except ValueError:
            return "a string"
        return f"a string standing for {type_name(number)}" if not math.isfinite(number) or abs(number) >= 2**63 else "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _union_members(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return list(typing.get_args(hint))
    return [hint]
