"""Imported by tests/distributed/test_refresh_ahead.py and test_step_gathers.py: a chain of
Linear layers and a head whose forward never runs (the parent reads its weight through
``F.linear``), so a parameter is read outside its own module's call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, LAYERS = 16, 6


class ChainWithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.linear(x, self.head.weight, self.head.bias)  # read by the parent: the head's forward never runs
