"""``deepspeed.comm``: starting the process group and the collectives scripts call themselves.

    pytest tests/unit/test_deepspeed_module.py -k comm

``init_distributed`` finds who this process is the way DeepSpeed does: the launcher's variables
(zerorun's and torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), else Slurm's
(SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), else MPI's (Open MPI's OMPI_COMM_WORLD_*, MPICH's
PMI_*), else a world of one on this machine. It writes what it found back to the environment, as
DeepSpeed's MPI discovery does, so the engine and a script reading ``LOCAL_RANK`` agree. The
group it starts is left at exit like the engine's own (Note [clean exit] in
zero/comm/process_group.py).

The collectives are torch.distributed's own functions (DeepSpeed's wrap the same calls): a
script's collectives are its own business; the engine's go through zero/comm/collectives.py.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import (  # noqa: F401  (DeepSpeed re-exports these names)
    ReduceOp, all_gather, all_gather_into_tensor, all_gather_object, all_reduce, all_to_all_single, barrier,
    broadcast, broadcast_object_list, gather, get_global_rank, irecv, isend, new_group, recv, reduce,
    reduce_scatter, reduce_scatter_tensor, scatter, send,
)

from zerorun.errors import LaunchError
from zerorun.worker import device

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def discover(environ, distributed_port: int = DEFAULT_PORT) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT from the first scheme that has them
    (pure in ``environ``; a world of one needs a free port, found by the caller)."""
    def take(rank, world, local):
        found = {"RANK": environ[rank], "WORLD_SIZE": environ[world], "LOCAL_RANK": environ.get(local, "0")}
        found["MASTER_ADDR"] = environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR") or ""
        found["MASTER_PORT"] = environ.get("MASTER_PORT") or str(distributed_port)
        return found

    if "RANK" in environ and "WORLD_SIZE" in environ:
        return take("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return take("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        return take("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    if "PMI_RANK" in environ and "PMI_SIZE" in environ:
        return take("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ""}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start the default process group unless one exists (DeepSpeed's signature)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if init_method is None:
        found = discover(os.environ, distributed_port)
        if found["WORLD_SIZE"] != "1" and not found["MASTER_ADDR"]:
            raise LaunchError(f"this is rank {found['RANK']} of {found['WORLD_SIZE']} but no MASTER_ADDR is set",
                              hint="start the script with zerorun (or torchrun), or export MASTER_ADDR")
        if not found["MASTER_PORT"]:
            found["MASTER_PORT"] = str(_free_port())
        for name, value in found.items():
            os.environ.setdefault(name, value)
        rank, world_size = int(found["RANK"]), int(found["WORLD_SIZE"])
    # The engine's device and backend (Note [device contract] in zerorun/worker/device.py): NCCL
    # only when the model will be on this worker's GPU, which is made current before the group.
    choice = device.this_worker(group_backend=dist_backend)
    device.bind(choice)
    dist_backend = dist_backend or choice.backend
    from zerorun.zero.comm import rendezvous

    secret = rendezvous.secret_for(os.environ) if init_method in (None, "env://") else None
    if secret is not None:  # started by zerorun: Note [authenticated rendezvous]
        rendezvous.init_signed(dist_backend, rank, world_size, secret, timeout)
    else:
        dist.init_process_group(dist_backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timeout)  # None: torch's default for the backend
    # Leave at exit the way the engine leaves a group it started (Note [clean exit]).
    from zerorun.zero.comm import process_group

    process_group.leave_at_exit()


def _require_group(name: str) -> None:
    if not dist.is_initialized():
        raise LaunchError(f"deepspeed.comm.{name}() needs the process group",
                          hint="call deepspeed.init_distributed() (or deepspeed.initialize()) first")


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    _require_group("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _require_group("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK") or 0)


def get_backend(group=None) -> str:
    _require_group("get_backend")
    return dist.get_backend(group)


def destroy_process_group(group=None) -> None:
    from zerorun.zero.comm.process_group import leave_together

    leave_together(group)
