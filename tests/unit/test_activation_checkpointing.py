"""pytest tests/unit/test_activation_checkpointing.py — the activation checkpointing helper."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zerorun.config import ActivationCheckpointingConfig
from zerorun.errors import RuntimeConfigError
from zerorun.zero.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_from_config,
    is_checkpointed,
    is_recomputing,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, Block, GPTConfig, synthetic_batch  # noqa: E402

CFG = GPTConfig(vocab_size=37, seq_len=16, n_layer=2, n_head=2, d_model=30, dropout=0.1)


def _loss_and_grads(model: nn.Module, seed: int = 0):
    tokens, targets = synthetic_batch(CFG, 3, step=1)
    torch.manual_seed(seed)  # dropout masks: the recomputation must reproduce them
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointed_model_gives_identical_loss_and_gradients():
    torch.manual_seed(0)
    reference = GPT(CFG)
    checkpointed = copy.deepcopy(reference)
    wrapped = apply_activation_checkpointing(checkpointed, ["Block"])
    assert wrapped == ["blocks.0", "blocks.1"]
    ref_loss, ref_grads = _loss_and_grads(reference)
    ck_loss, ck_grads = _loss_and_grads(checkpointed)
    assert torch.equal(ref_loss, ck_loss)
    assert ref_grads.keys() == ck_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(ck_grads[name], ref_grads[name], rtol=0, atol=1e-6, msg=name)


def test_recomputation_reruns_the_wrapped_modules_own_hooks():
    """Stage 3 gathers in forward pre-hooks: they must fire again when backward recomputes."""
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_activation_checkpointing(model, ["Block"])
    calls: list[tuple[str, bool]] = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(("pre", is_recomputing())))
    model.blocks[0].register_forward_hook(lambda m, a, o: calls.append(("post", is_recomputing())))
    tokens, targets = synthetic_batch(CFG, 2, step=0)
    loss = model(tokens, targets)
    assert calls == [("pre", False), ("post", False)]
    loss.backward()
    # Complete recomputation (no early stop), flagged so stage 3 keeps its parameters gathered.
    assert calls == [("pre", False), ("post", False), ("pre", True), ("post", True)]
    assert not is_recomputing()


def test_a_wrapper_that_subclasses_again_does_not_recurse():
    """FSDP2's fully_shard (and maybe others) swap the instance's class for a subclass of it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    apply_activation_checkpointing(model, ["Block"])
    for block in model.blocks:
        block.__class__ = type("Wrapped" + type(block).__name__, (type(block),), {})
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: calls.append(is_recomputing()))
    tokens, targets = synthetic_batch(CFG, 2, step=0)
    model(tokens, targets).backward()
    assert calls == [False, True]


def test_no_recomputation_without_grad_and_names_are_unchanged():
    torch.manual_seed(0)
    model = GPT(CFG)
    names_before = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, ["Block", "Block"])
    apply_activation_checkpointing(model, ["Block"])  # applying twice must not nest
    assert [n for n, _ in model.named_parameters()] == names_before
    assert isinstance(model.blocks[0], Block) and type(model.blocks[0]).__name__ == "Block"
    assert type(model.blocks[0]).__mro__[1] is Block
    calls = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    with torch.no_grad():
        model(synthetic_batch(CFG, 1, step=0)[0])
    assert calls == [1]


def test_unknown_class_name_is_a_user_error():
    with pytest.raises(RuntimeConfigError, match="'Blok'") as err:
        apply_activation_checkpointing(GPT(CFG), ["Blok"])
    assert "Block" in err.value.hint


def test_config_driven_entry_point():
    model = GPT(CFG)
    assert apply_from_config(model, ActivationCheckpointingConfig(enabled=False, modules=["Block"])) == []
    assert not is_checkpointed(model.blocks[0])
    with pytest.raises(RuntimeConfigError, match="modules is empty"):
        apply_from_config(model, ActivationCheckpointingConfig(enabled=True, modules=[]))
    assert apply_from_config(model, ActivationCheckpointingConfig(enabled=True, modules=["MLP"])) == [
        "blocks.0.mlp",
        "blocks.1.mlp",
    ]
