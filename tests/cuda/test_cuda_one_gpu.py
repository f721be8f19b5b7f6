"""pytest -m cuda tests/cuda/test_cuda_one_gpu.py — what one GPU can prove (issue 41).

NCCL runs at world size 1, so the communication stream carries real NCCL kernels here (zerorun
issues no collective at world 1, so the test issues them through the same ``_issue`` path the
engine uses at world 2 and more); the launcher runs the demo and a Hugging Face model on the GPU
with the dashboard's CUDA memory and summary; stage 3 trains a Hugging Face model with its own
``gradient_checkpointing_enable()`` against plain torch; offloaded gradients cross in pinned
buffers on the device-to-host stream. Tests that need two GPUs are in the other files and say so
when they skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cuda_harness import MARKS, REPO, build_model, config, optimizer_for, run_python, train

pytestmark = MARKS

NCCL_AT_WORLD_1 = """
import json, torch, torch.distributed as dist
from zerorun.zero.comm import collectives, comm_stream
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://{rendezvous}", rank=0, world_size=1)
device = torch.device("cuda", 0)
seen = []
class Seen:
    def collective_started(self, seq, op, nbytes): pass
    def collective_waited(self, seq, op, waited): pass
    def collective_finished(self, seq, op, nbytes, seconds, waited): seen.append((op, seconds))
collectives.add_observer(Seen())
x = torch.arange(1 << 20, dtype=torch.float32, device=device)
gathered, scattered, summed = torch.empty_like(x), torch.empty_like(x), x.clone()
handles = [
    collectives._issue("all_gather", x.numel() * 4, lambda a: collectives._all_gather_flat(gathered, x, async_op=a),
                       True, on_stream=device, buffers=(gathered, x)),
    collectives._issue("reduce_scatter", x.numel() * 4,
                       lambda a: collectives._reduce_scatter_flat(scattered, x, async_op=a), True, on_stream=device,
                       buffers=(scattered, x)),
    collectives._issue("all_reduce", x.numel() * 4, lambda a: dist.all_reduce(summed, async_op=a), True,
                       on_stream=device, buffers=(summed,)),
]
for handle in handles:
    handle.wait()
same = all(bool(torch.equal(t, x)) for t in (gathered, scattered, summed))
torch.cuda.synchronize()
collectives.poll_timings()
print(json.dumps({{"same": same, "seen": seen, "pending": collectives._ledger.pending(),
                   "streams": sorted(comm_stream._streams), "backend": dist.get_backend()}}))
dist.destroy_process_group()
"""


def test_nccl_at_world_1_runs_on_the_communication_stream_with_events_and_ledger(tmp_path):
    found = run_python(NCCL_AT_WORLD_1.format(rendezvous=tmp_path / "rendezvous"))
    assert found["backend"] == "nccl" and found["same"] and found["streams"] == [0]
    assert sorted(op for op, _ in found["seen"]) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(seconds >= 0.0 for _, seconds in found["seen"]) and found["pending"] == 0


HF_SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
import zerorun
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, use_cache=False))
model.gradient_checkpointing_enable()
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {"stage": 3}})
for step in range(4):
    ids = torch.randint(0, 128, (2, 32), device=engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
print("done on", engine.device)
"""


@pytest.mark.parametrize("program", ["demo", "hf"])
def test_zerorun_gpus_1_runs_on_the_gpu_with_cuda_memory_in_the_dashboard_and_summary(program, tmp_path):
    if program == "demo":
        argv = ["examples/train_gpt.py", "--steps", "4", "--preset", "nano"]
    else:
        (tmp_path / "hf_train.py").write_text(HF_SCRIPT)
        argv = [str(tmp_path / "hf_train.py")]
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "zerorun", "--gpus", "1", "--no-dashboard", "--run-dir", str(run_dir),
                           *argv], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert " gpu " in output  # the summary's peak column names GPU memory, not the host's RSS
    samples = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    memory = [s for s in samples if "cuda_allocated" in json.dumps(s)]
    assert memory, "no CUDA memory sample reached the launcher"


def test_stage_3_with_the_models_own_gradient_checkpointing_matches_plain_torch():
    """Note [anyone's checkpoint] (zero/activation_checkpointing.py), on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerorun

    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             use_cache=False))
        model.gradient_checkpointing_enable()
        return model

    batches = [torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    reference = build().cuda()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for ids in batches:
        loss = reference(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(float(loss))
    model = build()
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                {"zero": {"stage": 3, "param_persistence_threshold": 0}})
    got = []
    for ids in batches:
        loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        got.append(float(loss))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_offloaded_gradients_cross_in_pinned_buffers_on_the_copy_stream():
    """Note [gradient copies]: every staged gradient is pinned host memory, made by a copy on the
    device-to-host stream; training matches the stage-2 run without offload."""
    import zerorun
    from zerorun.zero.offload import grad_copy

    staged = []
    real_take = grad_copy.GradientCopies.take

    def take(self, record):
        grad = real_take(self, record)
        staged.append(grad.is_pinned())
        return grad

    grad_copy.GradientCopies.take = take  # type: ignore[method-assign]
    try:
        model = build_model("cpu")
        engine = zerorun.initialize(model, optimizer_for(model), config(2, offload="cpu"))
        offloaded = train(engine)
    finally:
        grad_copy.GradientCopies.take = real_take  # type: ignore[method-assign]
    assert staged and all(staged)
    assert sorted(grad_copy._to_host_streams) == [0]
    model = build_model("cpu")
    plain = train(zerorun.initialize(model, optimizer_for(model), config(2)))
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(plain), rtol=1e-5, atol=1e-6)
