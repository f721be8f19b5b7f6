"""pytest tests/unit/test_meta_parameters.py — construction that defers parameters only.

``zerorun.meta_parameters()`` (and ``deepspeed.zero.Init``, which uses it) builds a model whose
parameters are on the meta device while what the constructor computes stays real (Note
[parameters only] in zerorun/zero/construct.py): a Llama's rotary ``inv_freq`` equals the eager
model's, a tied parameter stays one object with its attributes, and such a model materialized by
``zerorun.initialize`` computes what the eager model computes. A model built under
``torch.device("meta")``, whose computed buffer is lost, gets one error line that names the
buffer and the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerorun
from zerorun.errors import RuntimeConfigError


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)


class Masked(nn.Module):
    """A causal mask computed in __init__, a weight shared by two layers, a marked parameter."""

    def __init__(self):
        super().__init__()
        shared = nn.Parameter(torch.randn(5, 3))
        shared.no_decay = True
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(3, 5)
        self.a.weight = shared
        self.b.weight = shared
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, x):
        return (self.a(x) + self.b(x)).sum() * self.mask.sum()


def test_parameters_are_deferred_and_buffers_computed():
    from transformers import LlamaForCausalLM

    with zerorun.meta_parameters():
        deferred = LlamaForCausalLM(_llama_config())
        masked = Masked()
    eager = LlamaForCausalLM(_llama_config())
    assert all(p.is_meta for p in deferred.parameters())
    buffers = dict(deferred.named_buffers())
    assert buffers, "Llama has rotary buffers"
    for name, buffer in eager.named_buffers():
        assert not buffers[name].is_meta and torch.equal(buffers[name], buffer), name
    assert masked.a.weight is masked.b.weight and masked.a.weight.is_meta and masked.a.weight.no_decay
    assert torch.equal(masked.mask, torch.tril(torch.ones(4, 4)))
    assert not nn.Linear(2, 2).weight.is_meta  # the context ended: modules are built normally again


def test_a_deferred_model_materializes_and_computes_like_the_eager_one():
    torch.manual_seed(0)
    eager = Masked()
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    with zerorun.meta_parameters():
        model = Masked()
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 3}},
                                weights=state)
    x = torch.randn(2, 3)
    assert torch.allclose(engine(x), eager(x))


def test_a_buffer_lost_on_the_meta_device_is_one_clear_error():
    with torch.device("meta"):
        model = Masked()
    with pytest.raises(RuntimeConfigError) as error:
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 3}})
    assert str(error.value).startswith("buffer 'mask' is still on the meta device after Masked was initialized")
    assert "zerorun.meta_parameters()" in error.value.hint
