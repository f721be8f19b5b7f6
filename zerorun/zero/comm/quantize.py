"""Block-wise int8 quantization for ZeRO++'s quantized collectives (qwZ, qgZ); pure tensor math.

    pytest tests/unit/test_quantize.py

A flat tensor of n elements is cut into blocks of ``block`` elements (the last one shorter).
Each block b keeps one fp32 scale s_b = max|x| over the block / 127 and int8 codes
q = round(x / s_b), so x is read back as q * s_b. Rounding to nearest makes the error of
every element at most s_b / 2, half the block's scale (tests/unit/test_quantize.py checks it
with hypothesis); an all-zero block has scale 0 and reads back exactly.

Note [packed layout]: what crosses the wire is one uint8 buffer per tensor, the ceil(n / block)
fp32 scales first, then the n codes, padded to a multiple of 4 bytes, so that the scales of every
part of a buffer holding several (one per rank) stay 4-byte aligned and can be viewed as fp32. A
quantized collective is then one ordinary collective of ``packed_nbytes(n, block)`` bytes: about
n + 4n/block, a quarter of fp32's 4n for the default block of 2048 (0.2% of it scales).
"""

from __future__ import annotations

import torch

LEVELS = 127  # symmetric int8: codes in [-127, 127]


def block_count(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_nbytes(numel: int, block: int) -> int:
    """Note [packed layout]: one fp32 scale per block, then the codes, rounded up to 4 bytes."""
    return 4 * block_count(numel, block) + -(-numel // 4) * 4


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (int8 codes of x's length, fp32 scales, one per block)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = block_count(n, block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block codes as zeros
    codes = torch.round(padded / safe[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Write codes * their block's scale into ``out`` (any float dtype, codes' length)."""
    n = codes.numel()
    per_element = scales.repeat_interleave(block)[:n]
    out.view(-1).copy_(codes.float() * per_element)
    return out


def pack(x: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` into the uint8 buffer ``out`` of ``packed_nbytes(x.numel(), block)`` bytes."""
    n = x.numel()
    codes, scales = quantize(x, block)
    head = scales.numel() * 4
    out[:head].copy_(scales.view(torch.uint8))
    out[head : head + n].copy_(codes.view(torch.uint8))
    return out


def unpack(packed: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Read a packed buffer (Note [packed layout]) back into ``out`` of the original length."""
    n = out.numel()
    head = 4 * block_count(n, block)
    scales = packed[:head].view(torch.float32)
    codes = packed[head : head + n].view(torch.int8)
    return dequantize(codes, scales, block, out)


def max_error(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the bound on |x - unpack(pack(x))|: half of its block's scale."""
    _, scales = quantize(x, block)
    return (scales / 2).repeat_interleave(block)[: x.numel()]
