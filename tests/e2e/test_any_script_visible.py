"""pytest tests/e2e/test_any_script_visible.py — a plain torch DDP script that never calls
``zerorun.initialize``, under ``zerorun --nproc 2``, is visible (Note [any script is visible] in
zerorun/worker/boot/sitecustomize.py).

The status lines (the dashboard's plain form) and the summary show both ranks' memory and the
elapsed time instead of ``starting`` and ``-``; ``zerorun report`` exits 0 on its run directory
and its table has both ranks' peak memory. A subprocess the script starts stays silent (the
recorder is the worker's alone), and the script's own sitecustomize still runs.
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
SCRIPT = """
import subprocess, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import sitecustomize
print("user sitecustomize", getattr(sitecustomize, "USERS", False), flush=True)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(12):
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.1)
# A child Python inherits the environment but must not report as this rank.
subprocess.run([sys.executable, "-c", "import time; time.sleep(0.2)"], check=True)
dist.destroy_process_group()
"""


def zerorun(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    # The user's own sitecustomize, later on the path: still imported.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(cwd / "site")])
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)


def test_a_plain_ddp_script_shows_both_ranks_memory_and_report_works(tmp_path):
    (tmp_path / "ddp.py").write_text(SCRIPT)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("USERS = True\n")
    done = zerorun(["--nproc", "2", "--no-dashboard", "--run-dir", "run", "ddp.py"], tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("user sitecustomize True") == 2
    status = [line for line in done.stdout.splitlines() if line.startswith("[zerorun] ")]
    assert status and re.search(r"r0 mem [0-9.]+ MiB \| r1 mem [0-9.]+ MiB", status[-1]), status
    assert "starting" not in status[-1] and "never" not in status[-1]
    rows = [line for line in done.stdout.splitlines() if re.match(r"│\s+[01] │", line)]
    assert len(rows) == 2 and all(re.search(r"rss [0-9.]+ MiB", row) for row in rows), rows
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert records.count('"kind":"hello"') == 2  # the workers only, not their child processes
    report = subprocess.run([sys.executable, "-m", "zerorun", "report", "run", "--format", "terminal"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    table = [line for line in report.stdout.splitlines() if re.match(r"\s+[01]\s+\S+\s+0\s+[0-9.]+", line)]
    assert len(table) == 2, report.stdout
