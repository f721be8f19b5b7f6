"""pytest tests/ — suite-wide settings: a per-test timeout that must exist, and a busy-machine mode.

``pytest --busy 2`` runs the suite with two CPU-burning processes beside it (what a shared CI
machine looks like); they are started before the first test and ended, by pid, after the last.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption("--busy", type=int, default=0, metavar="N",
                     help="run N CPU-burning processes beside the suite (a loaded machine)")


def pytest_configure(config):
    # Multi-process tests rely on pytest-timeout (pyproject: timeout = 300) to end a test that
    # hangs; without it a hang would stall the whole run with no word. Fail at once instead.
    # scripts/gpu_check.sh runs the cuda tier on a GPU machine that may lack the plugin, under
    # its own time limit (ZERORUN_GPU_CHECK_OUT is set there).
    if not config.pluginmanager.hasplugin("timeout") and not os.environ.get("ZERORUN_GPU_CHECK_OUT"):
        raise pytest.UsageError("pytest-timeout is not installed: the suite needs it to end hung tests "
                                "(bash scripts/setup.sh --test installs it)")


@pytest.fixture(scope="session", autouse=True)
def busy_machine(request):
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(request.config.getoption("--busy"))]
    yield len(burners)
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.fixture(autouse=True)
def no_device_bound_yet():
    """Each test starts as a fresh worker: no engine has bound a device (``device.bind``), so a
    test of the environment's device choice never sees another test's engine."""
    from zerorun.worker import device

    device._bound = None
    yield
    device._bound = None
