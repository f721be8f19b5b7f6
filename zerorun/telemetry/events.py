"""The telemetry wire format: one JSON object per line, worker -> launcher.

Every message carries the envelope
    {"v": 1, "token": <run token>, "rank": int, "host": str, "kind": str, "t": float, ...}
and one of these kinds (fields beyond the envelope):

    hello    pid, world_size, device ("cpu" | "cuda:N"), host_total_bytes, device_total_bytes
    sample   mem: {rss, rss_peak, pinned, cuda_allocated, cuda_reserved, cuda_peak} (bytes,
             a key absent when unknown), comm: {op: [count, bytes, seconds]} since the last
             sample, comm_seconds_total (wall seconds with some collective in flight, see Note
             [comm share] in recorder.py), entered_seq (highest collective seq started, -1 none),
             blocked: null | {seq, op, for_s} (the collective this rank is waiting in now),
             sent: optional [within, between], bytes this rank has sent since it started to ranks
             of its own host and to other hosts (Note [bytes per link] in recorder.py),
             breakdown: optional dict from engine.memory_breakdown(),
             activity: optional {what: str, bytes: int}, long work that is neither a step nor
             a collective ("saving": bytes of the checkpoint written so far); progress while
             ``bytes`` grows (Note [saving is progress] in recorder.py)
    step     step, step_time_s, and optionally loss, loss_scale, lr, samples, tokens, total_steps,
             waited_s (seconds of the step the training thread was blocked on collectives: the
             comm share is waited_s / step_time_s, Note [comm share] in recorder.py),
             sent_within, sent_between (bytes this rank sent since the previous step, within its
             host and to other hosts: Note [bytes per link] in recorder.py)
             (``t`` is when the step ended; steps are written in a burst before each sample)
    monitor  monitor: the ``monitor`` config section ({tensorboard, csv, wandb}: each a mapping
             of strings, booleans and nulls), sent once by rank 0's engine when the script
             gave ``initialize`` its own config (telemetry/monitor.py, Note [one writer])
    bye      sent at interpreter exit, after the last sample

Both sides import this module: ``encode`` on the worker, ``validate`` in the collector.
Validation is by hand on purpose: it is small, has no dependency, and every rule is visible.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

VERSION = 1
# The collector drops any line longer than this; the worker keeps its messages well below it.
MAX_LINE_BYTES = 64 * 1024

KINDS = ("hello", "sample", "step", "monitor", "bye")

_MEM_KEYS = ("rss", "rss_peak", "pinned", "cuda_allocated", "cuda_reserved", "cuda_peak")
_STEP_OPTIONAL = ("loss", "loss_scale", "lr", "samples", "tokens", "total_steps", "waited_s")
_STEP_COUNTS = ("sent_within", "sent_between")  # optional, non-negative integers


class SchemaError(ValueError):
    """A message that parsed as JSON but does not follow this schema (internal: never shown to users)."""


def encode(message: dict) -> bytes:
    """One message as one newline-terminated JSON line (NaN/inf become null: JSON has no such values)."""
    return (json.dumps(_finite(message), separators=(",", ":")) + "\n").encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def validate(message: Any, world_size: int) -> None:
    """Raise SchemaError unless ``message`` is a well-formed message from a rank of this job."""
    if not isinstance(message, dict):
        raise SchemaError("not an object")
    if message.get("v") != VERSION:
        raise SchemaError(f"unsupported version {message.get('v')!r}")
    rank = message.get("rank")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise SchemaError(f"rank {rank!r} outside 0..{world_size - 1}")
    if not isinstance(message.get("host"), str):
        raise SchemaError("host is not a string")
    if not _is_number(message.get("t")):
        raise SchemaError("t is not a number")
    kind = message.get("kind")
    if kind not in KINDS:
        raise SchemaError(f"unknown kind {kind!r}")
    _CHECKS[kind](message)


def _check_hello(m: dict) -> None:
    _require_int(m, "pid")
    _require_int(m, "world_size")
    if not isinstance(m.get("device"), str):
        raise SchemaError("device is not a string")
    for key in ("host_total_bytes", "device_total_bytes"):
        _optional_number(m, key)


def _check_sample(m: dict) -> None:
    mem = m.get("mem")
    if not isinstance(mem, dict):
        raise SchemaError("mem is not an object")
    for key, value in mem.items():
        if key not in _MEM_KEYS or not _is_number(value):
            raise SchemaError(f"bad mem entry {key!r}")
    comm = m.get("comm")
    if not isinstance(comm, dict):
        raise SchemaError("comm is not an object")
    for op, triple in comm.items():
        if not isinstance(op, str) or not isinstance(triple, list) or len(triple) != 3:
            raise SchemaError(f"bad comm entry {op!r}")
        if not all(_is_number(x) and x >= 0 for x in triple):
            raise SchemaError(f"bad comm numbers for {op!r}")
    _require_number(m, "comm_seconds_total")
    _require_int(m, "entered_seq")
    blocked = m.get("blocked")
    if blocked is not None:
        if not isinstance(blocked, dict) or not _is_int(blocked.get("seq")):
            raise SchemaError("bad blocked")
        if not isinstance(blocked.get("op"), str) or not _is_number(blocked.get("for_s")):
            raise SchemaError("bad blocked")
    sent = m.get("sent")
    if sent is not None and not (isinstance(sent, list) and len(sent) == 2 and all(_is_count(x) for x in sent)):
        raise SchemaError("bad sent")
    breakdown = m.get("breakdown")
    if breakdown is not None and not isinstance(breakdown, dict):
        raise SchemaError("breakdown is not an object")
    activity = m.get("activity")
    if activity is not None:
        if not isinstance(activity, dict) or not isinstance(activity.get("what"), str) or len(activity["what"]) > 32:
            raise SchemaError("bad activity")
        _require_int(activity, "bytes")


def _check_step(m: dict) -> None:
    _require_int(m, "step")
    _require_number(m, "step_time_s")
    for key in _STEP_OPTIONAL:
        _optional_number(m, key)
    for key in _STEP_COUNTS:
        if m.get(key) is not None and not _is_count(m[key]):
            raise SchemaError(f"{key} is not a byte count")


def _check_bye(m: dict) -> None:
    pass


MONITOR_SECTIONS = {"tensorboard": ("enabled", "output_path", "job_name"), "csv": ("enabled", "output_path", "job_name"),
                    "wandb": ("enabled", "project", "group", "team")}


def _check_monitor(m: dict) -> None:
    section = m.get("monitor")
    if not isinstance(section, dict) or not set(section) <= set(MONITOR_SECTIONS):
        raise SchemaError("bad monitor")
    for name, part in section.items():
        if not isinstance(part, dict) or not set(part) <= set(MONITOR_SECTIONS[name]):
            raise SchemaError(f"bad monitor.{name}")
        for value in part.values():
            if not (value is None or isinstance(value, bool) or (isinstance(value, str) and len(value) <= 4096)):
                raise SchemaError(f"bad monitor.{name} value")


_CHECKS = {"hello": _check_hello, "sample": _check_sample, "step": _check_step, "monitor": _check_monitor,
           "bye": _check_bye}


# JSON integers are unbounded; anything past 64 bits is not a real count, step or byte size
# (and would not even convert to float), so it is rejected rather than computed with.
_INT_LIMIT = 1 << 63


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and -_INT_LIMIT < value < _INT_LIMIT


def _is_count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value)


def _require_int(m: dict, key: str) -> None:
    if not _is_int(m.get(key)):
        raise SchemaError(f"{key} is not an integer")


def _require_number(m: dict, key: str) -> None:
    if not _is_number(m.get(key)):
        raise SchemaError(f"{key} is not a number")


def _optional_number(m: dict, key: str) -> None:
    if m.get(key) is not None and not _is_number(m[key]):
        raise SchemaError(f"{key} is not a number")
