"""pytest tests/distributed/test_parity_scratch.py — two parity runs at once on one machine keep
their NVMe files apart (Note [parity scratch] in zero_parity_harness.py).

The NVMe cases used one fixed folder under the temp directory for every run: a developer's
run beside CI's (or two worktrees') wrote there at once, and the first to end removed the
folder under the other. Each run now gets a folder of its own from ``tempfile.mkdtemp``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# One "test run": the NVMe case's config (the path its files go to), told to the test, then
# held open until the test says so; with --train, that case trained and checked as well.
RUN = """
import sys
sys.path.insert(0, {here!r})
import zero_parity_harness as h
case = next(c for c in h.offload_cases() if c.name == "s2-adamw-fp32+nvme")
print(case.config()["zero"]["offload_optimizer"]["nvme_path"], flush=True)
if "--train" in sys.argv:
    got, want = h.train_engine(case, 0, 1), h.train_reference(case)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
    assert worst <= 1e-5, worst
    h.clear_scratch()  # what test_zero_parity does after each world
    print("trained", worst, flush=True)
sys.stdin.readline()
"""


def start_run(*extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "ZERORUN_TEST_PARITY_SCRATCH"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-c", RUN.format(here=str(HERE)), *extra], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(run: subprocess.Popen) -> str:
    out, err = run.communicate("\n", timeout=600)
    assert run.returncode == 0, err[-3000:]
    return out


@pytest.mark.timeout(300)
def test_two_runs_at_once_get_their_own_scratch_and_each_removes_its_own():
    runs = [start_run(), start_run()]
    try:
        paths = [run.stdout.readline().strip() for run in runs]
        assert paths[0] and paths[1] and paths[0] != paths[1], paths
        assert all(Path(p).is_dir() for p in paths), paths  # made before a case writes
    finally:
        for run in runs:
            finish(run)
    assert not any(Path(p).exists() for p in paths), paths  # each run's exit removed its own


def test_an_explicit_nvme_path_is_kept():
    sys.path.insert(0, str(HERE))
    import zero_parity_harness as h

    case = h.Case("x", 2, extra={"zero": {"offload_optimizer": {**h.NVME, "nvme_path": "/somewhere"}}})
    assert case.config()["zero"]["offload_optimizer"]["nvme_path"] == "/somewhere"


@pytest.mark.long
@pytest.mark.timeout(900)
def test_two_nvme_parity_runs_at_once_both_pass():
    """The NVMe case trained by two runs at the same time, each to the single-process
    reference's losses (1e-5 relative), each clearing its scratch as test_zero_parity does."""
    runs = [start_run("--train"), start_run("--train")]
    outs = [finish(run) for run in runs]
    assert all("trained" in out for out in outs), outs
