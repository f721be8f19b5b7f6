"""What the launcher tells each worker about its device: ``ZERORUN_DEVICE`` (pure).

The worker side, which reads it with everything else a launch path says, is
``zerorun.worker.device`` (Note [device contract] there).
"""

from __future__ import annotations

from zerorun.worker.device import ENV_NAME

__all__ = ["ENV_NAME", "device_for_worker"]


def device_for_worker(kind: str | None, local_rank: int) -> str | None:
    """What the launcher sets for a worker: ``kind`` is "cpu" (--nproc), "cuda" (--gpus) or None."""
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        return f"cuda:{local_rank}"
    return None
