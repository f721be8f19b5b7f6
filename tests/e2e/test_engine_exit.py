"""pytest tests/e2e/test_engine_exit.py — how a zerorun.initialize script ends under the launcher.

The engine registers a clean-exit barrier (Note [clean exit] in zerorun/zero/comm/process_group.py).
These tests pin down both sides of it: a clean run exits 0 on every rank, and a rank that dies
of an exception mid-training still ends the whole job quickly instead of waiting at the barrier.
"""

from __future__ import annotations

import time

import pytest
from launch_helpers import job_processes, run_cli

pytestmark = pytest.mark.slow

SCRIPT = r'''
import os, sys, time, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero": {"stage": 2}})
fail_rank = int(sys.argv[1])
for step in range(20):
    if engine.rank == fail_rank and step == 3:
        with open(os.path.join(os.environ["ZERORUN_RUN_DIR"], "failed_at"), "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("deliberate failure on rank %d" % fail_rank)
    x = torch.randn(4, 8)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
print("rank", engine.rank, "finished", flush=True)
'''


def test_clean_run_exits_zero_on_every_rank(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(tmp_path / "run"), "job.py", "-1"], tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"rank {rank} finished" in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()


def test_rank_that_raises_ends_the_job_quickly(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(tmp_path / "run"), "job.py", "1"], tmp_path)
    ended = time.time()
    assert done.returncode == 1, done.stderr
    assert "rank 1" in done.stderr and "deliberate failure on rank 1" in done.stderr
    # Timed from the failure itself, so a slow start on a busy machine does not count; waiting
    # at the exit barrier would take 30 s.
    elapsed = ended - float((tmp_path / "run" / "failed_at").read_text())
    assert elapsed < 15, f"the job took {elapsed:.1f} s to end after the failure"
    assert not job_processes(tmp_path / "run"), "processes of the job are still running"
