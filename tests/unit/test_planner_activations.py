"""pytest tests/unit/test_planner_activations.py — the activation formula against autograd.

A small Hugging Face Llama (eager attention, fp32, train mode) runs one forward; every tensor
autograd saves for backward is recorded through ``saved_tensors_hooks`` (each storage once,
parameters excluded). That total is what backward keeps alive, which the formula estimates.
"""

from __future__ import annotations

import pytest
import torch

from zerorun.planner.activations import ActivationJob, activation_bytes
from zerorun.planner.hf_config import shape_from_hf_dict

transformers = pytest.importorskip("transformers")


def saved_for_backward_bytes(model, ids) -> int:
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in params)


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=256, num_attention_heads=4, intermediate_size=688,
        vocab_size=1000, attn_implementation="eager"),
    # GPT-2 with dropout on and HF's Python tanh-GeLU ("gelu_new"), both modelled.
    "gpt2": lambda: transformers.GPT2Config(
        n_layer=3, n_embd=256, n_head=4, vocab_size=1000, n_positions=256, attn_implementation="eager"),
}


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("batch, seq", [(2, 128), (1, 256)])
def test_activation_formula_within_15_percent_of_autograd(family, batch, seq):
    config = CONFIGS[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    measured = saved_for_backward_bytes(model, ids)
    shape = shape_from_hf_dict(config.to_dict())
    estimated = activation_bytes(shape, ActivationJob(batch, seq), q=4)
    assert estimated == pytest.approx(measured, rel=0.15)


def test_the_paper_formula_without_the_gelu_and_dropout_terms_would_miss():
    # Guard that the test above has teeth: the bare 34sbh + 5as²b (fused GeLU) misses HF GPT-2.
    config = CONFIGS["gpt2"]()
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 128))
    shape = shape_from_hf_dict(config.to_dict())
    from dataclasses import replace

    fused = activation_bytes(replace(shape, unfused_gelu=False), ActivationJob(2, 128), q=4)
    assert fused < 0.8 * saved_for_backward_bytes(model, ids)
