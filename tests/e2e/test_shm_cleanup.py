"""pytest tests/e2e/test_shm_cleanup.py — /dev/shm holds nothing of a job after any ending.

Two CPU ranks of the real CLI train a tiny stage-2 model, whose gradient reduce-scatter opens
the host channel (comm/host_channel.py). The job ends early in three ways: rank 1 raises before
the group's first reduce-scatter, rank 1 is SIGKILLed there, or the launcher itself is
SIGKILLed while rank 0 waits in it. Before, the surviving rank's 2 MiB outbox and FIFO
stayed in /dev/shm; now none is made before every rank is there, every error path unlinks, and
the agent (or its guardian) removes what a killed worker's pid names (Note [shm cleanup]).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from launch_helpers import assert_no_job_processes, channel_files, channel_files_of, run_cli, start_cli, wait_for_files

pytestmark = pytest.mark.slow

SCRIPT = r'''
import os, signal, sys, time, torch, zerorun
rank, run_dir = int(os.environ["RANK"]), os.environ["ZERORUN_RUN_DIR"]
with open(os.path.join(run_dir, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {"stage": 2}})
if rank == 1:
    open(os.path.join(run_dir, "at_first_collective"), "w").close()
    time.sleep(1.0)
    if sys.argv[1] == "raise":
        raise ValueError("bad batch before the first step")
    if sys.argv[1] == "kill_rank":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)
engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
engine.step()
'''


@pytest.mark.parametrize("ending", ["raise", "kill_rank", pytest.param("kill_launcher", marks=pytest.mark.long)])
def test_dev_shm_holds_nothing_of_a_job_after_it_ends(tmp_path, ending):
    (tmp_path / "job.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    before = channel_files()
    args = ["--nproc", "2", "--no-dashboard", "--hang-timeout", "300", "--run-dir", str(run_dir), "job.py", ending]
    if ending == "kill_launcher":
        launcher = start_cli(args, tmp_path)
        try:
            wait_for_files([run_dir / "at_first_collective", run_dir / "pid0"], timeout=300, proc=launcher)
            time.sleep(2.0)  # rank 0 is waiting for rank 1 in its first reduce-scatter
            os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: its agent and workers live on
            launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    else:
        done = run_cli(args, tmp_path, timeout=300)
        assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert "rank 1" in last, last
    pids = [int((run_dir / f"pid{rank}").read_text()) for rank in (0, 1)]
    assert_no_job_processes(run_dir, pids, within_s=120)
    assert channel_files_of(channel_files() - before, pids) == []
