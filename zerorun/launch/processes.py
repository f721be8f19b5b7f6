"""Small process helpers: describe exit codes, end process groups (TERM, grace, KILL)."""

from __future__ import annotations

import os
import signal
import time


# What a signal usually means for a training worker, where the name alone says little.
SIGNAL_CAUSES = {
    # A read of a memory-mapped page whose file was cut short: zerorun maps NVMe-offloaded
    # parameter chunks (offload/nvme.py, Note [host shards]) and safetensors files.
    signal.SIGBUS: "a memory-mapped file it was reading was truncated or removed, such as an NVMe offload file",
}


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (Popen reports a signal as a negative code)."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"signal {-returncode}"
        cause = SIGNAL_CAUSES.get(sig)
        return f"signal {sig.name}" + (f" ({cause})" if cause else "")
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


def sweep_run(token: str, wait_s: float) -> dict:
    """Find this run's processes on this host (by the token in their environment) and end them.

    Runs in the launcher for its own host and, shipped as source over ssh (stdlib only, so it
    imports inside), on a host whose agent was lost. Waits up to ``wait_s`` for what is found to
    go by itself (the agent's guardian is ending it), then KILLs the rest. Every worker carries
    ZERORUN_RUN_TOKEN in its environment and so do its children, so this finds exactly the
    job's processes, even one that left its process group. Returns {"found", "left"} counts.
    """
    import os
    import signal
    import time

    needle = ("ZERORUN_RUN_TOKEN=" + token).encode()

    def ours() -> list[int]:
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(name))
            except OSError:
                continue
        return pids

    if not token or not os.path.isdir("/proc"):
        return {"found": 0, "left": 0}
    found = ours()
    deadline = time.monotonic() + wait_s
    live = found
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = ours()
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    while live and time.monotonic() < deadline:
        time.sleep(0.05)
        live = ours()
    return {"found": len(found), "left": len(live)}
