"""pytest tests/unit/test_early_signals.py — signals before the launcher supervises: remembered, not fatal.

Note [signals from the first instant] in zerorun/launch/early_signals.py. In-process: the
handlers are installed, a real signal is raised at this process, and it must be recorded (not
kill the test run); ``release`` gives the previous handlers back. The launcher's use of the
record (nothing starts after a stopping signal) is tested end to end in
tests/e2e/test_early_signals_cli.py.
"""

from __future__ import annotations

import signal

import pytest

from zerorun.cli.main import launches
from zerorun.launch import early_signals


def test_a_signal_before_the_launcher_is_recorded_and_the_old_handler_comes_back():
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, _frame: seen.append(signum))
    try:
        early_signals.install()
        signal.raise_signal(signal.SIGUSR1)  # the default action would end this process
        signal.raise_signal(signal.SIGTERM)
        assert early_signals.take() == [signal.SIGUSR1, signal.SIGTERM]
        assert early_signals.take() == []
        signal.raise_signal(signal.SIGUSR2)
        early_signals.release(raise_pending=False)  # after a launch: dropped, not raised again
        assert seen == []
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # our earlier handler is back
    finally:
        early_signals.release(raise_pending=False)
        signal.signal(signal.SIGUSR1, before)


def test_release_for_a_command_that_launches_nothing_raises_the_signal_again():
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda signum, _frame: seen.append(signum))
    try:
        early_signals.install()
        signal.raise_signal(signal.SIGUSR2)
        assert seen == []
        early_signals.release(raise_pending=True)
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)


@pytest.mark.parametrize("taken, save_on_signal, stops", [
    ([], False, None),
    ([signal.SIGUSR1], True, None),  # a checkpoint request: saved at the first step instead
    ([signal.SIGUSR1], False, signal.SIGUSR1),  # without on_signal USR1 stops like TERM
    ([signal.SIGUSR2, signal.SIGTERM], True, signal.SIGTERM),
    ([signal.SIGHUP], True, signal.SIGHUP),
])
def test_which_early_signal_stops_the_job_before_it_starts(taken, save_on_signal, stops):
    assert early_signals.first_stop(taken, save_on_signal) == stops


@pytest.mark.parametrize("routed, starts", [
    (["run", "--nproc", "2", "--", "train.py"], True),
    (["run", "--nproc", "2", "--dry-run", "--", "train.py"], False),
    (["run", "--", "train.py", "--dry-run"], True),  # the script's own flag
    (["estimate", "--params", "7B"], False),
    (["init"], False),
])
def test_only_a_real_launch_keeps_the_early_handlers(routed, starts):
    assert launches(routed) is starts

