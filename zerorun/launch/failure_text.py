"""The root cause as the launcher shows it: the failure panel's text (host, rank, exit, the
last log lines, the traceback, or every rank's stack after a hang), and the last traceback
found in a rank's log. Pure.

    pytest tests/unit/test_commands.py
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from zerorun.launch import watchdog

if TYPE_CHECKING:
    from zerorun.launch.supervisor import Failure

SHOWN_LOG_LINES = 10

# torch.distributed prefixes a worker's uncaught-exception lines with "[rankN]: ".
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def extract_traceback(lines: list[str]) -> list[str]:
    """The last Python traceback in ``lines`` (through its final exception line), or []."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return []
    block = lines[starts[-1]:]
    # The traceback ends at the first unindented line after its header (the exception).
    for offset, line in enumerate(block[1:], start=1):
        if line and not line.startswith((" ", "\t")):
            return block[: offset + 1]
    return block


SHOWN_FRAMES = 8


def format_failure(failure: Failure) -> str:
    """The root-cause panel text: host, rank, exit, last log lines, traceback or stacks."""
    who = f"rank {failure.rank} on host {failure.host}" if failure.rank is not None else f"host {failure.host}"
    lines = [f"first failure: {who}: {failure.reason}"]
    if failure.stacks:
        lines.append("Python stacks when the job was ended (innermost call first):")
        for rank, stack in sorted(failure.stacks.items()):
            at = watchdog.stuck_at(stack)
            state = watchdog.describe_activity(stack)
            lines.append(f"  rank {rank}: {state}; at {at}" if at else f"  rank {rank}: no stack")
            frames = [frame for frame in stack if not frame.file.startswith("<frozen")]
            lines += [f"  |   {frame}" for frame in frames[:SHOWN_FRAMES]]
        return "\n".join(lines)
    traceback = failure.traceback
    # Lines already shown in the traceback section are not repeated above it.
    shown = [
        line for line in failure.log_tail[-SHOWN_LOG_LINES:] if _RANK_PREFIX.sub("", line) not in traceback
    ]
    if shown:
        lines.append("last lines of its log:")
        lines += [f"  | {line}" for line in shown]
    if traceback:
        lines.append("traceback:")
        lines += [f"  | {line}" for line in traceback]
    return "\n".join(lines)
