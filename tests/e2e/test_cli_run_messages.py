"""pytest tests/e2e/test_cli_run_messages.py — a successful run names its run directory, start and end.

A real ``zerorun`` subprocess with one worker that does not import torch (fast).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import run_cli

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_run_directory_is_printed_at_start_and_end(tmp_path):
    (tmp_path / "hello.py").write_text("print('hello from the worker', flush=True)\n")
    run_dir = tmp_path / "the-run"
    done = run_cli(["--nproc", "1", "--no-dashboard", "--run-dir", str(run_dir), "hello.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "run directory" in line]
    assert len(lines) == 2, done.stderr
    assert lines[0] == f"zerorun: run directory {run_dir}"
    assert lines[1] == f"zerorun: run directory {run_dir} (zerorun report {run_dir})"


def test_numpy_is_a_dependency_so_torch_does_not_warn():
    """torch prints 'Failed to initialize NumPy' at import when numpy is missing (once per process)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("numpy") for dep in project["dependencies"])


def test_launcher_itself_stays_quiet_without_numpy(tmp_path):
    """The launcher imports torch (env, GPU count, config checks) but never needs numpy."""
    code = "import sys; sys.modules['numpy'] = None; from zerorun.cli.main import main; main(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, "env", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "Failed to initialize NumPy" not in done.stderr


SCRIPT_CONFIG = r'''
import torch, zerorun
model = torch.nn.Linear(7, 3)
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                            {"zero": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
engine.backward(engine(torch.randn(2, 7)).sum()); engine.step()
print(f"rank {engine.rank} stage {engine.stage}", flush=True)
'''


def test_script_config_and_optimizer_overrides_warn_once_through_the_launcher(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT_CONFIG)
    (tmp_path / "z3.yaml").write_text("zero:\n  stage: 3\n")
    done = run_cli(["--nproc", "2", "--no-dashboard", "--config", "z3.yaml", "job.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "rank 0 stage 1" in out and "rank 1 stage 1" in out
    assert out.count("replaces the launcher's --config") == 1  # rank 0 only
    assert "zero.stage: script 1, --config 3" in out
    assert out.count("optimizer.params.lr = 0.01 in the config is ignored") == 1
    assert "lr = 0.0003" in out


def test_env_and_version_as_real_subprocesses(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "zerorun", "env", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["torch"] and facts["gloo"] is True and "matplotlib" in facts["extras"]
    assert facts["host_memory_bytes"] > 0
    assert "Failed to initialize NumPy" not in done.stderr
