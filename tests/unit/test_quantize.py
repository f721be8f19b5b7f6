"""pytest tests/unit/test_quantize.py — block-wise int8 quantization (zerorun/zero/comm/quantize.py)
and the ZeRO++ config keys.

The round trip's error on every element is at most half its block's scale (max |x| / 127 / 2),
for any lengths, block sizes and values (hypothesis); the packed buffer is 4 * blocks + n bytes
(n rounded up to 4);
DeepSpeed's three keys map to zerorun's, and each is refused at a stage that lacks its collective.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.config import load_config
from zerorun.errors import ConfigError
from zerorun.zero.comm import quantize

# Any float32 a gradient or weight holds, but below 2**-100 (where a block's scale, max / 127,
# would be subnormal and lose bits; such a block's error is then below 1e-30 anyway).
finite = st.one_of(st.just(0.0), st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
                   st.floats(min_value=-(2.0**100), max_value=-(2.0**-100), width=32))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite, min_size=1, max_size=300), block=st.integers(1, 64))
def test_round_trip_error_is_at_most_half_a_block_scale(values, block):
    x = torch.tensor(values, dtype=torch.float32)
    packed = torch.empty(quantize.packed_nbytes(x.numel(), block), dtype=torch.uint8)
    back = quantize.unpack(quantize.pack(x, block, packed), block, torch.empty_like(x))
    bound = quantize.max_error(x, block)
    # half a scale, plus the float rounding of x / s and of q * s (a few ulps of |x|)
    slack = 4 * torch.finfo(torch.float32).eps * x.abs()
    assert bool(((back - x).abs() <= bound + slack).all()), (x, back, bound)


def test_block_scales_and_sizes():
    x = torch.tensor([0.0, 0.0, 0.0, 1.0, -2.54, 0.5, 3.0], dtype=torch.float32)
    codes, scales = quantize.quantize(x, 3)
    assert scales.tolist() == pytest.approx([0.0, 2.54 / 127, 3.0 / 127])
    assert codes[:3].tolist() == [0, 0, 0]  # an all-zero block reads back exactly
    assert codes[3:6].tolist() == [50, -127, 25]
    assert quantize.packed_nbytes(7, 3) == 4 * 3 + 8  # codes padded to 4 bytes
    assert quantize.packed_nbytes(2048 * 10, 2048) == 2048 * 10 + 40
    assert math.isclose(quantize.packed_nbytes(10**6, 2048) / (4 * 10**6), 0.2505, rel_tol=1e-3)


def test_bf16_output():
    x = torch.linspace(-1, 1, 100)
    out = torch.empty(100, dtype=torch.bfloat16)
    quantize.dequantize(*quantize.quantize(x, 16), 16, out)
    assert (out.float() - x).abs().max() <= 1 / 127 / 2 + 1 / 128  # bf16 keeps 8 bits


def test_deepspeed_keys_map(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, '
                    '"zero_quantized_weights": true, "zero_quantized_gradients": true, '
                    '"zero_quantized_nontrainable_weights": true}}')
    zero = load_config(path, world_size=2).zero
    assert (zero.quantized_weights, zero.quantized_gradients, zero.quantized_nontrainable_weights) == (True, True, True)
    assert zero.quantization_block_size == 2048


@pytest.mark.parametrize(("stage", "key"), [(2, "zero_quantized_weights"), (1, "zero_quantized_gradients"),
                                            (2, "zero_quantized_nontrainable_weights")])
def test_refused_below_its_stage(tmp_path, stage, key):
    path = tmp_path / "ds.json"
    path.write_text(f'{{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": {stage}, "{key}": true}}}}')
    with pytest.raises(ConfigError, match="need ZeRO stage"):
        load_config(path, world_size=2)


def test_off_by_default():
    zero = load_config(None, world_size=2).zero
    assert not (zero.quantized_weights or zero.quantized_gradients or zero.quantized_nontrainable_weights)
