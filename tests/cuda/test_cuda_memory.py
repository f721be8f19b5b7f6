"""pytest -m cuda tests/cuda/test_cuda_memory.py — GPU memory of stage 3 against FSDP2 on one GPU.

The same 8-layer MLP (about 34M parameters), bf16 compute with fp32 master weights and AdamW,
trained three steps by zerorun stage 3 and by FSDP2 (``fully_shard`` per layer, bf16 params in
compute, fp32 sharded master), each in its own interpreter; the peak of
``torch.cuda.max_memory_allocated`` over the last step. Both hold about 16 bytes per parameter
of model state; the bound leaves room for zerorun's gradient buckets. With
ZERORUN_GPU_CHECK_OUT set (scripts/gpu_check.sh), the figures are written there for its table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cuda_harness import MARKS, run_python

pytestmark = MARKS

PEAK_RATIO_BOUND = 1.25

SCRIPT = """
import json, os, sys, time, torch, torch.distributed as dist
system = sys.argv[1] if len(sys.argv) > 1 else os.environ["SYSTEM"]
dist.init_process_group("nccl", init_method="file://" + os.environ["RENDEZVOUS"], rank=0, world_size=1)
torch.cuda.set_device(0)
torch.manual_seed(0)
width, depth, batch = 2048, 8, 64
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth)])
if system == "fsdp2":
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model.cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    def step(x):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
else:
    import zerorun
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                {"zero": {"stage": 3}, "precision": {"dtype": "bf16"}})
    def step(x):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
x = torch.randn(batch, width, device="cuda")
for _ in range(2):
    step(x)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
step(x)
torch.cuda.synchronize()
print(json.dumps({"peak": torch.cuda.max_memory_allocated(), "step_s": time.perf_counter() - start,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def test_stage3_peak_gpu_memory_within_bound_of_fsdp2(tmp_path):
    found = {}
    for system in ("fsdp2", "zero3"):
        found[system] = run_python(SCRIPT, env={"SYSTEM": system, "RENDEZVOUS": str(tmp_path / system)})
    ratio = found["zero3"]["peak"] / found["fsdp2"]["peak"]
    out = os.environ.get("ZERORUN_GPU_CHECK_OUT")
    if out:
        Path(out, "memory.json").write_text(json.dumps({**found, "ratio": ratio, "bound": PEAK_RATIO_BOUND}))
    assert ratio <= PEAK_RATIO_BOUND, found
