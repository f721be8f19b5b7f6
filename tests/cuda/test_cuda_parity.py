"""pytest -m cuda tests/cuda/test_cuda_parity.py — parity on a GPU: stages 0-3 x fp32/bf16 x
optimizer offload none/cpu/nvme at world 1, stage 3 with parameter offload, and world 2 over
gloo with CUDA tensors on one GPU (NCCL refuses two ranks on one GPU; GUIDE.md section 6).

Each engine trains on the GPU the device contract picks (the model is built on the CPU and
moved, as every launch path without --gpus builds it) and must match one plain-torch process
in fp32 on the same GPU: losses every step and parameters after, to the tolerances of
cuda_harness.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cuda_harness import (BF16_TWIN, BF16_VS_FP32, FP32_TOLERANCE, MARKS, REPO, STEPS, build_model, config,
                          optimizer_for, reference, train)

pytestmark = MARKS

CASES = [(0, dtype, "none") for dtype in ("fp32", "bf16")] + [
    (stage, dtype, offload) for stage in (1, 2, 3) for dtype in ("fp32", "bf16") for offload in ("none", "cpu", "nvme")
]


@pytest.fixture(scope="module")
def expected():
    """The fp32 plain-torch reference and the bf16 stage-0 twin, both on cuda:0."""
    import zerorun

    found = reference(torch.device("cuda", 0))
    model = build_model("cpu")
    twin = zerorun.initialize(model, optimizer_for(model), config(0, "bf16"))
    found["bf16 twin"] = {"losses": train(twin), "final": {k: v.float().cpu() for k, v in twin.full_state_dict().items()}}
    return found


def _close(losses, final, want, loss_rtol, param_atol, loss_atol=0.0):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), rtol=loss_rtol, atol=loss_atol)
    for name, value in want["final"].items():
        torch.testing.assert_close(final[name].float().cpu(), value, rtol=0.0, atol=param_atol, msg=name)


def check(losses, final, expected, dtype):
    if dtype == "fp32":
        _close(losses, final, expected, FP32_TOLERANCE["rtol"], 1e-4, FP32_TOLERANCE["atol"])
    else:
        _close(losses, final, expected, BF16_VS_FP32["loss_rtol"], BF16_VS_FP32["param_atol"])
        _close(losses, final, expected["bf16 twin"], BF16_TWIN["loss_rtol"], BF16_TWIN["param_atol"])


@pytest.mark.parametrize("stage, dtype, offload", CASES, ids=[f"s{s}-{d}-{o}" for s, d, o in CASES])
def test_parity_on_one_gpu(stage, dtype, offload, expected, tmp_path):
    import zerorun

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(stage, dtype, offload, nvme_dir=str(tmp_path)))
    assert engine.device == torch.device("cuda", 0)
    homes = {record.master.device.type for record in engine.records}
    assert homes == ({"cuda"} if offload == "none" else {"cpu"}), homes
    losses = train(engine)
    check(losses, engine.full_state_dict(), expected, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer_home", ["none", "cpu"])
def test_stage3_parameter_offload_with_and_without_optimizer_offload(dtype, optimizer_home, expected):
    """Finding 1: with offload_param but no offload_optimizer the master was the host shard while
    the gradient stayed on the GPU, and the first step failed ("assigned grad has data of a
    different type"). The master now sits beside the gradient. Finding 6: the host chunks are
    copied on the copy stream (Note [copy stream]), and parity says the ordering holds."""
    import zerorun

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(3, dtype, optimizer_home, offload_param="cpu"))
    partitioned = [r for r in engine.records if r.unit.partitioned]
    assert partitioned and all(r.unit.shard.device.type == "cpu" for r in partitioned)
    want = "cuda" if optimizer_home == "none" else "cpu"
    assert all(r.master.device.type == want for r in engine.records)
    check(train(engine), engine.full_state_dict(), expected, dtype)
    from zerorun.zero.unit import staging

    assert 0 in staging._streams  # finding 6: the host chunks came over on the copy stream


RANK_CODE = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.environ["REPO"], "tests", "cuda"))
from cuda_harness import build_model, config, optimizer_for, train
import zerorun
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="file://" + os.environ["RENDEZVOUS"], rank=rank, world_size=world)
model = build_model("cpu")
engine = zerorun.initialize(model, optimizer_for(model), config(int(os.environ["STAGE"])))
assert engine.device == torch.device("cuda", 0), engine.device
losses = train(engine, rank, world)
final = engine.full_state_dict()
if rank == 0:
    torch.save({k: v.cpu() for k, v in final.items()}, os.environ["OUT"])
print(json.dumps({"losses": losses, "backend": dist.get_backend()}))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_on_one_gpu_over_gloo_match_one_process(stage, expected, tmp_path):
    """World 2, both ranks on cuda:0 (ZERORUN_DEVICE=cuda:0, the documented way), gloo with CUDA
    tensors: every sharded CUDA path with a real second rank."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "REPO": str(REPO), "WORLD_SIZE": "2", "RENDEZVOUS": str(tmp_path / "rendezvous"),
           "STAGE": str(stage), "OUT": str(tmp_path / "final.pt"), "ZERORUN_DEVICE": "cuda:0"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_CODE], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
             for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert results[0]["losses"] == results[1]["losses"] and results[0]["backend"] == "gloo"
    assert len(results[0]["losses"]) == STEPS
    check(results[0]["losses"], torch.load(tmp_path / "final.pt", weights_only=True), expected, "fp32")
