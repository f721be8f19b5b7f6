"""Parsing and printing the quantities a user types: parameter counts and memory sizes.

Pure functions. Counts use decimal suffixes (K, M, B, T = 1e3 .. 1e12), as model names do
("7B", "1.3b", "350M"). Memory sizes accept decimal units (KB, MB, GB, TB) and binary ones
(KiB, MiB, GiB, TiB); a bare number is decimal GB, the unit every table of ours prints.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from zerorun.errors import PlannerError

_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER_AND_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

GB = 10**9


def parse_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000, ``"1.3b"`` -> 1_300_000_000, ``"350M"``, ``"124439808"``, ``"7e9"``."""
    digits, suffix = _split(text, what="parameter count", example="7B, 1.3B, 350M or 124439808")
    if suffix not in _COUNT_SUFFIXES:
        raise PlannerError(
            f"unknown suffix {suffix!r} in parameter count {text!r}",
            hint="use K, M, B or T (thousands .. trillions), e.g. 7B or 350M",
        )
    # Decimal arithmetic: "8720.7T" must be exactly 8_720_700_000_000_000 (a float is off by one).
    count = int((Decimal(digits) * _COUNT_SUFFIXES[suffix]).to_integral_value())
    if count <= 0:
        raise PlannerError(f"parameter count {text!r} must be positive")
    return count


def parse_bytes(text: str) -> int:
    """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 * 2**30, ``"24"`` -> 24e9 (a bare number is decimal GB)."""
    digits, unit = _split(text, what="memory size", example="80GB, 80GiB or 512GB")
    if unit == "":
        unit = "gb"
    if unit not in _BYTE_UNITS:
        raise PlannerError(
            f"unknown unit {unit!r} in memory size {text!r}",
            hint="use GB/TB (decimal) or GiB/TiB (binary), e.g. 80GB",
        )
    size = round(float(digits) * _BYTE_UNITS[unit])
    if size <= 0:
        raise PlannerError(f"memory size {text!r} must be positive")
    return size


def _split(text: str, *, what: str, example: str) -> tuple[str, str]:
    """The number's digits (as written) and the lower-cased unit; rejects overflowing numbers."""
    match = _NUMBER_AND_UNIT.match(str(text))
    if match is None or not math.isfinite(float(match.group(1))):
        raise PlannerError(f"cannot read {what} {text!r}", hint=f"write it like {example}")
    return match.group(1), match.group(2).lower()


def format_count(count: int) -> str:
    """124439808 -> "124.4M", 6738415616 -> "6.74B": short, for table titles."""
    for threshold, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if count >= threshold:
            value = count / threshold
            digits = 2 if value < 10 else 1
            return f"{value:.{digits}f}".rstrip("0").rstrip(".") + suffix
    return str(count)


def format_gb(nbytes: float, unit: int = GB) -> str:
    """Decimal gigabytes (or ``unit``) with two decimals: 26.25e9 -> "26.25"; the unit goes in the header."""
    return f"{nbytes / unit:.2f}"


MB = 10**6


def table_unit(largest_bytes: float) -> tuple[int, str]:
    """GB for real models; MB when every figure is below 1 GB, so small models stay readable."""
    return (GB, "GB") if largest_bytes >= GB else (MB, "MB")
