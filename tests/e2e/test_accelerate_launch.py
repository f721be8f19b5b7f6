"""pytest -m long tests/e2e/test_accelerate_launch.py — an unchanged Accelerate script started by
``accelerate launch --use_deepspeed --zero_stage 3`` with zerorun's shim on PYTHONPATH, and by
``zerorun --accelerate-config FILE``, against the same script as DDP under torchrun.

The script (tests/data/hf_deepspeed/launch_script.py) names neither zerorun nor DeepSpeed: its
``Accelerator()`` takes DeepSpeed from the launcher's variables. Accelerate's launcher imports
``deepspeed.launcher.runner`` in its own process and starts torchrun's workers; zerorun's launcher
reads what ``accelerate config`` writes and gives its workers the same variables. Both engines are
zerorun's (stage 3, accumulation 2, clipping 0.3, fp32, 2 CPU ranks). Every micro-batch's loss
must equal DDP's within 1e-6 relative (observed: bit-equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "data" / "hf_deepspeed" / "launch_script.py"
BIN = Path(sys.executable).parent
RTOL = 1e-6
# What `accelerate config` writes for DeepSpeed ZeRO-3, two processes, accumulation 2, clipping 0.3.
ACCELERATE_CONFIG = ROOT / "tests" / "data" / "hf_deepspeed" / "accelerate_zero3.yaml"


def _run(workdir: Path, name: str, command: list[str], env: dict) -> tuple[dict, str]:
    out = workdir / name
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("ACCELERATE_", "ZERORUN_"))}
    done = subprocess.run([*command, str(SCRIPT), "--out", str(out)], cwd=workdir, capture_output=True, text=True,
                          timeout=600, env={**clean, "TRANSFORMERS_VERBOSITY": "error", **env})
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads((out / "result.json").read_text()), done.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("accelerate_launch")
    shim = subprocess.run([str(BIN / "zerorun"), "env", "--deepspeed-shim"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    return {
        # DDP: torchrun, with Accelerate told to run on the CPU (accelerate launch --cpu's variable).
        "ddp": _run(workdir, "ddp", [str(BIN / "torchrun"), "--nproc_per_node", "2"],
                    {"PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}),
        "accelerate": _run(workdir, "accelerate", [
            str(BIN / "accelerate"), "launch", "--use_deepspeed", "--zero_stage", "3", "--num_processes", "2",
            "--gradient_accumulation_steps", "2", "--gradient_clipping", "0.3", "--main_process_port", "0"],
            {"PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"}),
        "zerorun": _run(workdir, "zerorun", [str(BIN / "zerorun"), "--no-dashboard", "--accelerate-config",
                                             str(ACCELERATE_CONFIG)], {"PYTHONPATH": str(ROOT)}),
    }


@pytest.mark.slow
@pytest.mark.long  # three 2-rank runs of a tiny GPT-2
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", ["accelerate", "zerorun"])
def test_accelerate_launch_and_zerorun_equal_ddp(runs, name):
    (ours, stderr), (ddp, _) = runs[name], runs["ddp"]
    assert ours["distributed_type"] == "DistributedType.DEEPSPEED" and ours["wrapped"] == "zerorun.zero.engine.Engine"
    assert ddp["distributed_type"] == "DistributedType.MULTI_CPU" and ddp["wrapped"].endswith("DistributedDataParallel")
    assert len(ours["loss"]) == len(ddp["loss"]) == 8  # 16 samples per rank, micro-batches of 2
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(ours["loss"], ddp["loss"], strict=True)), (ours["loss"], ddp["loss"])
    assert len(set(ddp["loss"])) == len(ddp["loss"])  # a different batch each step, not a constant
    if name == "zerorun":
        assert "ACCELERATE_DEEPSPEED_ZERO_STAGE=3" in stderr and "zerorun: run directory" in stderr
