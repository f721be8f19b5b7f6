"""pytest tests/e2e/test_deepspeed_cifar.py — DeepSpeed's cifar example, import lines changed, on zerorun.

The example (tests/data/deepspeed_cifar/SOURCE.md) runs under ``zerorun --nproc 2`` on the CPU at
stages 0-3 in fp32 and bf16, on synthetic CIFAR-shaped data from a torchvision stand-in put on
PYTHONPATH (no download; torchvision is not installed), and rank 0's loss of every step is
compared with the losses real DeepSpeed 0.19.8 gave for the unchanged example
(ds_losses.json, written by scripts/deepspeed_cifar_parity.py --record): within 1e-4 relative
in fp32. DeepSpeed itself is not needed here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "deepspeed_cifar"
IMPORT_LINE = re.compile(r"^(import \S+( as \S+)?|from \S+ import .+)$")


def _parity_script():
    spec = importlib.util.spec_from_file_location("deepspeed_cifar_parity", ROOT / "scripts" / "deepspeed_cifar_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_port_changes_only_import_lines():
    original = (DATA / "cifar10_deepspeed.py").read_bytes().decode().splitlines()
    ported = (DATA / "cifar10_zerorun.py").read_bytes().decode().splitlines()
    assert len(original) == len(ported)
    changed = [(a, b) for a, b in zip(original, ported, strict=True) if a != b]
    assert [b for _, b in changed] == ["import zerorun.deepspeed as deepspeed",
                                       "from zerorun.deepspeed.accelerator import get_accelerator",
                                       "from zerorun.deepspeed.moe.utils import "
                                       "split_params_into_different_moe_groups_for_optimizer"]
    assert all(IMPORT_LINE.match(a) and "deepspeed" in a for a, _ in changed)


@pytest.mark.slow
@pytest.mark.long  # eight 2-rank runs of the example
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cifar_example_trains_on_zerorun_like_deepspeed(stage, dtype, tmp_path):
    parity = _parity_script()
    recorded = json.loads((DATA / "ds_losses.json").read_text())
    theirs = recorded["losses"][f"{dtype}-stage{stage}"]
    ours, output = parity.run_zerorun(stage, dtype, tmp_path)
    assert len(ours) == recorded["train_size"] // 16 == len(theirs)
    assert all(math.isfinite(loss) for loss in ours)
    assert output.count("Finished Training") == 2 and "Accuracy of the network on the 40 test images" in output
    assert "replaces the launcher's --config" not in output  # no --config was given: nothing replaced
    # Printed losses: the example's own lines, three decimals, every step on rank 0.
    printed = [float(v) for v in re.findall(r"\] loss:\s+([0-9.]+)", output)]
    assert printed == pytest.approx(ours, abs=5.01e-4)  # (2.3125 prints as 2.312)
    tolerance = parity.TOLERANCE if dtype == "fp32" else 2e-2  # bf16: its 8-bit mantissa
    worst = parity.largest_relative_difference(ours, theirs)
    assert worst <= tolerance, f"{dtype} stage {stage}: largest relative difference {worst:.2e}"
