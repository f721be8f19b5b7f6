"""pytest tests/unit/test_host_channel.py — the pure parts of comm/host_channel.py.

The transport itself runs between processes: tests/distributed/test_cpu_collectives.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from zerorun.errors import RuntimeConfigError
from zerorun.zero.comm.host_channel import _proc_start_time, channel_wanted


@pytest.mark.parametrize(("value", "wanted"), [(None, True), ("1", True), (" 0 ", False)])
def test_the_channel_is_on_unless_the_environment_says_0(value, wanted):
    assert channel_wanted({} if value is None else {"ZERORUN_HOST_CHANNEL": value}) is wanted


def test_any_other_setting_is_a_one_line_error():
    with pytest.raises(RuntimeConfigError, match="ZERORUN_HOST_CHANNEL is 'off'"):
        channel_wanted({"ZERORUN_HOST_CHANNEL": "off"})


def test_a_process_is_told_from_one_that_has_exited():
    assert _proc_start_time(os.getpid()) is not None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _proc_state(child.pid) != "Z" and time.monotonic() < deadline:  # exited, not yet reaped
        time.sleep(0.01)
    assert _proc_state(child.pid) == "Z"
    assert _proc_start_time(child.pid) is None
    child.wait()
    assert _proc_start_time(child.pid) is None  # reaped: no /proc entry at all


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
