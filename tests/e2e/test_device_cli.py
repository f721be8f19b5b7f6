"""pytest tests/e2e/test_device_cli.py — the device contract: ``--nproc`` workers are CPU workers.

The launcher sets ZERORUN_DEVICE for every worker (Note [device contract] in
zerorun/launch/device.py). Here the ``zerorun init`` training template runs under
``zerorun --nproc 2`` with a tripwire on torch.cuda: neither the template nor the telemetry
recorder may call into CUDA, and CUDA must never be initialised in the worker.
"""

from __future__ import annotations

import pytest
from launch_helpers import REPO, run_cli

pytestmark = pytest.mark.slow

TRIPWIRE = r'''
import os, runpy, sys, traceback
import torch

assert os.environ["ZERORUN_DEVICE"] == "cpu", os.environ.get("ZERORUN_DEVICE")
calls = []

def tripwire(name, real):
    def wrapper(*args, **kwargs):
        calls.append((name, [frame.filename for frame in traceback.extract_stack()[:-1]]))
        return real(*args, **kwargs)
    return wrapper

for name in ("is_available", "device_count", "current_device", "get_device_properties", "set_device",
             "init", "_lazy_init", "memory_allocated", "max_memory_allocated"):
    setattr(torch.cuda, name, tripwire(name, getattr(torch.cuda, name)))

sys.argv = ["train.py", "--steps", "3"]
runpy.run_path(os.environ["TEMPLATE"], run_name="__main__")
from zerorun.telemetry import get_recorder
rec = get_recorder()
assert rec.enabled, "the recorder must be running for this test to mean anything"
rec.send_sample()
ours = [name for name, files in calls
        if any(("zerorun/telemetry/" in f or "zerorun/templates/" in f or "zerorun/launch/" in f) for f in files)]
assert not ours, f"zerorun touched torch.cuda in a CPU worker: {ours}"
assert not torch.cuda.is_initialized()
print("CUDA UNTOUCHED", flush=True)
import zerorun
zerorun.leave_together()
'''


def test_nproc_workers_are_told_cpu_and_never_touch_cuda(tmp_path):
    (tmp_path / "tripwire.py").write_text(TRIPWIRE)
    run_dir = tmp_path / "run"
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "tripwire.py"], tmp_path,
                   timeout=180, env={"TEMPLATE": str(REPO / "zerorun" / "templates" / "train.py")})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "CUDA UNTOUCHED" in log, log[-3000:]
    assert "step 3/3" in (run_dir / "logs" / "rank0.log").read_text()
    hello = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"kind":"hello"' in line]
    assert len(hello) == 2 and all('"device":"cpu"' in line for line in hello)
