"""Collecting config problems so that one ConfigError can list every one of them.

Validation never stops at the first bad key: a user about to start a 64-GPU job wants the whole
list at once. Each problem carries the key path as the user wrote it (a DeepSpeed path when the
file was DeepSpeed JSON), the offending value, and what to do instead.
"""

from __future__ import annotations

import itertools

import difflib
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable

from zerorun.errors import ConfigError

_MISSING = object()


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    value: Any = _MISSING

    def render(self) -> str:
        where = self.path or "(top level)"
        if self.value is _MISSING:
            return f"{where}: {self.message}"
        return f"{where} = {show(self.value)}: {self.message}"


@dataclass
class Problems:
    """An ordered, de-duplicated list of problems; ``raise_if_any`` turns them into a ConfigError."""

    items: list[Problem] = field(default_factory=list)

    def add(self, path: str, message: str, value: Any = _MISSING) -> None:
        problem = Problem(path, message, value)
        if problem not in self.items:
            self.items.append(problem)

    def extend(self, other: Problems) -> None:
        for problem in other.items:
            if problem not in self.items:
                self.items.append(problem)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, source: str) -> None:
        if not self.items:
            return
        raise ConfigError(
            render_summary(source, self.items),
            hint="every problem is listed above with its key path; docs/config.md lists every key",
        )


def render_summary(source: str, items: list[Problem]) -> str:
    count = len(items)
    if count == 1:  # one problem is one line
        return f"invalid config {source}: {items[0].render()}"
    noun = "problem" if count == 1 else "problems"
    lines = [f"invalid config {source}: {count} {noun}"]
    lines += [f"  - {problem.render()}" for problem in items]
    return "\n".join(lines)


def show(value: Any, limit: int = 60) -> str:
    """A short, unambiguous rendering of a user value (YAML null shown as null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(_head(value, limit))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _head(value: Any, limit: int, budget: list[int] | None = None) -> Any:
    """``value`` cut to about ``limit`` leaves, before anything is rendered: a huge (or
    alias-expanded) list or mapping is never turned into text whole."""
    budget = [limit] if budget is None else budget
    if isinstance(value, (list, tuple, dict)):
        items = itertools.islice(value.items() if isinstance(value, dict) else value, limit)
        kept = []
        for item in items:
            if budget[0] <= 0:
                break
            budget[0] -= 1
            kept.append((item[0], _head(item[1], limit, budget)) if isinstance(value, dict) else _head(item, limit, budget))
        return dict(kept) if isinstance(value, dict) else type(value)(kept)
    if isinstance(value, str):
        return value[: limit + 1]
    return value


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'stage'?)`` when a choice is close to ``word``, else an empty string."""
    if not isinstance(word, str):
        return ""
    choices = list(choices)
    lowered = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def unknown_key_message(key: Any, choices: Iterable[str], kind: str = "key") -> str:
    choices = sorted(choices)
    hint = did_you_mean(key, choices)
    if hint:
        return f"unknown {kind}{hint}"
    if len(choices) > 15:
        return f"unknown {kind}; docs/config.md lists the valid ones"
    return f"unknown {kind}; valid keys here: " + ", ".join(choices)


def join_path(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)
