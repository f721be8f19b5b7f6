"""pytest tests/e2e/test_figures_agree.py — one run's figures read the same in the dashboard, the summary and the report.

Two CPU ranks train the example GPT (nano, stage 3) for 12 steps under the real launcher; the
script prints the loss all-reduced over the ranks, as examples/train_gpt.py does. Then, for
that one run:
- loss: the status line and the summary label theirs "mean of ranks" and it is the loss the
  script printed; each rank's own loss is labelled "own" (the dashboard's column, the report's);
- communication share: the time a step waited for collectives over the step's time (Note [comm
  share] in zerorun/telemetry/recorder.py), at most 100%, and the same in all three;
- samples/s per rank and for the job: the same in all three, to 2%.
Before, the table's "comm 89-92%" counted overlapped time, the summary's per-rank samples/s
(23.2) was the last ten steps' and the report's (19.0) the run's, and the loss had no label.
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
STEPS = 12
SCRIPT = f"""
import sys, torch, torch.distributed as dist, zerorun
sys.path.insert(0, sys.argv[1])
from gpt import GPT, PRESETS
torch.manual_seed(0)
model = GPT(PRESETS["nano"])
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {{"zero": {{"stage": 3}}}})
data = torch.Generator().manual_seed(engine.rank)
for step in range({STEPS}):
    tokens = torch.randint(0, 128, (4, 33), generator=data)
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if engine.rank == 0:
        print(f"step {{step + 1}} loss {{mean.item() / dist.get_world_size():.6f}}", flush=True)
"""
NUMBER = r"([0-9.]+)"


def zerorun(args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def close(a: float, b: float, tolerance: float = 0.02) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def test_loss_comm_share_and_samples_per_second_agree_across_dashboard_summary_and_report(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    out = zerorun(["--nproc", "2", "--no-dashboard", "--run-dir", "run", "job.py", str(REPO / "examples")], tmp_path)
    printed = float(re.findall(rf"\[rank0\] step {STEPS} loss {NUMBER}", out)[-1])

    # The dashboard's figures: its plain form, the last status line (the same snapshot as the
    # live table's last frame).
    status = [line for line in out.splitlines() if line.startswith("[zerorun] ")][-1]
    head, *ranks = status.split(" | ")
    dashboard = {
        "job": float(re.search(rf"{NUMBER} samples/s", head).group(1)),
        "loss": float(re.search(rf"loss {NUMBER} \(mean of ranks\)", head).group(1)),
        "comm": [int(re.search(r"comm (\d+)%", item).group(1)) for item in ranks],
    }
    assert all("own loss" in item for item in ranks)

    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines()
            if re.match(r"│\s+\d+ │", line)]
    summary = {
        "job": float(re.search(rf"job throughput: {NUMBER} samples/s over the run", out).group(1)),
        "loss": float(re.search(rf"last step {STEPS}: loss {NUMBER} \(mean of ranks\)", out).group(1)),
        "comm": [int(next(c for c in row if c.endswith("%"))[:-1]) for row in rows],
        "rates": [float(row[-1]) for row in rows],
    }

    text = zerorun(["report", "run", "--format", "terminal"], tmp_path)
    table = [line.split() for line in text.splitlines() if re.match(r"\s+\d+\s+localhost\s", line)]
    report = {
        "job": float(re.search(rf"job throughput: {NUMBER} samples/s over the run", text).group(1)),
        "loss": float(re.search(rf"last step {STEPS}: loss {NUMBER} \(mean of ranks\)", text).group(1)),
        "comm": [int(row[4].rstrip("%")) for row in table],
        "rates": [float(row[5]) for row in table],
    }
    print("script", printed, "dashboard", dashboard, "summary", summary, "report", report)

    assert len(summary["comm"]) == len(report["comm"]) == len(dashboard["comm"]) == 2
    for shares in (dashboard["comm"], summary["comm"], report["comm"]):
        assert all(0 <= share <= 100 for share in shares)
    assert dashboard["comm"] == summary["comm"] == report["comm"]
    assert close(dashboard["job"], summary["job"]) and close(summary["job"], report["job"])
    assert all(close(a, b) for a, b in zip(summary["rates"], report["rates"], strict=True))
    assert close(sum(summary["rates"]), summary["job"])
    for shown in (dashboard["loss"], summary["loss"], report["loss"]):
        assert close(shown, printed, 1e-3)  # four significant digits of the same mean
