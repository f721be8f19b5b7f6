"""Small process helpers: describe exit codes, end process groups (TERM, grace, KILL)."""

from __future__ import annotations

import os
import signal
import time


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (Popen reports a signal as a negative code)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    # A shell reports a signal-killed child as 128+N.
    if returncode > 128 and returncode - 128 in signal.Signals._value2member_map_:
        return f"exit code {returncode} (signal {signal.Signals(returncode - 128).name})"
    return f"exit code {returncode}"


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def group_alive(pgid: int) -> bool:
    return signal_group(pgid, 0)


def end_groups(pgids: list[int], grace_s: float) -> None:
    """TERM every group, wait up to ``grace_s`` for all to go, then KILL what is left.

    Whole groups, never name patterns: each worker was started in its own session, so its
    pgid is its pid and covers every child it forked (data loaders, compile workers).
    """
    live = [pgid for pgid in pgids if signal_group(pgid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = [pgid for pgid in live if group_alive(pgid)]
    for pgid in live:
        signal_group(pgid, signal.SIGKILL)
