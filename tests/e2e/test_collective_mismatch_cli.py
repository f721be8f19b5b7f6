"""pytest tests/e2e/test_collective_mismatch_cli.py — a collective mismatch under the real launcher.

Two CPU ranks at stage 3 (every module its own unit) train a step, then run an eval loop with
one batch more on rank 1, then train on. Before the descriptor check (Note [collective
agreement] in zerorun/zero/comm/agreement.py) rank 0's next training forward paired with rank
1's extra eval forward and both trained on with wrong values. Now the job ends with exit 1
within seconds of the divergence, and the launcher's closing lines give the mismatch as the
root cause: each rank's collective, and the fix (``engine.join()``).
"""

from __future__ import annotations

import time

import pytest
from launch_helpers import job_processes, run_cli

pytestmark = pytest.mark.slow

SCRIPT = r'''
import os, time, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            {"zero": {"stage": 3, "allgather_bucket_size": 1}})
def train():
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    print("rank", engine.rank, "loss", loss.item(), flush=True)
train()
if engine.rank == 0:
    with open(os.path.join(os.environ["ZERORUN_RUN_DIR"], "diverged_at"), "w") as f:
        f.write(repr(time.time()))
with torch.no_grad():
    for _ in range(2 + engine.rank):  # rank 1 has one eval batch more
        engine(torch.randn(4, 8))
for _ in range(3):
    train()
print("rank", engine.rank, "finished", flush=True)
'''


def test_a_mismatch_ends_the_job_with_its_cause_as_the_closing_line(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    done = run_cli(["--nproc", "2", "--no-dashboard", "--hang-timeout", "300", "--run-dir", str(run_dir), "job.py"],
                   tmp_path, timeout=600)
    ended = time.time()
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 1, output
    took = ended - float((run_dir / "diverged_at").read_text())
    print(f"the job ended {took:.1f} s after the ranks diverged")
    assert took < 30, output  # the launcher's teardown included
    closing = done.stderr.strip().splitlines()[-1]
    assert closing.startswith("zerorun: error: rank "), output
    assert "failed: exit code 1: collective mismatch" in closing, output
    assert "rank 0: all_gather of unit " in closing and "in eval" in closing and "in forward" in closing, output
    assert "engine.join()" in done.stderr, output  # the hint, in the root cause's panel
    assert "finished" not in output
    for rank in (0, 1):  # one training step each, none after the divergence
        assert (run_dir / "logs" / f"rank{rank}.log").read_text().count(" loss ") == 1
    assert not job_processes(run_dir)
