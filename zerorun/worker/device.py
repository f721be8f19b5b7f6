"""Which device this worker trains on, and the backend that follows from it (Note [device contract]).

    pytest tests/unit/test_device_contract.py

Note [device contract]: one pure function, ``choose_device(environ, count_gpus)``, answers for
every way a worker can be started, and the engine's process group, the DeepSpeed module
(``init_distributed``, ``get_accelerator``), the telemetry recorder and checkpoint loading all
ask it, so they cannot disagree. In order:

1. ``DS_ACCELERATOR=cpu|cuda`` (DeepSpeed's override, set by the user) names the kind;
2. ``ZERORUN_DEVICE`` (set by ``zerorun`` for every worker: ``cpu`` under ``--nproc``,
   ``cuda:LOCAL_RANK`` under ``--gpus``) names the kind and the index;
3. an existing process group (the script called ``init_process_group`` itself) names the kind:
   NCCL means CUDA, gloo alone the CPU, unless the model was built on a GPU (gloo moves CUDA
   tensors too: two ranks sharing one GPU train that way);
4. otherwise (torchrun, ``srun python``, hostfile agents, ``deepspeed.init_distributed``,
   plain ``python``): CUDA when this process sees a GPU, else the CPU.

A CUDA worker's index among the GPUs it sees is the launcher's, else its local rank
(``LOCAL_RANK``; under ``srun python`` ``SLURM_LOCALID``; under MPI the local rank variables),
except where Slurm bound GPUs per task (``--gpus-per-task``, ``--gpu-bind``): such a task sees
only its own GPUs, fewer than ``SLURM_GPUS_ON_NODE`` or fewer than its local id needs, and
trains on the first of them. A local rank with no GPU of its own is one error line, not an
"invalid device ordinal" later. The backend follows the tensors: NCCL if and only if the
device is CUDA (gloo moves CUDA tensors too, and the cuda test tier runs two ranks on one GPU
that way with ``ZERORUN_DEVICE=cuda:0``, but NCCL never moves CPU tensors).

A CPU worker never initialises CUDA: ``count_gpus`` is only called when the answer depends on it.
This module imports neither torch nor the launcher at import time (the recorder reads it
before torch is loaded).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerorun.errors import RuntimeConfigError

if TYPE_CHECKING:
    import torch

ENV_NAME = "ZERORUN_DEVICE"
AUTO = "auto"
_DEVICE = re.compile(r"^(cpu|cuda:(0|[1-9][0-9]{0,3}))$")
# Where each launcher puts a worker's index on its node, first found wins: zerorun, torchrun and
# deepspeed.init_distributed (LOCAL_RANK), srun (SLURM_LOCALID), Open MPI, MPICH.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_FIX = "start one worker per GPU (zerorun --gpus N, torchrun --nproc-per-node N), or set ZERORUN_DEVICE=cpu"


@dataclass(frozen=True)
class DeviceChoice:
    """This worker's device and why; ``backend`` follows from it."""

    device: str  # "cpu" or "cuda:N", N among the GPUs this process sees
    why: str

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.is_cuda else None

    @property
    def backend(self) -> str:
        """NCCL if and only if the tensors are CUDA tensors."""
        return "nccl" if self.is_cuda else "gloo"

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


def worker_device(environ: Mapping[str, str]) -> str:
    """``ZERORUN_DEVICE`` as the launcher wrote it: ``"cpu"``, ``"cuda:N"``, or ``"auto"`` when
    the launcher did not decide (or sent nonsense)."""
    value = (environ.get(ENV_NAME) or "").strip()
    return value if _DEVICE.match(value) else AUTO


def uses_cuda(device: str) -> bool:
    """Whether a worker with this ``worker_device`` answer may touch CUDA at all."""
    return device != "cpu"


def local_rank(environ: Mapping[str, str]) -> int:
    """This worker's index on its node, from the first launcher variable that is set (else 0)."""
    for name in LOCAL_RANK_VARIABLES:
        value = (environ.get(name) or "").strip()
        if value:
            if not value.isdigit():
                raise RuntimeConfigError(f"{name}={value!r} is not a non-negative integer",
                                         hint="it is the worker's index on its node, set by its launcher")
            return int(value)
    return 0


def _count(value: str | None) -> int | None:
    """Slurm's GPU counts: ``4`` or ``h100:4`` (the type is dropped)."""
    match = re.fullmatch(r"\s*(?:[\w.-]+:)?(\d+)\s*", value or "")
    return int(match.group(1)) if match else None


def slurm_bound_per_task(environ: Mapping[str, str], visible: int, local: int) -> bool:
    """Whether Slurm gave this task its own GPUs (``--gpus-per-task``, ``--gpu-bind``): then the
    task sees only them, and its first visible GPU is its GPU whatever its local id. Only for a
    process srun started itself (``srun python``): a launcher's worker under srun (torchrun's,
    zerorun's: they set LOCAL_WORLD_SIZE) indexes the GPUs its launcher's task sees by its own
    local rank."""
    if not (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")) or visible < 1:
        return False
    slurm_local = (environ.get("SLURM_LOCALID") or "").strip()
    if "LOCAL_WORLD_SIZE" in environ or slurm_local != str(local):
        return False
    on_node = _count(environ.get("SLURM_GPUS_ON_NODE"))
    # --gpu-bind without a count sets neither variable: the task sees fewer GPUs than its id needs.
    return (on_node is not None and visible < on_node) or bool(_count(environ.get("SLURM_GPUS_PER_TASK"))) \
        or local >= visible


def _constraint(group_backend: str | None) -> str | None:
    """What an existing group says: "cuda" (NCCL only), "cpu" (gloo only) or None (both, none)."""
    if not group_backend:
        return None
    names = group_backend.lower()
    nccl, gloo = "nccl" in names, "gloo" in names
    if nccl and not gloo:
        return "cuda"
    if gloo and not nccl:
        return "cpu"
    return None


def _named_kind(environ: Mapping[str, str], group_backend: str | None,
                built_on: str | None = None) -> tuple[str, str, str | None]:
    """Steps 1-3 of Note [device contract]: "cpu", "cuda" or AUTO, why, and the "cuda:N" that
    names the index where one does."""
    named = (environ.get("DS_ACCELERATOR") or "").strip().lower()
    decided = worker_device(environ)
    existing = _constraint(group_backend)
    if named in ("cpu", "cuda"):
        return named, f"DS_ACCELERATOR={named}", decided if decided.startswith("cuda:") else None
    if decided != AUTO:
        return decided.split(":")[0], f"{ENV_NAME}={decided} (the launcher's choice)", decided
    if existing == "cpu" and built_on is not None and built_on.startswith("cuda"):
        # gloo moves CUDA tensors: a script that chose gloo for a model it put on a GPU keeps it there
        return "cuda", f"the {group_backend} backend and a model built on {built_on}", built_on if ":" in built_on else None
    if existing is not None:
        return existing, f"the {group_backend} backend", None
    return AUTO, "", None


def device_kind(environ: Mapping[str, str], count_gpus: Callable[[], int], group_backend: str | None = None) -> str:
    """"cpu" or "cuda", the kind ``choose_device`` picks, without checking the index (pure)."""
    kind, _, _ = _named_kind(environ, group_backend)
    if kind != AUTO:
        return kind
    return "cuda" if count_gpus() > 0 else "cpu"


def choose_device(environ: Mapping[str, str], count_gpus: Callable[[], int],
                  group_backend: str | None = None, built_on: str | None = None) -> DeviceChoice:
    """Note [device contract]: this worker's device (pure; ``count_gpus()`` is the GPUs this
    process sees, asked only when needed; ``built_on`` is where the model was built, which
    matters only beside a gloo group the script started). Raises RuntimeConfigError, one
    line, when the environment asks for a GPU this worker does not have."""
    existing = _constraint(group_backend)
    kind, why, named_index = _named_kind(environ, group_backend, built_on)
    if kind == "cpu":
        if existing == "cuda":
            raise RuntimeConfigError(f"the process group uses NCCL but this worker trains on the CPU ({why})",
                                     hint="NCCL moves only CUDA tensors: start the group with gloo, or train on a GPU")
        return DeviceChoice("cpu", why)
    visible = count_gpus()
    if visible < 1:
        if kind == "cuda":
            shown = environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
            raise RuntimeConfigError(f"{why} asks for a GPU but this worker sees none{where}",
                                     hint="run on a machine with a GPU, or train on the CPU (zerorun --nproc N)")
        return DeviceChoice("cpu", "no GPU visible")
    if named_index is not None:
        if int(named_index.split(":")[1]) >= visible:
            raise RuntimeConfigError(f"{named_index} is not a GPU this worker has ({why}; it sees {visible})",
                                     hint=_FIX)
        return DeviceChoice(named_index, why)
    local = local_rank(environ)
    if slurm_bound_per_task(environ, visible, local):
        return DeviceChoice("cuda:0", why or "Slurm bound this task's GPUs (its first)")
    if local >= visible:
        shown = environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise RuntimeConfigError(f"local rank {local} has no GPU of its own: this worker sees {visible} GPU(s){where}",
                                 hint=_FIX)
    return DeviceChoice(f"cuda:{local}", why or f"GPU {local} of {visible} visible (local rank {local})")


def visible_gpus() -> int:
    """GPUs this process sees (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def this_worker(group_backend: str | None = None, environ: Mapping[str, str] | None = None,
                built_on: str | None = None) -> DeviceChoice:
    """``choose_device`` for this process; ``group_backend`` defaults to the existing group's."""
    if group_backend is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group_backend = str(dist.get_backend())
    return choose_device(os.environ if environ is None else environ, visible_gpus, group_backend, built_on)


def bind(choice: DeviceChoice) -> None:
    """Make this worker's GPU the current one, so collectives, ``all_gather_object`` and
    allocations without a device land on it (every rank would use cuda:0 otherwise); and
    remember the choice for the telemetry thread (``bound``)."""
    global _bound
    _bound = choice
    if choice.is_cuda:
        import torch

        torch.cuda.set_device(choice.index)


_bound: DeviceChoice | None = None


def bound() -> DeviceChoice | None:
    """The device the engine bound this worker to (``bind``), None before: what the process
    group and the model's device decided, which the environment alone cannot tell (a group the
    script started with gloo, a model it built on another GPU)."""
    return _bound


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA generators a ``fork_rng`` around work on ``device`` must save and restore."""
    return [device.index or 0] if device.type == "cuda" else []


def seed_generators(device: torch.device, seed: int) -> None:
    """Seed the CPU generator and, for a GPU, that GPU's alone (the ones ``rng_devices`` restores)."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device.index or 0):
            torch.cuda.manual_seed(seed)


def storage_home(device: torch.device) -> Callable:
    """``torch.load``'s ``map_location`` for this worker: what was saved on any GPU comes back on
    this worker's device (a CPU worker: the CPU), what was saved on the CPU stays there (RNG
    states must be CPU tensors), so a checkpoint written on GPUs resumes on any machine."""

    def place(storage, location: str):
        if not location.startswith("cuda") or device.type != "cuda":
            return storage
        return storage.cuda(device.index or 0)

    return place
