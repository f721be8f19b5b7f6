"""``Compose``, ``ToTensor`` (HWC uint8 -> CHW float in [0, 1]) and ``Normalize`` (per channel)."""

from __future__ import annotations

import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, value):
        for transform in self.transforms:
            value = transform(value)
        return value


class ToTensor:
    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.permute(2, 0, 1).to(torch.float32).div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std
