"""``deepspeed.checkpointing``: DeepSpeed's activation-checkpointing calls in model code.

    pytest tests/unit/test_deepspeed_module.py -k checkpointing

Megatron-style models call ``deepspeed.checkpointing.checkpoint(function, *args)`` around each
block and ``deepspeed.checkpointing.configure(...)`` once. ``checkpoint`` recomputes the block in
backward as DeepSpeed's does (torch.utils.checkpoint, non-reentrant: it needs no input that
requires grad and keeps the RNG state, so dropout draws the same masks). ``configure`` accepts
the options that tune where DeepSpeed keeps the saved activations (partitioned, contiguous, on
the CPU), which have no effect here; a model-parallel unit (``mpu_``) is refused, as is every
model-parallel RNG helper: zerorun shards data-parallel training only.
"""

from __future__ import annotations

import torch.utils.checkpoint

from zerorun.deepspeed.unsupported import module_getattr, refuse

_configured = False


def checkpoint(function, *args):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    global _configured
    if mpu_ is not None:
        raise refuse("deepspeed.checkpointing.configure(mpu_=...)", "model parallelism")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its partitioned-activation buffers here; there are none to free."""


__getattr__ = module_getattr("deepspeed.checkpointing", "model-parallel activation checkpointing")
