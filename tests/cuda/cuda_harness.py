"""Shared pieces of the cuda tier (tests/cuda/): the skip, a small awkward model, the engine loop
and the single-process reference it must match.

    bash scripts/gpu_check.sh        # runs this tier and scripts/bench_gpu.py on a GPU machine

Every test here carries the ``cuda`` marker and is skipped, with the reason, where CUDA is absent.
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
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: this tier runs on a GPU machine (bash scripts/gpu_check.sh)"
MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)]

sys.path.insert(0, str(REPO / "tests" / "distributed"))
# The CPU parity suite's model: odd sizes (padding), a tied embedding, a frozen layer, an unused
# one, a layer called twice; two param groups.
from zero_parity_harness import GLOBAL_BATCH as BATCH  # noqa: E402
from zero_parity_harness import OddNet, build_optimizer, global_batch  # noqa: E402

STEPS = 6
# fp32 on a GPU: the engine reduces and updates in a different order than one process (and
# embedding backward accumulates with atomics), so equal to about 1e-5, not bit for bit.
FP32_TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}
# bf16 against the fp32 reference (loss relative every step, parameters absolute after), as
# tests/distributed/test_zero_parity.py argues: 8 mantissa bits put every matmul off by about
# 2^-9, and Adam turns sign-level gradient noise into steps of up to lr (3e-2), so parameters
# drift a few lr. The tight check is against bf16 stage 0 on the same GPU (BF16_TWIN): the same
# roundings, with the host's update kernels (offload) rounding fp32 differently at most once.
BF16_VS_FP32 = {"loss_rtol": 2e-2, "param_atol": 1e-1}
BF16_TWIN = {"loss_rtol": 2.0**-7, "param_atol": 2e-2}


def build_model(device=None) -> OddNet:
    """The model, seeded; moved to ``device`` when one is named. None builds it where the
    caller's device context says (``with torch.device("meta"):`` for sharded construction: a
    meta tensor cannot be copied anywhere, so it must not be moved)."""
    torch.manual_seed(1234)
    model = OddNet()
    return model if device is None else model.to(device)


def optimizer_for(model):
    return build_optimizer(model, "adamw")


def batch(step: int, device):
    tokens, targets = global_batch(step)
    return tokens.to(device), targets.to(device)


def config(stage: int, dtype: str = "fp32", offload: str = "none", offload_param: str = "none",
           nvme_dir: str | None = None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 200, "param_persistence_threshold": 40,
                  "allgather_bucket_size": 100}
    for key, where in (("offload_optimizer", offload), ("offload_param", offload_param)):
        if where == "cpu":
            zero[key] = {"device": "cpu"}
        elif where == "nvme":
            zero[key] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 3, "buffer_size": 1000}
    return {"zero": zero, "precision": {"dtype": dtype}}


def reference(device) -> dict:
    """One process, fp32, plain torch on ``device``: the losses and parameters every case must match."""
    model = build_model(device)
    optimizer = optimizer_for(model)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step, device))
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():  # the unused layer gets a zero gradient, as in the engine
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "final": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def train(engine, rank: int = 0, world: int = 1) -> list[float]:
    """STEPS steps on this rank's rows of each batch; the loss averaged over ranks."""
    rows = BATCH // world
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, engine.device)
        loss = engine(tokens[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows])
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1)
        if world > 1:
            torch.distributed.all_reduce(value)
        losses.append(float(value) / world)
    return losses


def run_python(code: str, env: dict | None = None, timeout: float = 240) -> dict:
    """Run ``code`` in a fresh interpreter (its own process group and CUDA context); it prints one
    JSON line last, returned here."""
    environ = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=timeout,
                          cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
