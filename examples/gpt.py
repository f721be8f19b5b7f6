"""A small GPT in plain torch, with size presets and a synthetic, learnable token stream.

    python examples/gpt.py            # prints each preset's parameter count

Used by the demo (examples/train_gpt.py), the benchmarks (scripts/bench_*.py) and tests. The
model is deliberately ordinary: token + position embeddings, pre-norm blocks of causal
self-attention and an MLP, a final norm, and a head tied to the token embedding (so ZeRO has a
shared parameter to handle). Nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must divide by n_head={self.n_head}")


PRESETS: dict[str, GPTConfig] = {
    # ~0.1M parameters: distributed tests, where every rank is a process on a shared CPU.
    "nano": GPTConfig(vocab_size=128, seq_len=32, n_layer=2, n_head=2, d_model=64),
    # ~1.5M parameters: the demo and e2e tests; trains visibly in seconds on 2 CPU cores.
    "tiny": GPTConfig(vocab_size=1024, seq_len=64, n_layer=3, n_head=4, d_model=192),
    # ~33.7M parameters (33,674,240): the CPU benchmark model of GUIDE §5 (micro-batch 4 x 128).
    "bench": GPTConfig(vocab_size=16384, seq_len=128, n_layer=8, n_head=8, d_model=512),
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {', '.join(PRESETS)}") from None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (batch, seq, width) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: the unit for stage-3 gathering and activation checkpointing."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Tied: the head and the token embedding are one Parameter (registered twice).
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab), or the mean cross-entropy loss when ``targets`` is given."""
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than seq_len={self.cfg.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied head counts once, as model.parameters() yields it once)."""
    return sum(p.numel() for p in model.parameters())


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, *, step: int, seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (tokens, targets) batch for ``step``: same seed and step -> same batch.

    Each sequence is an arithmetic progression modulo a small alphabet with a random start and
    a random stride from a few choices: next-token prediction is learnable from context (read
    the stride off the last two tokens), so the loss falls visibly within tens of steps, yet
    no two batches repeat. Data-parallel callers draw the GLOBAL batch and slice their rank's
    rows, so every world size trains on exactly the same samples.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    alphabet = min(cfg.vocab_size, 64)
    length = cfg.seq_len + 1
    start = torch.randint(0, alphabet, (batch_size, 1), generator=generator)
    strides = torch.tensor([1, 2, 3, 5])
    stride = strides[torch.randint(0, len(strides), (batch_size, 1), generator=generator)]
    sequence = (start + stride * torch.arange(length)) % alphabet
    sequence = sequence.to(device)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a global batch (its size must divide by the world size)."""
    if batch.shape[0] % world_size:
        raise ValueError(f"global batch of {batch.shape[0]} does not divide by world size {world_size}")
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


if __name__ == "__main__":
    for name, cfg in PRESETS.items():
        print(f"{name:>6}: {count_parameters(GPT(cfg)):>12,} parameters  {cfg}")
