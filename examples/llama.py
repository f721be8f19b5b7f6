"""A Llama-shaped decoder in plain torch, for the GPU benchmark (scripts/bench_gpu.py).

    python examples/llama.py          # prints each preset's parameter count

RMSNorm, rotary position embeddings, multi-head causal attention through
``scaled_dot_product_attention`` (flash kernels on GPU), a SwiGLU MLP and an untied head.
``LlamaBlock`` is the unit for stage-3 gathering, FSDP2 sharding and activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    seq_len: int = 2048
    n_layer: int = 22
    n_head: int = 16
    d_model: int = 2048
    d_ff: int = 5632
    rope_base: float = 10000.0


PRESETS = {
    # 1,261,529,088 parameters: GUIDE §5's "Llama-shaped 1.26B" (TinyLlama's shape without GQA).
    "1.3b": LlamaConfig(),
    # ~0.5M parameters: exercises the GPU benchmark's code on CPU.
    "tiny": LlamaConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=128, d_ff=352),
}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16's 8-bit mantissa loses the mean square of wide activations.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.d_model // cfg.n_head
    inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(cfg.seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd) by the position's angle.
    x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_norm = RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos[:seq], sin[:seq]), apply_rotary(k, cos[:seq], sin[:seq])
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, width))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Rotary tables are constants, not state: kept out of state_dict and out of ZeRO's shards.
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


if __name__ == "__main__":
    with torch.device("meta"):
        for name, cfg in PRESETS.items():
            print(f"{name:>5}: {sum(p.numel() for p in Llama(cfg).parameters()):>14,} parameters  {cfg}")
