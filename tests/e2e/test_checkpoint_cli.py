"""pytest tests/e2e/test_checkpoint_cli.py — the config's checkpoint section through the real CLI.

``python -m zerorun --nproc 2 --config ckpt.yaml train.py 4`` saves every 2 optimizer steps and
keeps the last 1 (global_step2 is deleted once global_step4 is complete); ``--resume`` then
loads global_step4 on initialize and the script continues from step 4 to 6.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests' / 'distributed')!r})
import checkpoint_harness as h
import zerorun
model = h.build_dropnet()
engine = zerorun.initialize(model, h.optimizer_for(model))
print(f"rank {{engine.rank}} starts at step {{engine.global_step}}", flush=True)
h.run_steps(engine, h.ResumeCase("cli", 2), engine.rank, range(engine.global_step, int(sys.argv[1])))
print(f"rank {{engine.rank}} ends at step {{engine.global_step}}", flush=True)
"""


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--run-dir",
                           str(tmp / "run"), "--config", str(tmp / "ckpt.yaml"), *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_interval_saves_keep_last_and_resume(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    ckpt = tmp_path / "ckpts"
    (tmp_path / "ckpt.yaml").write_text(
        f"zero: {{stage: 2}}\ncheckpoint: {{dir: {ckpt}, interval_steps: 2, keep_last: 1}}\n")
    first = launch(tmp_path, "train.py", "4")
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout + first.stderr
    assert "starts at step 0" in out and "checkpoint global_step4 saved" in out
    assert sorted(p.name for p in ckpt.iterdir()) == [".zerorun-owner", "global_step4", "latest"]
    second = launch(tmp_path, "--resume", "train.py", "6")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    assert "rank 0 starts at step 4" in out and "rank 1 starts at step 4" in out
    assert "resumed from" in out and "rank 1 ends at step 6" in out
    assert sorted(p.name for p in ckpt.iterdir()) == [".zerorun-owner", "global_step6", "latest"]


STEP_SCRIPT = """
import sys, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
while engine.global_step < int(sys.argv[1]):
    data = torch.Generator().manual_seed(1000 * engine.global_step + engine.rank)
    loss = engine(torch.randn(4, 7, generator=data)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    print(f"loss {engine.global_step} {loss.item()!r}", flush=True)
"""


def _losses(tmp: Path) -> dict[int, float]:
    lines = (tmp / "run" / "logs" / "rank0.log").read_text().splitlines()
    return {int(line.split()[1]): float(line.split()[2]) for line in lines if line.startswith("loss ")}


@pytest.mark.long
def test_a_resuming_job_beside_an_empty_latest_resumes_from_the_newest_complete_tag(tmp_path):
    """End to end: a 0-byte ``latest`` beside global_step10 and global_step12
    used to read as "no latest file"; the job trained from step 0 and moved ``latest`` back."""
    solo, job = tmp_path / "solo", tmp_path / "job"
    for where in (solo, job):
        where.mkdir()
        (where / "train.py").write_text(STEP_SCRIPT)
        (where / "ckpt.yaml").write_text(
            f"zero: {{stage: 2}}\ncheckpoint: {{dir: {where / 'ck'}, interval_steps: 2, keep_last: 2}}\n")
    reference = launch(solo, "train.py", "14")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    first = launch(job, "train.py", "12")
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt = job / "ck"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step10", "global_step12"]
    (ckpt / "latest").write_bytes(b"")
    import shutil

    shutil.rmtree(job / "run")  # the rank logs append across launches; read the second launch's alone
    (job / "ckpt.yaml").write_text(
        f"zero: {{stage: 2}}\ncheckpoint: {{dir: {ckpt}, interval_steps: 2, keep_last: 3}}\n")
    second = launch(job, "--resume", "train.py", "14")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out
    log = (job / "run" / "logs" / "rank0.log").read_text()
    note = [line for line in log.splitlines() if "newest complete tag" in line]
    assert len(note) == 1 and note[0].endswith("latest' is empty; loading the newest complete tag 'global_step12' "
                                               "instead"), log[-3000:]
    assert "at step 12" in log and "no latest" not in log
    resumed = _losses(job)
    assert sorted(resumed) == [13, 14]
    expected = _losses(solo)
    assert [resumed[13], resumed[14]] == pytest.approx([expected[13], expected[14]], rel=1e-6, abs=1e-7)
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step10", "global_step12", "global_step14"]
    assert (ckpt / "latest").read_text() == "global_step14"
