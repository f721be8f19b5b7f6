"""Imported by scripts/model_zoo.py: a plain mixture-of-experts language model, one ``nn.Linear``
per expert, for the zoo's MoE set (``causal-lm/plain_moe``).

    python scripts/model_zoo.py --fine --only plain_moe

Each layer routes every token to its top-1 expert and runs only the experts that got tokens, as
Switch Transformers and the per-expert MoE code people write do: with the zoo's skewed batch
(``Setting.skew``) a rank's tokens leave experts idle that the other rank runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F


class PlainMoeLayer(nn.Module):
    def __init__(self, width: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        weights = self.router(x).softmax(-1)
        top, choice = weights.max(-1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero(as_tuple=True)
            if rows[0].numel():  # an expert without tokens is not run
                out[rows] = expert(x[rows]) * top[rows].unsqueeze(-1)
        return hidden + out


class PlainMoe(nn.Module):
    """``PlainMoe(vocab)(input_ids=..., labels=...)`` -> an object with ``.loss``."""

    _no_split_modules = ["PlainMoeLayer"]

    def __init__(self, vocab: int, width: int = 32, layers: int = 2, experts: int = 4):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, use_cache=False)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(PlainMoeLayer(width, experts) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        logits = self.head(hidden)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)
