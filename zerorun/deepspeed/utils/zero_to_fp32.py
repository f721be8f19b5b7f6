"""``deepspeed.utils.zero_to_fp32`` over zerorun checkpoints (``zerorun consolidate`` underneath).

    pytest tests/distributed/test_deepspeed_zero.py -k fp32

A zerorun checkpoint directory (the one ``engine.save_checkpoint`` wrote, with its ``latest``
file, or one tag's directory) stands where DeepSpeed's does; the result is the full model in
fp32, each tied parameter under every one of its names, as DeepSpeed's functions return it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    from zerorun.zero.checkpoint.consolidate import consolidate
    from zerorun.zero.checkpoint.format import read_manifest, resolve

    with tempfile.TemporaryDirectory(prefix="zerorun-fp32-") as scratch:
        target = Path(scratch) / "model.pt"
        consolidate(checkpoint_dir, target, tag=tag, fmt="torch", dtype="fp32")
        state = torch.load(target, map_location="cpu", weights_only=True)
    if exclude_frozen_parameters:
        directory = resolve(checkpoint_dir, tag)
        assert directory is not None  # consolidate() has just read this very checkpoint
        parameters = read_manifest(directory)["parameters"]
        frozen = {name for name, info in parameters.items() if not info["trainable"]}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write ``output_dir/pytorch_model.bin`` (or ``model.safetensors``), in fp32, unsharded."""
    from zerorun.zero.checkpoint.consolidate import consolidate

    os.makedirs(output_dir, exist_ok=True)
    name, fmt = ("model.safetensors", "safetensors") if safe_serialization else ("pytorch_model.bin", "torch")
    consolidate(checkpoint_dir, Path(output_dir) / name, tag=tag, fmt=fmt, dtype="fp32")


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the fp32 weights into ``model`` on the CPU and return it (DeepSpeed's behaviour)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
