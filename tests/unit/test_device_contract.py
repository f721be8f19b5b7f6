"""pytest tests/unit/test_device_contract.py — Note [device contract] in zerorun/worker/device.py.

Every launch path's environment, with and without CUDA devices (a fake count), and the places
that act on the answer (the engine's process group, the DeepSpeed module, telemetry,
checkpoints, construction), with torch.cuda mocked where a GPU would be touched.
"""

from __future__ import annotations

import itertools
import json
import sys
import types

import pytest
import torch

from zerorun.errors import RuntimeConfigError
from zerorun.worker import device
from zerorun.worker.device import choose_device, device_kind, rng_devices, storage_home


def gpus(n):
    return lambda: n


def never():
    raise AssertionError("a CPU worker counted the GPUs (CUDA touched)")


# Each launch path as the worker's environment shows it (what the launcher or torch wrote).
ZERORUN_GPUS = {"ZERORUN_DEVICE": "cuda:1", "LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"}
ZERORUN_NPROC = {"ZERORUN_DEVICE": "cpu", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}
TORCHRUN = {"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_GPUS_ON_NODE": "2"}
# srun --gpus-per-task=1: each task sees its own one GPU (CUDA_VISIBLE_DEVICES=1 for local id 1).
SRUN_BOUND = {**SRUN, "CUDA_VISIBLE_DEVICES": "1"}
HOSTFILE_AGENT = {"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "ZERORUN_HOST": "node2"}
# deepspeed.init_distributed under mpirun: its discovery wrote LOCAL_RANK from Open MPI's.
INIT_DISTRIBUTED = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
PLAIN = {}


@pytest.mark.parametrize("environ, visible, expected", [
    (ZERORUN_GPUS, 2, "cuda:1"),
    (ZERORUN_GPUS, 8, "cuda:1"),
    (ZERORUN_NPROC, 0, "cpu"),
    (TORCHRUN, 2, "cuda:1"),
    (TORCHRUN, 0, "cpu"),
    (SRUN, 2, "cuda:1"),
    (SRUN, 0, "cpu"),
    (SRUN_BOUND, 1, "cuda:0"),
    ({**SRUN, "SLURM_GPUS_PER_TASK": "2", "SLURM_GPUS_ON_NODE": "4"}, 2, "cuda:0"),
    ({**SRUN, "SLURM_GPUS_ON_NODE": "h100:4"}, 2, "cuda:0"),  # typed count, task sees half
    ({k: v for k, v in SRUN_BOUND.items() if k != "SLURM_GPUS_ON_NODE"}, 1, "cuda:0"),  # --gpu-bind alone
    # torchrun (one task per node, --gpus-per-task=4) under srun: its workers index the task's GPUs
    ({**SRUN, "SLURM_LOCALID": "0", "SLURM_GPUS_PER_TASK": "4", "SLURM_GPUS_ON_NODE": "4", **TORCHRUN,
      "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 4, "cuda:2"),
    # two torchrun tasks per node, each bound to 2 of the node's 4 GPUs; this worker is local rank 1 of task 1
    ({**SRUN, "SLURM_LOCALID": "1", "SLURM_GPUS_ON_NODE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2,
     "cuda:1"),
    (HOSTFILE_AGENT, 2, "cuda:1"),
    (HOSTFILE_AGENT, 0, "cpu"),
    (INIT_DISTRIBUTED, 2, "cuda:1"),
    (PLAIN, 1, "cuda:0"),
    (PLAIN, 0, "cpu"),
    ({"DS_ACCELERATOR": "cuda", "LOCAL_RANK": "1"}, 2, "cuda:1"),
])
def test_every_launch_path_gets_its_device_and_the_backend_follows(environ, visible, expected):
    choice = choose_device(environ, gpus(visible))
    assert choice.device == expected
    assert choice.backend == ("nccl" if expected.startswith("cuda") else "gloo")
    assert choice.why


@pytest.mark.parametrize("environ", [ZERORUN_NPROC, {**TORCHRUN, "DS_ACCELERATOR": "cpu"},
                                     {**TORCHRUN, "ZERORUN_DEVICE": "cpu"}])
def test_a_cpu_worker_never_counts_gpus(environ):
    assert choose_device(environ, never).device == "cpu"
    assert device_kind(environ, never) == "cpu"


@pytest.mark.parametrize("environ, visible, says", [
    (ZERORUN_GPUS, 0, "asks for a GPU but this worker sees none"),
    (ZERORUN_GPUS, 1, "cuda:1 is not a GPU this worker has (ZERORUN_DEVICE=cuda:1"),
    ({**TORCHRUN, "LOCAL_RANK": "3"}, 2, "local rank 3 has no GPU of its own"),
    # torchrun inside an srun step: LOCAL_RANK is torchrun's, not Slurm's, so no binding is assumed
    ({**SRUN, "SLURM_LOCALID": "0", "LOCAL_RANK": "3"}, 2, "local rank 3 has no GPU of its own"),
    ({**SRUN, "SLURM_LOCALID": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 2, "local rank 3 has no GPU"),
    ({"DS_ACCELERATOR": "cuda"}, 0, "DS_ACCELERATOR=cuda asks for a GPU"),
    ({"LOCAL_RANK": "x"}, 2, "LOCAL_RANK='x' is not a non-negative integer"),
])
def test_a_gpu_the_worker_does_not_have_is_one_line(environ, visible, says):
    with pytest.raises(RuntimeConfigError) as caught:
        choose_device(environ, gpus(visible))
    assert says in caught.value.message and "\n" not in caught.value.message and caught.value.hint


def test_an_existing_group_decides_the_kind_when_nothing_else_does():
    assert choose_device(TORCHRUN, gpus(2), group_backend="gloo").device == "cpu"  # gloo alone: CPU tensors
    assert choose_device(TORCHRUN, gpus(2), group_backend="gloo", built_on="cpu").device == "cpu"
    # ... unless the script built the model on a GPU: gloo moves CUDA tensors, the model stays
    assert choose_device(TORCHRUN, gpus(2), group_backend="gloo", built_on="cuda:0").device == "cuda:0"
    assert choose_device(TORCHRUN, gpus(2), group_backend="gloo", built_on="cuda").device == "cuda:1"
    with pytest.raises(RuntimeConfigError, match="cuda:3 is not a GPU this worker has"):
        choose_device(TORCHRUN, gpus(2), group_backend="gloo", built_on="cuda:3")
    assert choose_device(TORCHRUN, gpus(2), group_backend="nccl").device == "cuda:1"
    assert choose_device(TORCHRUN, gpus(2), group_backend="cpu:gloo,cuda:nccl").device == "cuda:1"
    # the launcher's (or the user's) explicit choice wins over a gloo group: gloo moves CUDA tensors
    assert choose_device({"ZERORUN_DEVICE": "cuda:0", "LOCAL_RANK": "1"}, gpus(1), "gloo").device == "cuda:0"
    with pytest.raises(RuntimeConfigError, match="NCCL but this worker trains on the CPU"):
        choose_device(ZERORUN_NPROC, gpus(2), group_backend="nccl")


VARIABLES = {
    "ZERORUN_DEVICE": [None, "cpu", "cuda:0", "cuda:1"],
    "DS_ACCELERATOR": [None, "cpu", "cuda"],
    "LOCAL_RANK": [None, "0", "1"],
    "SLURM_LOCALID": [None, "0", "1"],
    "SLURM_STEP_ID": [None, "0"],
    "SLURM_GPUS_ON_NODE": [None, "2"],
}


def test_every_combination_gives_a_gpu_it_has_or_cpu_or_one_error():
    """The whole grid, counts 0-3: the index is a GPU the worker sees, NCCL exactly with CUDA,
    the CPU (without counting) whenever a CPU is named, and no other exception than the line."""
    for values in itertools.product(*VARIABLES.values()):
        environ = {k: v for k, v in zip(VARIABLES, values, strict=True) if v is not None}
        for visible in range(4):
            try:
                choice = choose_device(environ, gpus(visible))
            except RuntimeConfigError as err:
                assert "\n" not in err.message
                continue
            assert choice.backend == ("nccl" if choice.is_cuda else "gloo")
            assert choice.device == "cpu" or choice.index < visible, (environ, visible, choice)
            assert device_kind(environ, gpus(visible)) == ("cuda" if choice.is_cuda else "cpu")
            if environ.get("DS_ACCELERATOR") == "cpu" or (environ.get("ZERORUN_DEVICE") == "cpu"
                                                           and "DS_ACCELERATOR" not in environ):
                assert choose_device(environ, never).device == "cpu"
            if visible == 0:
                assert choice.device == "cpu"


# -- the places that act on it ---------------------------------------------------------------


@pytest.fixture
def gpu_node(monkeypatch):
    """A machine with two GPUs, as far as the contract and set_device can tell."""
    calls = []
    monkeypatch.setattr(device, "visible_gpus", gpus(2))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(index))
    for name in ("ZERORUN_DEVICE", "DS_ACCELERATOR", "SLURM_STEP_ID", "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_plain_initialize_under_torchrun_on_a_gpu_node_trains_on_the_gpu(gpu_node, monkeypatch):
    """Finding 2: the model was built on the CPU and stayed there, with gloo, silently."""
    from zerorun.zero.engine import _compute_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _compute_device(torch.device("cpu")) == torch.device("cuda", 1)
    monkeypatch.setenv("ZERORUN_DEVICE", "cpu")
    assert _compute_device(torch.device("cpu")) == torch.device("cpu")


def test_init_distributed_picks_nccl_only_with_the_engines_gpu(gpu_node, monkeypatch):
    """Finding 2: init_distributed chose NCCL because CUDA existed while the model stayed on the CPU."""
    import torch.distributed as dist

    from zerorun.deepspeed import comm

    started = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: started.append(backend))
    from zerorun.zero.comm import process_group

    monkeypatch.setattr(process_group, "leave_at_exit", lambda: None)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ZERORUN_DEVICE", "cpu")  # zerorun --nproc on a GPU node
    comm.init_distributed()
    monkeypatch.setenv("ZERORUN_DEVICE", "cuda:1")  # zerorun --gpus
    comm.init_distributed()
    monkeypatch.delenv("ZERORUN_DEVICE")
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun
    comm.init_distributed()
    assert started == ["gloo", "nccl", "nccl"] and gpu_node == [1, 1]
    from zerorun.deepspeed.accelerator import accelerator_kind

    assert accelerator_kind() == "cuda"


def test_an_existing_nccl_group_still_gets_this_workers_gpu_made_current(gpu_node, monkeypatch):
    """Finding 8: with the group already started, no set_device: every rank's all_gather_object
    at save used cuda:0."""
    import torch.distributed as dist

    from zerorun.zero.comm import process_group

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(process_group, "leave_at_exit", lambda: None)  # no exit handler in pytest
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = process_group.resolve_process_group()
    assert info.device == torch.device("cuda", 1) and gpu_node == [1]


def test_telemetry_reads_this_workers_gpu_not_the_threads_current_one(monkeypatch):
    """Finding 4: memory_allocated() with no device, on a thread whose current device is 0."""
    from zerorun.telemetry import recorder

    asked = []

    def counter(name):
        return lambda index=None: asked.append((name, index)) or 0

    cuda = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, device_count=lambda: 2,
        memory_allocated=counter("allocated"), memory_reserved=counter("reserved"),
        max_memory_allocated=counter("peak"), host_memory_stats=lambda: {},
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=80 << 30),
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv("ZERORUN_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    sample = recorder.sample_memory()
    assert sample["cuda_allocated"] == 0 and asked == [("allocated", 1), ("reserved", 1), ("peak", 1)]
    assert recorder._device_info({"LOCAL_RANK": "1"})["device"] == "cuda:1"


def test_construction_restores_the_users_cuda_generators(monkeypatch):
    """Finding 5: fork_rng(devices=[]) + torch.manual_seed reseeded every GPU's generator and
    restored none. Construction on the CPU must not reseed any CUDA generator at all."""
    from zerorun.zero.construct import Materializer

    def reseeded(seed):
        raise AssertionError("construction reseeded the CUDA generators")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded)
    monkeypatch.setattr(torch.cuda, "manual_seed", reseeded)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    materializer = Materializer(model, torch.device("cpu"), seed=3)
    materializer.ensure(list(model.parameters()))
    assert not any(p.is_meta for p in model.parameters())
    assert rng_devices(torch.device("cuda", 2)) == [2] and rng_devices(torch.device("cpu")) == []


def test_a_checkpoint_written_on_gpus_loads_on_this_workers_device(tmp_path):
    """Finding 3: torch.load without map_location put every GPU tensor of engine.pt on cuda:0 (and
    fails outright on a machine without CUDA). Saved here with its storage tagged as cuda:3."""
    from torch import serialization

    marked: set[int] = set()

    def tagger(storage):
        return "cuda:3" if storage.data_ptr() in marked else None

    serialization.register_package(-1, tagger, lambda storage, location: None)
    saved = {"on_gpu": torch.arange(4.0), "rng": torch.ByteTensor([1, 2])}
    marked.add(saved["on_gpu"].untyped_storage().data_ptr())
    torch.save(saved, tmp_path / "engine.pt")
    marked.clear()
    if not torch.cuda.is_available():  # what the unfixed load did here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(tmp_path / "engine.pt", weights_only=True)
    loaded = torch.load(tmp_path / "engine.pt", weights_only=True, map_location=storage_home(torch.device("cpu")))
    assert torch.equal(loaded["on_gpu"], saved["on_gpu"]) and loaded["rng"].device.type == "cpu"


def test_a_master_beside_the_model_for_a_host_shard_is_a_device_copy():
    """Finding 1: stage 3 with offload_param but not offload_optimizer: the fp32 master was the
    host shard itself while the gradient stayed on the GPU ("assigned grad has data of a
    different type" at the first step)."""
    from zerorun.zero.offload.placements import master_source

    gpu, host = torch.device("cuda", 0), torch.device("cpu")
    assert master_source(torch.float32, True, False, host, gpu) == "copy"
    assert master_source(torch.bfloat16, True, False, host, gpu) == "copy"
    assert master_source(torch.float32, True, True, gpu, gpu) == "shard"
    assert master_source(torch.bfloat16, True, True, gpu, gpu) == "fp32 shard"
    assert master_source(torch.bfloat16, False, True, gpu, gpu) == "copy"
    # on a CPU machine the host is the device: the same answers as before
    assert master_source(torch.float32, True, False, host, host) == "shard"


def test_pinned_arena_carves_aligned_pieces_from_power_of_two_blocks():
    """Finding 7: each unit pinned on its own is rounded up to a power of two (up to 2x host
    memory, never counted). The arena's blocks are powers of two, so nothing is lost to
    rounding; what a block's tail leaves unused is counted (slack)."""
    from zerorun.zero.offload import pinned

    mib = 1 << 20
    assert pinned.carve(0, 0, 3 * mib, 0) == (0, pinned.FIRST_BLOCK)  # the first block
    assert pinned.carve(3 * mib, 4 * mib, 100, 3 * mib) == (3 * mib, 0)  # fits: carved in place
    assert pinned.carve(3 * mib + 1, 4 * mib, 100, 3 * mib) == (3 * mib + pinned.ALIGNMENT, 0)  # aligned
    assert pinned.carve(3 * mib, 4 * mib, 2 * mib, 64 * mib) == (0, 16 * mib)  # a quarter of what is out
    assert pinned.carve(0, 4 * mib, 5 * mib, 10**12)[1] == pinned.LARGEST_BLOCK  # ... at most the largest
    assert pinned.carve(0, 4 * mib, 300 * mib, 0) == (0, 512 * mib)  # a huge piece: its own rounded block

    def pinned_bytes(size, count):
        return pinned.reserved_for([size] * count)  # the arena's carving (tested against HostArena)

    for size, count in [(3 * mib + 1, 1000), (5 * mib, 300), (700 << 10, 2000), (40 * mib, 50)]:
        one_by_one = (1 << (size - 1).bit_length()) * count  # what per-piece pinning holds
        assert pinned_bytes(size, count) <= 0.85 * one_by_one, size
    assert pinned_bytes(3 * mib + 1, 1000) <= 1.1 * 1000 * (3 * mib + 1)


def test_a_cpu_placement_pins_nothing_and_counts_no_slack():
    from zerorun.zero.offload.pinned import HostArena
    from zerorun.zero.offload.placements import OnHost

    arena = HostArena(pin=False)
    piece = arena.empty(10, torch.float32)
    assert piece.shape == (10,) and not piece.is_pinned() and arena.reserved == arena.slack() == 0
    home = OnHost()
    shard = home.place_shard(torch.arange(6.0).reshape(2, 3), 0)
    assert torch.equal(shard, torch.arange(6.0).reshape(2, 3)) and home.arena_slack() == 0


def test_init_distributed_asked_for_nccl_without_a_gpu_is_one_line():
    with pytest.raises(RuntimeConfigError, match="^the nccl backend asks for a GPU but this worker sees none"):
        choose_device(TORCHRUN, gpus(0), group_backend="nccl")


def test_staging_copies_on_the_copy_stream_then_orders_the_compute_stream_after_it(monkeypatch):
    """Finding 6: a parameter-offload gather copied the host chunk on the compute stream, so the
    copy waited for all compute queued before it (Note [copy stream] in unit/staging.py). With
    CUDA mocked: the copy is issued inside the copy stream, the compute stream then waits for
    it, and the staged tensor is marked as used by the compute stream (allocator safety)."""
    import contextlib

    from zerorun.zero.unit import staging

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    compute = FakeStream("compute")
    in_stream: list[str] = []

    @contextlib.contextmanager
    def stream_context(stream):
        in_stream.append(stream.name)
        yield
        in_stream.pop()

    class Staged:
        def record_stream(self, stream):
            log.append(f"staged used by {stream.name}")

    class Host:
        def to(self, device, non_blocking=False):
            log.append(f"copy to {device} on {in_stream[-1] if in_stream else 'compute'}, non_blocking={non_blocking}")
            return Staged()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(f"copy{device}"))
    monkeypatch.setattr(torch.cuda, "stream", stream_context)
    monkeypatch.setattr(staging, "_streams", {})
    staging.stage(Host(), torch.device("cuda", 1))
    staging.stage(Host(), torch.device("cuda", 1))  # one copy stream per GPU, made once
    assert log == ["copy to cuda:1 on copy1, non_blocking=True", "compute waits for copy1", "staged used by compute"] * 2
    assert list(staging._streams) == [1]
    assert torch.equal(staging.stage(torch.arange(3.0), torch.device("cpu")), torch.arange(3.0))  # CPU: no stream


@pytest.mark.parametrize("device, environ, expected", [
    ("cuda:0", {"LOCAL_RANK": "3", "SLURM_LOCALID": "3"}, 0),  # Slurm bound one GPU to the task: it is cuda:0
    ("cuda:2", {"LOCAL_RANK": "2"}, 2),                        # torchrun / zerorun --gpus: the same number
    ("cpu", {"SLURM_LOCALID": "1"}, 1),                        # CPU: the local rank, for "== 0" checks
    ("cpu", {}, 0),
])
def test_engine_local_rank_is_the_index_of_the_engines_gpu(device, environ, expected, monkeypatch):
    """DeepSpeed's ``inputs.to(engine.local_rank)`` must land on the engine's device: its local_rank
    is the index of the GPU it trains on, which is not LOCAL_RANK under Slurm's per-task binding."""

    from zerorun.zero.engine_api import DeepSpeedEngineAPI

    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    engine = types.SimpleNamespace(pg=types.SimpleNamespace(device=torch.device(device)))
    local_rank = DeepSpeedEngineAPI.local_rank.fget(engine)  # type: ignore[attr-defined]
    assert local_rank == expected
    if device.startswith("cuda"):
        assert torch.device("cuda", local_rank) == torch.device(device)  # what .to(local_rank) means


class _SavedFiles:
    """A checkpoint Reader stand-in whose every rank file holds the tensors of ``saved``."""

    def __init__(self, saved: dict):
        self._saved = saved

    def file(self, name):
        return self

    def keys(self):
        return list(self._saved)

    def read(self, key):
        return self._saved[key]


def test_loading_rng_in_a_cpu_worker_never_starts_cuda(monkeypatch):
    """A checkpoint written on GPUs carries CUDA generator states; a CPU worker on a GPU node
    restoring it called is_available()/set_rng_state_all, starting the CUDA driver there. Now
    only a process already using CUDA restores them."""
    from zerorun.zero.checkpoint import rng
    from zerorun.zero.checkpoint.reshard import RNG

    cpu_state = torch.get_rng_state()
    saved = {rng.whole_key(RNG, "torch"): cpu_state, rng.whole_key(RNG, "cuda0"): torch.zeros(8)}

    restored = []

    def untouchable(*args):
        raise AssertionError("a CPU worker asked the CUDA driver")

    monkeypatch.setattr(torch.cuda, "is_available", untouchable)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    manifest = {"ranks": [{"rng": json.loads(json.dumps(rng.python_rng()))}]}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    torch.rand(3)
    rng.load_rng(_SavedFiles(saved), manifest, 0)
    assert restored == [] and torch.equal(torch.get_rng_state(), cpu_state)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a GPU worker: restored
    rng.load_rng(_SavedFiles(saved), manifest, 0)
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.zeros(8))


def test_a_rank_resumed_under_another_gpu_binding_gets_its_own_gpus_generator(monkeypatch):
    """Note [own GPU's generator] (checkpoint/rng.py): saved on cuda:3 with four GPUs visible,
    resumed with one GPU visible (cuda:0), the rank's generator is the one it saved. Before,
    every visible GPU's state was saved and restored by index: cuda:0 got GPU 0's, another rank's."""
    from zerorun.zero.checkpoint import rng

    def state(index):
        return torch.full((8,), index, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": state(int(device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state(i) for i in range(4)])
    saved = rng.torch_rng()

    restored: dict[int, torch.Tensor] = {}

    def set_all(states):
        restored.update(enumerate(states))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.__setitem__(int(device), s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    manifest = {"ranks": [{"rng": json.loads(json.dumps(rng.python_rng()))}]}
    rng.load_rng(_SavedFiles(saved), manifest, 0)
    assert torch.equal(restored[0], state(3)), restored
