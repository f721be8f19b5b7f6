"""pytest -m slurm tests/e2e/test_slurm_node_failure.py (long: not in the default run) — a node fails mid-job.

On the private Slurm cluster (slurm_cluster.py), a 2-node zerorun job trains; then node n2 stops
answering: its slurmd is frozen (SIGSTOP to the pid it wrote), as a hung or unplugged machine
stops answering. After SlurmdTimeout (30 s there) slurmctld marks n2 DOWN (not responding) and ends
the job as NODE_FAIL; batch jobs are requeued by default, so by the time the launcher asks, the
job's record says only "requeued". The launcher must still name the cause, a node failure (Note
[why Slurm sent SIGTERM] in zerorun/launch/slurm.py: a job ended or requeued while one of its
nodes is down), not a preemption or a cancel, and leave no worker behind on either node.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from slurm_cluster import SlurmCluster, slurm_available
from test_slurm_jobs import TRAIN, sbatch, wait_for, zerorun_cmd

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.long]  # a real Slurm


@pytest.fixture
def cluster(tmp_path):
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    started = SlurmCluster(tmp_path / "slurm").start()
    yield started
    started.stop()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(600)
def test_a_node_that_stops_answering_is_named_as_a_node_failure(cluster, tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    job = sbatch(cluster, out, "exec " + zerorun_cmd(str(TRAIN), "100000", str(out), "0.2"), "-N2")
    log = out / f"slurm-{job}.out"
    wait_for(lambda: (out / "losses.json").exists() and len(json.loads((out / "losses.json").read_text())) >= 3,
             180, "three steps")
    workers = [psutil.Process(int((out / f"pid.{rank}").read_text())) for rank in (0, 1)]
    slurmd_n2 = int((cluster.dir / "slurmd-n2.pid").read_text())
    os.kill(slurmd_n2, signal.SIGSTOP)
    try:
        closing = wait_for(lambda: [line for line in log.read_text().splitlines()
                                    if line.startswith("zerorun: ") and "SIGTERM" in line], 240, "the closing line")
        state = cluster.run(["scontrol", "-o", "show", "node", "n2"]).stdout
    finally:
        os.kill(slurmd_n2, signal.SIGCONT)
    assert closing[-1].startswith("zerorun: node failure (SIGTERM)"), (closing, state, log.read_text()[-3000:])
    deadline = time.monotonic() + 60
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(_alive, workers)), "a worker outlived the job"
