"""Which process group the engine talks over, decided once in ``initialize``.

Order (as the issue states): the default group if the caller initialised one; else one
initialised from the launcher's / torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); else world size 1 with no torch.distributed at all.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerorun.errors import RuntimeConfigError


@dataclass(frozen=True)
class ProcessGroupInfo:
    group: object  # None = the default group (or no group at all when world_size == 1)
    rank: int
    world_size: int
    device: torch.device


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RuntimeConfigError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_process_group(model_device: torch.device) -> ProcessGroupInfo:
    """Join (or create) the group; NCCL only when the model lives on CUDA."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroupInfo(None, dist.get_rank(), dist.get_world_size(), model_device)
    world_size = _env_int("WORLD_SIZE") or 1
    if world_size == 1:
        return ProcessGroupInfo(None, 0, 1, model_device)
    rank = _env_int("RANK")
    if rank is None:
        raise RuntimeConfigError("WORLD_SIZE is set but RANK is not; start workers with zerorun or torchrun")
    for needed in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(needed):
            raise RuntimeConfigError(f"WORLD_SIZE={world_size} but {needed} is not set")
    use_nccl = model_device.type == "cuda" and torch.cuda.is_available()
    if use_nccl:
        local_rank = _env_int("LOCAL_RANK") or 0
        torch.cuda.set_device(local_rank)
        model_device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method="env://", rank=rank, world_size=world_size)
    atexit.register(leave_process_group)
    _watch_for_uncaught_exceptions()
    return ProcessGroupInfo(None, rank, world_size, model_device)


def leave_process_group() -> None:
    """Meet every rank at a barrier, then destroy the group zerorun created (registered at exit).

    Note [clean exit]: a process that exits with its gloo group alive, or destroys it while a
    peer is still finishing its last collective, can abort at interpreter shutdown (SIGABRT,
    "terminate called without an active exception": gloo's threads still hold work objects).
    It is intermittent and shows up under load, and the launcher then rightly reports a failed
    rank. Tearing down together, while the interpreter is still whole, avoids it.

    Only on a clean exit: a rank dying of an uncaught exception must exit at once, so the
    launcher sees it and ends the job, rather than wait at a barrier its peers never reach.
    Other exits (``sys.exit(1)`` on one rank) wait at most ``EXIT_BARRIER_TIMEOUT_S``.
    """
    if _uncaught_exception or not (dist.is_available() and dist.is_initialized()):
        return
    met = threading.Event()

    def meet() -> None:
        try:
            dist.barrier()
            met.set()
        except Exception:  # a peer already failed: the launcher reports that one, not this
            pass

    threading.Thread(target=meet, name="zerorun-exit-barrier", daemon=True).start()
    if met.wait(EXIT_BARRIER_TIMEOUT_S):
        dist.destroy_process_group()


EXIT_BARRIER_TIMEOUT_S = 30.0
_uncaught_exception = False


def _watch_for_uncaught_exceptions() -> None:
    """Chain onto sys.excepthook so leave_process_group knows the script died of an exception."""
    previous = sys.excepthook

    def note(kind, value, traceback) -> None:
        global _uncaught_exception
        _uncaught_exception = True
        previous(kind, value, traceback)

    sys.excepthook = note
