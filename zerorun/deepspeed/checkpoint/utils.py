"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``.

    pytest tests/unit/test_deepspeed_surface.py
"""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of ``item`` (tensors inside lists, tuples and dicts, nested) whose tensors are
    detached clones on ``device``: ``torch.save`` of a view would otherwise write the whole
    storage it views (a flat buffer holding every parameter)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(value, device) for value in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(value, device) for value in item)
    if isinstance(item, dict):
        return type(item)({key: clone_tensors_for_torch_save(value, device) for key, value in item.items()})
    return item
