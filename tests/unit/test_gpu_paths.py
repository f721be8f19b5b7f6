"""pytest tests/unit/test_gpu_paths.py — issue 41's GPU-only paths, proven on the CPU with CUDA mocked.

Each test fails on the code before its fix: the cuda tier's meta-device model, the exit
barrier's GPU, the GPU workers' thread count, ``estimate --measure``'s backend and the
offloaded gradient's copy (pinned, on a copy stream, ordered by events).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_the_cuda_tiers_model_builds_on_the_meta_device():
    """The seed test built its model under ``torch.device("meta")`` and then moved it to the
    CPU: "Cannot copy out of meta tensor" on any GPU, so the seed fix had no working test."""
    sys.path.insert(0, str(REPO / "tests" / "cuda"))
    from cuda_harness import build_model

    with torch.device("meta"):
        model = build_model()
    assert all(p.is_meta for p in model.parameters())
    assert all(not p.is_meta for p in build_model("cpu").parameters())


def test_the_exit_barrier_runs_on_this_ranks_gpu(monkeypatch):
    """Note [exit barrier device]: the barrier's thread starts on GPU 0; it must be bound to the
    main thread's GPU (3 here) before the barrier, which names that GPU to NCCL."""
    from zerorun.zero.comm import process_group

    seen = []
    monkeypatch.setattr(process_group.dist, "is_available", lambda: True)
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.append(("set_device", index,
                                                                              threading.current_thread().name)))
    monkeypatch.setattr(process_group, "leave_together",
                        lambda group=None, **kw: seen.append(("barrier", kw.get("gpu"), threading.current_thread().name)))
    monkeypatch.setattr(process_group, "_uncaught_exception", False)
    monkeypatch.setattr(process_group, "_failing_exit", False)
    recorder = SimpleNamespace(record_activity=lambda *a: None, send_sample=lambda: None)
    monkeypatch.setattr("zerorun.telemetry.get_recorder", lambda: recorder)
    process_group.leave_process_group()
    assert seen == [("set_device", 3, "zerorun-exit-barrier"), ("barrier", 3, "zerorun-exit-barrier")]


def test_an_nccl_exit_barrier_names_its_gpu(monkeypatch):
    from zerorun.zero.comm import process_group

    calls = []
    monkeypatch.setattr(process_group.dist, "is_available", lambda: True)
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(process_group.dist, "barrier", lambda **kw: calls.append(("barrier", kw)))
    monkeypatch.setattr(process_group, "_destroy_now", lambda group=None: calls.append(("destroy",)))
    monkeypatch.setattr(process_group, "close_host_channels", lambda **kw: None)
    process_group.leave_together(gpu=2)
    assert calls == [("barrier", {"group": None, "device_ids": [2]}), ("destroy",)]


def test_no_cuda_no_exit_gpu(monkeypatch):
    from zerorun.zero.comm import process_group

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU worker never starts CUDA
    assert process_group.exit_gpu() is None


def _plan(hosts, **kwargs):
    from zerorun.launch.plan import Target, build_plan

    return build_plan(hosts, Target(script="train.py"), python="/py", cwd="/job", run_dir="/job/run", token="t",
                      master_port=29500, **kwargs)


def test_gpu_workers_share_this_machines_cores():
    """Note [worker threads]: ``zerorun --gpus 4`` on 16 usable cores gives each worker 4
    threads (the host optimizer of offload_optimizer: cpu ran on one core per rank)."""
    plan = _plan({"localhost": [0, 1, 2, 3]}, device_kind="cuda", host_cpus=16)
    assert [w.env["OMP_NUM_THREADS"] for w in plan.workers] == ["4"] * 4
    assert "OMP_NUM_THREADS" not in _plan({"localhost": [0]}, device_kind="cuda", host_cpus=16).workers[0].env
    assert _plan({"localhost": [0, 1, 2]}, device_kind="cuda", host_cpus=2).workers[0].env["OMP_NUM_THREADS"] == "1"


def test_cpu_workers_remote_hosts_slurm_and_the_user_keep_their_rules():
    assert _plan({"localhost": [0, 1]}, device_kind="cpu", host_cpus=16).workers[0].env["OMP_NUM_THREADS"] == "1"
    remote = _plan({"localhost": [0, 1], "node-b": [0, 1]}, device_kind="cuda", host_cpus=16)
    assert [w.env["OMP_NUM_THREADS"] for w in remote.workers] == ["8", "8", "1", "1"]
    slurm = _plan({"localhost": [0, 1]}, device_kind="cuda", host_cpus=16, threads_per_worker=6)
    assert slurm.workers[0].env["OMP_NUM_THREADS"] == "6"
    mine = _plan({"localhost": [0, 1]}, device_kind="cuda", host_cpus=16, inherited_env={"OMP_NUM_THREADS": "2"})
    assert "OMP_NUM_THREADS" not in mine.workers[0].env


def test_zerorun_gpus_gives_each_worker_its_share_of_this_machines_cores(monkeypatch, tmp_path):
    """``zerorun --gpus 2`` outside Slurm on a machine that lets the job use 12 cores: 6 each."""
    import os

    from zerorun.launch.plan import Target
    from zerorun.launch.prepare import LaunchOptions, prepare

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    (tmp_path / "train.py").write_text("")
    job = prepare(LaunchOptions(target=Target(script="train.py"), gpus=2), environ={}, cwd=str(tmp_path),
                  gpu_counter=lambda: 2)
    assert [w.env["OMP_NUM_THREADS"] for w in job.plan.workers] == ["6", "6"]


def test_measure_runs_nccl_on_a_gpu_node(monkeypatch, tmp_path):
    """``zerorun estimate --measure`` on a GPU node measured gloo with CUDA tensors."""
    from zerorun.planner import measure

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        calls.append(("init", backend))
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", init)
    with pytest.raises(Stop):
        measure._worker(1, 2, str(tmp_path), "m:f", [], "fp32", 1, 1, 1)
    assert calls == [("set_device", "cuda:1"), ("init", "nccl")]


def test_measure_refuses_more_ranks_than_gpus_in_one_line(monkeypatch):
    from zerorun.errors import PlannerError
    from zerorun.planner import measure

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PlannerError, match="--measure-ranks 2 needs 2 GPUs"):
        measure._check_gpus(2)
    measure._check_gpus(1)


def _record(chunk, final="final-event", index=0):
    return SimpleNamespace(index=index, unit=SimpleNamespace(device=torch.device("cuda", 1),
                                                             layout=SimpleNamespace(chunk_numel=chunk.numel())),
                           gradient=SimpleNamespace(chunk=chunk), update=SimpleNamespace(final=final))


@pytest.fixture
def mocked_cuda(monkeypatch):
    """CUDA streams, events and pinned memory as a log (Note [gradient copies])."""
    from zerorun.zero.offload import grad_copy

    log: list[str] = []
    in_stream: list[str] = []

    class Stream:
        def __init__(self, device=None):
            self.name = f"to-host{device}"

        def wait_event(self, event):
            log.append(f"{self.name} waits for {event}")

    class Event:
        def record(self, stream):
            log.append(f"done recorded on {stream.name}")

        def synchronize(self):
            log.append("host waits for done")

    @contextlib.contextmanager
    def stream_context(stream):
        in_stream.append(stream.name)
        yield
        in_stream.pop()

    class Chunk(torch.Tensor):
        pass

    def pinned(numel, dtype):
        log.append(f"pinned {numel} {dtype} on {in_stream[-1] if in_stream else 'the default stream'}")
        buffer = torch.empty(numel, dtype=dtype)
        real_copy = buffer.copy_

        def copy_(source, non_blocking=False):
            log.append(f"copy non_blocking={non_blocking} on {in_stream[-1] if in_stream else 'the default stream'}")
            return real_copy(source)

        buffer.copy_ = copy_  # type: ignore[method-assign]
        return buffer

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(grad_copy, "_to_host_streams", {})
    monkeypatch.setattr(grad_copy, "pinned_empty", pinned)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: log.append(f"chunk used by {stream.name}"),
                        raising=False)
    return log


def test_gradient_copies_are_pinned_async_and_ordered_by_events(mocked_cuda):
    """The offloaded gradient went to fresh pageable memory, synchronously, on the update
    thread's default stream. Now: the copy stream waits for the gradient's ``final`` event,
    copies into a pinned buffer without blocking, records ``done``; the update waits for it."""
    from zerorun.zero.offload.grad_copy import GradientCopies

    copies = GradientCopies(ahead=1)
    first, second = _record(torch.arange(4.0), index=0), _record(torch.arange(3.0) + 10, index=1)
    copies.start(first)
    copies.start(second)  # one ahead at most: its update issues it
    assert mocked_cuda == ["to-host1 waits for final-event", "pinned 4 torch.float32 on to-host1",
                           "copy non_blocking=True on to-host1", "done recorded on to-host1", "chunk used by to-host1"]
    mocked_cuda.clear()
    assert torch.equal(copies.take(first), torch.arange(4.0))
    assert mocked_cuda == ["host waits for done"]
    mocked_cuda.clear()
    assert torch.equal(copies.take(second), torch.arange(3.0) + 10)
    assert mocked_cuda[-1] == "host waits for done" and "copy non_blocking=True on to-host1" in mocked_cuda


def test_a_bf16_gradient_crosses_in_bf16_and_is_widened_on_the_host(mocked_cuda):
    from zerorun.zero.offload.grad_copy import GradientCopies

    chunk = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    got = GradientCopies().take(_record(chunk))
    assert got.dtype == torch.float32 and torch.equal(got, chunk.float())
    assert "pinned 3 torch.bfloat16 on to-host1" in mocked_cuda


def test_a_copy_from_an_earlier_window_is_never_taken(mocked_cuda):
    from zerorun.zero.offload.grad_copy import GradientCopies

    copies = GradientCopies()
    stale = _record(torch.zeros(2), final="window-1")
    copies.start(stale)  # its step failed: never taken
    fresh = _record(torch.ones(2), final="window-2")
    assert torch.equal(copies.take(fresh), torch.ones(2))
    assert "to-host1 waits for window-2" in mocked_cuda


def test_on_the_cpu_the_gradient_is_read_where_it_is():
    from zerorun.zero.offload.grad_copy import GradientCopies

    chunk = torch.arange(3.0)
    record = SimpleNamespace(index=0, unit=SimpleNamespace(device=torch.device("cpu"),
                                                           layout=SimpleNamespace(chunk_numel=3)),
                             gradient=SimpleNamespace(chunk=chunk), update=SimpleNamespace(final=None))
    copies = GradientCopies()
    copies.start(record)
    assert copies.take(record) is chunk  # as before: no copy, no stream
    record.gradient.chunk = None
    assert torch.equal(copies.take(record), torch.zeros(3))


def test_offloading_placements_stage_through_gradient_copies():
    from zerorun.zero.offload.grad_copy import GradientCopies
    from zerorun.zero.offload.placements import OnHost

    home = OnHost()
    assert isinstance(home.copies, GradientCopies)
    started = []
    home.copies.start = started.append  # type: ignore[method-assign]
    home.prefetch("record")  # type: ignore[arg-type]
    assert started == ["record"]


def test_telemetry_reads_the_gpu_the_engine_bound_not_the_environments_guess(monkeypatch):
    """The telemetry thread picked its GPU from the environment alone: with a gloo group the
    script started and its model built on cuda:1 (the engine keeps it there) it read GPU 0, and
    for a worker the engine put on the CPU it still read a GPU."""
    from zerorun.telemetry.recorder import _cuda_index
    from zerorun.worker import device

    fake = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True, device_count=lambda: 2))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(device, "_bound", None)
    assert _cuda_index(fake, environ={"LOCAL_RANK": "0"}) == 0  # before initialize: the environment's guess
    device.bind(device.DeviceChoice("cuda:1", "the model was built there, beside a gloo group"))
    assert _cuda_index(fake, environ={"LOCAL_RANK": "0"}) == 1
    device.bind(device.DeviceChoice("cpu", "a gloo group the script started, the model on the CPU"))
    assert _cuda_index(fake, environ={"LOCAL_RANK": "0"}) is None
