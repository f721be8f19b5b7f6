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
