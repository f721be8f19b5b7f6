"""pytest tests/e2e/test_config_cli.py — the real CLI checks configs before launch (`zerorun --dry-run --config F`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
ZERORUN = [sys.executable, "-m", "zerorun"]


def zerorun(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    environ.update(env or {})
    return subprocess.run(ZERORUN + args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('never started by --dry-run')\n")
    for name in ("ds_zero2_fp16.json", "ds_zero3_offload_fp16.json"):
        shutil.copy(DATA / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("name", ["ds_zero2_fp16.json", "ds_zero3_offload_fp16.json"])
def test_seed_deepspeed_configs_pass_the_dry_run(workdir, name):
    result = zerorun(["--dry-run", "--nproc", "2", "--config", name, "train.py"], workdir)
    assert result.returncode == 0, result.stderr
    assert "world size 2" in result.stdout
    assert "Traceback" not in result.stderr


def test_misspelt_key_is_rejected_before_launch(workdir):
    config = json.loads((DATA / "ds_zero2_fp16.json").read_text())
    config["zero_optimization"]["stgae"] = config["zero_optimization"].pop("stage")
    (workdir / "typo.json").write_text(json.dumps(config))
    result = zerorun(["--dry-run", "--nproc", "2", "--config", "typo.json", "train.py"], workdir)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("zerorun: error: invalid config '")
    assert lines[0].endswith("typo.json': zero_optimization.stgae: unknown DeepSpeed key (did you mean 'stage'?)")
    assert "Traceback" not in result.stderr
    assert "world size" not in result.stdout  # nothing was planned, let alone started


def test_batch_rule_is_checked_with_the_launch_world_size(workdir):
    result = zerorun(["--dry-run", "--nproc", "3", "--config", "ds_zero2_fp16.json", "train.py"], workdir)
    assert result.returncode == 2
    assert "cannot be split evenly over 3 ranks x 2 accumulation steps" in result.stderr


def test_environment_overrides_reach_validation(workdir):
    result = zerorun(["--dry-run", "--nproc", "2", "--config", "ds_zero2_fp16.json", "train.py"], workdir,
                     env={"ZERORUN_ZERO__STAGE": "9"})
    assert result.returncode == 2
    assert "zero.stage = 9: must be a ZeRO stage: 0, 1, 2 or 3" in result.stderr


def test_init_then_dry_run(tmp_path):
    result = zerorun(["init", "--template", "zero3-offload"], tmp_path)
    assert result.returncode == 0, result.stderr
    result = zerorun(["--dry-run", "--nproc", "2", "--config", "zerorun.yaml", "train.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank 1" in result.stdout
    again = zerorun(["init"], tmp_path)
    assert again.returncode == 2
    assert again.stderr.startswith("zerorun: error: refusing to overwrite ")


def test_without_config_the_launcher_reads_the_zerorun_yaml_a_script_run_by_hand_reads(tmp_path):
    assert zerorun(["init", "--template", "zero3"], tmp_path).returncode == 0
    result = zerorun(["--dry-run", "--nproc", "2", "train.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"zerorun: note: using config {tmp_path / 'zerorun.yaml'} (no --config given" in result.stderr
    assert '"stage": 3' in result.stdout
    # --config still wins, and a directory without zerorun.yaml keeps the defaults, with no note.
    (tmp_path / "other.yaml").write_text("zero:\n  stage: 1\n")
    chosen = zerorun(["--dry-run", "--nproc", "2", "--config", "other.yaml", "train.py"], tmp_path)
    assert '"stage": 1' in chosen.stdout and "using config" not in chosen.stderr
    (tmp_path / "zerorun.yaml").unlink()
    bare = zerorun(["--dry-run", "--nproc", "2", "train.py"], tmp_path)
    assert '"stage": 0' in bare.stdout and "using config" not in bare.stderr


def test_init_template_trains_for_real_on_two_cpu_ranks(tmp_path):
    """The issue's command: no --config in an init directory trains with its zerorun.yaml, says so,
    and nothing in it is overridden (no precedence warning)."""
    assert zerorun(["init", "--template", "zero2"], tmp_path).returncode == 0
    result = zerorun(["--nproc", "2", "--no-dashboard", "train.py", "--steps", "2"], tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "step 2/2  loss" in result.stdout
    assert "using config" in result.stderr and "Warning" not in result.stdout + result.stderr


def test_offload_combinations_that_cannot_work_are_refused_before_anything_starts(workdir):
    (workdir / "blocker").write_text("a file where a directory should be\n")
    cases = [
        (["--set", "zero.stage=2", "--set", "zero.offload_param.device=cpu"], "zero.offload_param.device"),
        (["--set", "zero.stage=3", "--set", "zero.offload_param.device=nvme"], "zero.offload_param.nvme_path"),
        (["--set", "zero.stage=2", "--set", "zero.offload_optimizer.device=nvme"], "zero.offload_optimizer.nvme_path"),
        (["--set", "zero.stage=2", "--set", "zero.offload_optimizer.device=nvme",
          "--set", "zero.offload_optimizer.nvme_path=blocker/sub"], "is not a directory"),
        (["--set", "zero.stage=3", "--set", "zero.offload_param.device=nvme",
          "--set", "zero.offload_param.nvme_path=blocker/sub"], "zero.offload_param.nvme_path: "),
        # A mistyped mount point: creating the whole chain would fill the root disk unseen.
        (["--set", "zero.stage=3", "--set", "zero.offload_param.device=nvme",
          "--set", "zero.offload_param.nvme_path=/does/not/exist/nvme"], "neither does its parent '/does/not/exist'"),
    ]
    for settings, message in cases:
        result = zerorun(["--dry-run", "--nproc", "2", *settings, "train.py"], workdir)
        assert result.returncode == 2, (settings, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr
        assert "world size" not in result.stdout
    ok = zerorun(["--dry-run", "--nproc", "2", "--set", "zero.stage=2", "--set", "zero.offload_optimizer.device=nvme",
                  "--set", "zero.offload_optimizer.nvme_path=nvme", "train.py"], workdir)
    assert ok.returncode == 0, ok.stderr
    # Only the last component is missing: fine, and said once.
    said = [line for line in (ok.stdout + ok.stderr).splitlines() if "does not exist; zerorun creates it" in line]
    assert len(said) == 1 and str(workdir / "nvme") in said[0], ok.stdout + ok.stderr
