"""pytest tests/e2e/test_demo_script.py — the demo training script runs plainly and learns.

The README's first command runs examples/train_gpt.py through the launcher (the launcher's own
e2e tests cover that path); here the same script runs as a plain process (world size 1), as a
user would try it first, with a config file naming stage 3 and activation checkpointing of its blocks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_trains_as_a_plain_process_and_loss_falls(tmp_path):
    config = tmp_path / "zero3.yaml"
    config.write_text(
        "zero:\n  stage: 3\n  param_persistence_threshold: 0\n"
        "activation_checkpointing:\n  enabled: true\n  modules: [Block]\n"
    )
    steps = 12
    completed = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--steps", str(steps), "--preset", "nano",
         "--config", str(config)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    step_lines = re.findall(r"^step +(\d+)/(\d+) +loss (\d+\.\d+)$", completed.stdout, re.MULTILINE)
    assert [int(s) for s, _, _ in step_lines] == list(range(1, steps + 1))
    done = re.search(r"done: loss (\d+\.\d+) -> (\d+\.\d+)", completed.stdout)
    assert done, completed.stdout
    first, last = map(float, done.groups())
    assert last < first - 0.5, f"the synthetic pattern is learnable; loss only went {first} -> {last}"
    assert "world size 1" in completed.stdout
    assert "activation checkpointing: 2 modules (blocks.0, blocks.1)" in completed.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_readme_main_command_does_not_warn_about_itself(tmp_path):
    """zero3.yaml sets lr 0.01 and train_gpt.py's AdamW had 3e-3: rank 0 warned that the config's
    lr was ignored, on the README's own first command. The script now steps with the config's lr."""
    completed = subprocess.run(
        [sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--run-dir", str(tmp_path / "run"),
         "--config", "zerorun/templates/zero3.yaml", "examples/train_gpt.py", "--steps", "2", "--preset", "nano"],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-3000:]
    assert "done: loss" in output
    assert "Warning" not in output and "ignored" not in output, output[-3000:]
