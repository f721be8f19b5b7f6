"""Text from workers made safe for a terminal and for metrics.jsonl (pure).

A worker's output and its telemetry strings (op names, host names, breakdown keys) reach the
launcher's terminal. Escape sequences there can move the cursor, rewrite earlier lines, set
the window title or, on some terminals, answer back into the input: whatever a worker sends is
therefore shown with every control character removed (tab kept). The per-rank log files keep
the bytes exactly as written.
"""

from __future__ import annotations

import re

# ESC [ ... final byte (CSI), ESC ] ... BEL or ESC \ (OSC), and two-byte ESC sequences.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|\x9b[0-?]*[ -/]*[@-~]")
# C0 controls but tab, DEL, C1 controls.
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(text: str, limit: int | None = None) -> str:
    """``text`` without escape sequences or control characters, cut to ``limit`` characters."""
    if limit is not None and len(text) > 4 * limit:
        text = text[: 4 * limit]  # bound the regex work before it starts
    clean = _CONTROLS.sub("", _ESCAPES.sub("", text))
    if limit is not None and len(clean) > limit:
        clean = clean[: limit - 1] + "…"
    return clean


def clean_strings(value):
    """``value`` (parsed JSON) with every string, keys included, made ``printable``."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): clean_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_strings(v) for v in value]
    return value
