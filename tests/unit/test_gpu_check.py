"""pytest tests/unit/test_gpu_check.py — scripts/gpu_check.sh and its table, on a machine without a GPU.

The GPU run itself is scripts/gpu_check.sh on a lent GPU; here: its dry run lists the steps, a
bad argument is one line, the cuda tier is all skipped with a reason (none failing), and the
report turns each step's results into one table that fails where a step failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_report  # noqa: E402


def run(*args, **kwargs):
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


def test_list_names_the_tier_the_benchmark_and_the_report(tmp_path):
    done = run("--list", "--out", str(tmp_path / "results"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "PYTHONPATH=" in lines[0] and len(lines) == 4
    assert "-m pytest -m cuda tests/cuda" in lines[1] and f"--junitxml={tmp_path}/results/cuda.xml" in lines[1]
    assert "scripts/bench_gpu.py" in lines[2] and "--json" in lines[2] and "--dry-run" not in lines[2]
    assert f"scripts/gpu_report.py {tmp_path}/results" in lines[3]
    assert sum(int(line.split("[limit ")[1].split(" s]")[0]) for line in lines[1:]) <= 480  # 8 minutes
    assert not (tmp_path / "results").exists()  # a listing writes nothing


def test_a_bad_argument_is_one_line():
    done = run("--fast")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "--dry-run" in done.stderr


def test_without_a_python_that_has_torch_it_says_so_in_one_line(tmp_path):
    done = run("--dry-run", "--out", str(tmp_path), env={**os.environ, "PYTHON": "/bin/false"})
    assert done.returncode == 2 and "no Python with torch" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the tier runs instead (gpu_check.sh)")
def test_without_cuda_the_cuda_tier_is_all_skipped_with_a_reason(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "tests/cuda", "-q", "-rs", "-p",
                           "no:cacheprovider", f"--junitxml={tmp_path / 'cuda.xml'}"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:]
    rows = gpu_report.test_rows(tmp_path / "cuda.xml")
    skipped = sum(int(r[2].split()[0]) for r in rows)
    assert skipped >= 15 and all(r[1] == "skipped" and r[2].endswith("skipped") for r in rows), rows
    assert "needs a CUDA device" in done.stdout


def test_the_report_is_one_table_that_fails_where_a_step_failed(tmp_path, capsys):
    (tmp_path / "cuda.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.cuda.test_cuda_parity" name="test_parity_on_one_gpu[s0-fp32-none]"/>'
        '<testcase classname="tests.cuda.test_cuda_findings" name="test_x"><failure message="boom"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "memory.json").write_text(json.dumps({"zero3": {"peak": 3 << 30}, "fsdp2": {"peak": 2 << 30},
                                                      "ratio": 1.5, "bound": 1.25}))
    ok = {"status": "ok", "params": 1_261_529_088, "tokens_per_step": 16384, "host_peak_gib": 2.0}
    (tmp_path / "bench.json").write_text(json.dumps({"options": {"preset": "1.2b"}, "results": [
        {**ok, "system": "fsdp2", "step_s": 0.5, "gpu_peak_gib": 20.0, "gpu_reserved_gib": 24.0},
        {**ok, "system": "zero3", "step_s": 0.45, "gpu_peak_gib": 25.0, "gpu_reserved_gib": 26.4},
        {**ok, "system": "zero2+cpu", "step_s": 0.6, "gpu_peak_gib": 9.0, "gpu_reserved_gib": 10.0},
        {**ok, "system": "ds2+cpu", "step_s": 1.2, "gpu_peak_gib": 9.5, "gpu_reserved_gib": 11.0},
        {"system": "ds3", "status": "not installed", "error": "DeepSpeed is not installed"},
        {"system": "zero2", "status": "failed", "error": "CUDA out of memory"}]}))
    assert gpu_report.main([str(tmp_path)]) == 1
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| check | result | figures |"
    assert any("parity" in line and "| pass |" in line for line in table)
    assert any("findings" in line and "| FAIL |" in line for line in table)
    assert any("failed tests" in line and "test_x" in line for line in table)
    assert any("1.50x (3.00 / 2.00 GiB; bound 1.25x)" in line and "FAIL" in line for line in table)
    zero3 = next(line for line in table if line.startswith("| bench zero3 (1.2b)"))
    assert "| ok, over goal: reserved |" in zero3 and "0.450 s/step (0.90x)" in zero3 and "276 TFLOPS" in zero3
    assert "GPU alloc 25.00 GiB (1.25x), reserved 26.40 GiB (1.10x), host 2.00 GiB (1.00x)" in zero3
    assert any(line.startswith("| bench zero2+cpu") and "ok (0.50x DeepSpeed)" in line for line in table)
    assert any("bench ds3" in line and "| not installed |" in line for line in table)
    assert any("bench zero2" in line and "| FAIL | CUDA out of memory" in line for line in table)


def test_the_report_names_what_is_missing(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cuda.xml missing" in out and "memory.json missing" in out and "bench.json missing" in out
