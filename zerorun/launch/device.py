"""Which device a worker uses: the launcher decides, the worker reads ``ZERORUN_DEVICE`` (pure).

Note [device contract]: the launcher knows what it was asked for (``--nproc N``: CPU workers,
``--gpus N``: one GPU each) and passes it to every worker as ``ZERORUN_DEVICE``:

    cpu        a CPU worker (gloo); it must never initialise CUDA, even on a machine with GPUs
    cuda:N     GPU N of those the worker sees (N = LOCAL_RANK; CUDA_VISIBLE_DEVICES applies)
    (unset)    not decided by the launcher (no --nproc/--gpus, or not started by zerorun):
               ``worker_device`` answers "auto" and the caller picks, e.g. cuda:LOCAL_RANK
               when CUDA is available, else cpu

The telemetry recorder, the ``zerorun init`` training template and the runtime's process
group all read it through ``worker_device``, so one decision holds everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

ENV_NAME = "ZERORUN_DEVICE"
AUTO = "auto"
_DEVICE = re.compile(r"^(cpu|cuda:(0|[1-9][0-9]{0,3}))$")


def worker_device(environ: Mapping[str, str]) -> str:
    """``"cpu"``, ``"cuda:N"``, or ``"auto"`` when the launcher did not decide (or sent nonsense)."""
    value = (environ.get(ENV_NAME) or "").strip()
    return value if _DEVICE.match(value) else AUTO


def device_for_worker(kind: str | None, local_rank: int) -> str | None:
    """What the launcher sets for a worker: ``kind`` is "cpu" (--nproc), "cuda" (--gpus) or None."""
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        return f"cuda:{local_rank}"
    return None


def uses_cuda(device: str) -> bool:
    """Whether a worker with this ``worker_device`` answer may touch CUDA at all."""
    return device != "cpu"
