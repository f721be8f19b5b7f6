"""pytest -m cuda tests/cuda/test_cuda_findings.py — what a GPU review found, on a GPU.

Finding 1 (stage 3 parameter offload without optimizer offload) is in test_cuda_parity.py.
Each test that needs a fresh process group or CUDA context runs in its own interpreter.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cuda_harness import MARKS, REPO, build_model, config, optimizer_for, run_python, train

pytestmark = MARKS


def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (local rank 1 on its own GPU)")


DEEPSPEED_SCRIPT = """
import json, torch, torch.distributed as dist
import zerorun.deepspeed as deepspeed
deepspeed.init_distributed()
model = torch.nn.Linear(8, 4)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
x = torch.randn(2, 8, device=engine.device)
loss = engine(x).float().pow(2).mean()
engine.backward(loss)
engine.step()
print(json.dumps({"backend": dist.get_backend(), "device": str(engine.device),
                  "param": str(next(engine.module.parameters()).device),
                  "accelerator": deepspeed.accelerator.get_accelerator().device_name(),
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


def test_deepspeed_script_without_the_launcher_trains_on_the_gpu_over_nccl():
    """Finding 2: init_distributed picked NCCL because CUDA existed, while the model stayed on
    the CPU; the first broadcast handed NCCL CPU tensors."""
    found = run_python(DEEPSPEED_SCRIPT)
    assert (found["backend"], found["device"], found["param"], found["accelerator"]) == ("nccl", "cuda:0", "cuda:0",
                                                                                       "cuda")


def test_deepspeed_script_told_cpu_stays_off_the_gpu():
    """The same script as a CPU worker (zerorun --nproc sets ZERORUN_DEVICE=cpu): gloo, the CPU,
    and CUDA never initialised."""
    found = run_python(DEEPSPEED_SCRIPT, env={"ZERORUN_DEVICE": "cpu"})
    assert (found["backend"], found["device"], found["param"], found["accelerator"]) == ("gloo", "cpu", "cpu", "cpu")
    assert found["cuda_initialized"] is False


def test_plain_initialize_moves_a_cpu_built_model_to_the_gpu():
    """Finding 2: plain zerorun.initialize on a GPU node (torchrun, srun python, plain python)
    trained on the CPU with gloo, silently."""
    import zerorun

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(2))
    assert engine.device == torch.device("cuda", 0)
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    assert all(r.master.device.type == "cuda" for r in engine.records)
    train(engine)


def test_gpu_checkpoint_resumes_and_reshards_onto_the_cpu(tmp_path):
    """Finding 3 (no map_location: GPU tensors of engine.pt landed on cuda:0, and cannot load at
    all without CUDA): a stage-3 checkpoint written on the GPU, with a CUDA tensor in its
    client_state, resumes on a CPU-only interpreter at stage 1 with the same parameters."""
    import zerorun

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(3))
    train(engine)
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"on_gpu": torch.arange(3.0, device="cuda")})
    torch.save({k: v.cpu() for k, v in engine.full_state_dict().items()}, tmp_path / "saved.pt")
    code = f"""
import json, sys, torch
sys.path.insert(0, {str(REPO / 'tests' / 'cuda')!r})
from cuda_harness import build_model, config, optimizer_for
import zerorun
assert not torch.cuda.is_available()
model = build_model("cpu")
engine = zerorun.initialize(model, optimizer_for(model), config(1))
_, client = engine.load_checkpoint({str(tmp_path / 'ckpt')!r})
saved = torch.load({str(tmp_path / 'saved.pt')!r}, weights_only=True)
state = engine.full_state_dict()
worst = max(float((state[k].float() - v.float()).abs().max()) for k, v in saved.items())
print(json.dumps({{"worst": worst, "client": str(client["on_gpu"].device), "device": str(engine.device)}}))
"""
    found = run_python(code, env={"CUDA_VISIBLE_DEVICES": ""})
    assert found == {"worst": 0.0, "client": "cpu", "device": "cpu"}


def test_gpu_checkpoint_client_tensors_come_back_on_this_workers_gpu(tmp_path):
    import zerorun

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(2))
    engine.save_checkpoint(tmp_path, client_state={"on_gpu": torch.ones(2, device="cuda"), "host": torch.ones(2)})
    _, client = engine.load_checkpoint(tmp_path)
    assert client["on_gpu"].device == engine.device and client["host"].device.type == "cpu"


def test_telemetry_thread_reads_this_workers_gpu():
    """Finding 4: memory_allocated() with no device on the telemetry thread read GPU 0."""
    from zerorun.telemetry.recorder import sample_memory

    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(sample_memory()))
    thread.start()
    thread.join()
    assert seen["cuda_allocated"] >= held.numel()


def test_telemetry_of_local_rank_1_reads_gpu_1():
    two_gpus()
    code = """
import json, threading, torch
from zerorun.worker import device
from zerorun.telemetry.recorder import sample_memory
device.bind(device.this_worker())
held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # the current device: GPU 1
seen = {}
thread = threading.Thread(target=lambda: seen.update(sample_memory()))
thread.start(); thread.join()
print(json.dumps({"seen": seen["cuda_allocated"], "held": held.numel(), "on": str(held.device)}))
"""
    found = run_python(code, env={"LOCAL_RANK": "1"})
    assert found["on"] == "cuda:1" and found["seen"] >= found["held"]


def test_meta_construction_on_the_gpu_keeps_the_users_cuda_seed():
    """Finding 5: construction reseeded every GPU generator and restored none of them."""
    import zerorun

    torch.cuda.manual_seed(4321)
    before = torch.cuda.get_rng_state(0).clone()
    with torch.device("meta"):
        model = build_model()
    engine = zerorun.initialize(model, optimizer_for(model), config(3))
    assert engine.device == torch.device("cuda", 0)
    assert not any(p.is_meta for p in engine.module.parameters())
    assert torch.equal(torch.cuda.get_rng_state(0), before)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_group_the_script_started_still_gets_this_workers_gpu_current(local_rank, tmp_path):
    """Finding 8: with the group already started, no set_device: all_gather_object at save (and
    every allocation without a device) used cuda:0 on every rank."""
    if local_rank:
        two_gpus()
    code = f"""
import json, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
import zerorun
model = torch.nn.Linear(8, 4)
engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {{"zero": {{"stage": 2}}}})
engine.save_checkpoint({str(tmp_path / 'ckpt')!r})
print(json.dumps({{"current": torch.cuda.current_device(), "device": str(engine.device)}}))
"""
    found = run_python(code, env={"LOCAL_RANK": str(local_rank)})
    assert found == {"current": local_rank, "device": f"cuda:{local_rank}"}


def test_offloaded_masters_and_shards_are_pinned_from_one_arena_and_counted():
    """Finding 7: each unit's master and host shard pinned on its own, rounded up to a power of
    two and never counted. Now carved from the placement's arena, its slack counted as host."""
    import zerorun
    from zerorun.zero.offload.placements import OnDevice

    model = build_model("cpu")
    engine = zerorun.initialize(model, optimizer_for(model), config(3, "bf16", "cpu", offload_param="cpu"))
    assert all(r.master.is_pinned() and r.master.device.type == "cpu" for r in engine.records)
    assert all(r.unit.shard.is_pinned() for r in engine.records if r.unit.partitioned)
    home = engine.records[0].state_home
    arena = home.memory.arena
    assert arena.handed_out == sum(r.master.numel() * 4 for r in engine.records)
    assert arena.reserved >= arena.handed_out and home.arena_slack() == arena.reserved - arena.handed_out
    counted = home.nbytes(engine.records, engine.optimizer)["host"]
    assert counted == OnDevice.nbytes(home, engine.records, engine.optimizer)["host"] + home.arena_slack()
    train(engine)
