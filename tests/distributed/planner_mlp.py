"""The model tests/distributed/test_planner_measure.py measures: 8.4M parameters in eight
equal 1024x1024 layers, big enough that the Python/torch process overhead does not drown the
model state, small enough to step in well under a second on one CPU core."""

import torch

WIDTH = 1024
LAYERS = 8


def build() -> torch.nn.Module:
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def example_batch(micro_batch: int, seq_len: int) -> torch.Tensor:
    return torch.randn(micro_batch, WIDTH)
