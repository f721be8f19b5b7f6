"""pytest tests/e2e/test_restarts.py — ``zerorun --max-restarts 2``: a worker killed at step 12
(checkpoints every 5) restarts the job once, from the step-10 checkpoint, and the job ends at
its 20 steps with the losses of steps 11-20 equal to an uninterrupted run's.

The demo (examples/train_gpt.py, nano GPT, stage 2, 2 CPU ranks) resumes on the batches the
uninterrupted run takes from the checkpoint's step; rank 1 leaves with exit code 1 right after
step 12 in the first attempt only (ZERORUN_RESTART_COUNT = 0). Losses compared as the script
prints them (4 decimals): a resume is exact (docs/checkpoints.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "examples" / "train_gpt.py")
CONFIG = "zero: {stage: 2}\nbatch: {micro_batch_size: 4}\ncheckpoint: {dir: ckpt, interval_steps: 5}\n"
FAILING = """
import os, runpy, sys
if os.environ.get("ZERORUN_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    from zerorun.zero import engine as engine_module
    step = engine_module.Engine.step

    def step_then_fail(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if self.global_step == 12:
            os._exit(1)  # a worker lost after step 12, its checkpoint of step 10 complete
        return out

    engine_module.Engine.step = step_then_fail
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def zerorun(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--config", "job.yaml",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=800,
                          stdin=subprocess.DEVNULL)


def losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"\[rank0\] step +(\d+)/20 +loss ([0-9.]+)", out)}


@pytest.mark.timeout(900)
def test_a_worker_killed_at_step_12_restarts_once_and_steps_11_to_20_equal_an_uninterrupted_run(tmp_path):
    whole, restarted = tmp_path / "whole", tmp_path / "restarted"
    for folder in (whole, restarted):
        folder.mkdir()
        (folder / "job.yaml").write_text(CONFIG)
        (folder / "job.py").write_text(FAILING)
    plain = zerorun(["job.py", DEMO, "--preset", "nano", "--steps", "20"], whole)
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = zerorun(["--max-restarts", "2", "job.py", DEMO, "--preset", "nano", "--steps", "20"], restarted)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert out.count("zerorun: restart ") == 1
    assert re.search(r"zerorun: restart 1 of 2 in 1 s, from the last complete checkpoint, after rank 1 on host "
                     r"\S+ failed: exit code 1", out), out[-3000:]
    assert "resuming at step 10 of 20" in out
    assert re.search(r"zerorun: the job finished; 1 restart of --max-restarts 2; restart 1 after rank 1 on host", out)
    first, second = done.stdout.split("resuming at step 10 of 20", 1)  # worker lines are on stdout
    assert max(losses(first)) >= 12  # the first attempt reached step 12
    expected = losses(plain.stdout)
    assert sorted(losses(second)) == list(range(11, 21))
    assert {step: losses(second)[step] for step in range(11, 21)} == {step: expected[step] for step in range(11, 21)}
    assert (restarted / "zerorun-runs").exists() and list(restarted.glob("zerorun-runs/*/restart-1/logs"))
