"""pytest tests/unit/test_consolidate_like.py — ``consolidate --like`` writes what the model it names can load.

Issue 36 item 7 (Note [names that fit] in zerorun/zero/checkpoint/hf_output.py). A tiny Llama and
a LoRA model on it are trained one step at world size 1 and saved. Before, ``--like BASE`` of the
LoRA checkpoint wrote ``model.safetensors`` with PEFT's wrapped names, which ``from_pretrained``
loaded as a randomly initialised model (21 missing, 29 unexpected keys) without a word. Now a PEFT
checkpoint becomes a PEFT adapter directory that ``PeftModel.from_pretrained`` loads with the
trained model's outputs, and names that do not fit the model are refused in one line, nothing written.
"""

from __future__ import annotations

import json

import pytest
import torch

import zerorun
from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.consolidate import consolidate
from zerorun.zero.checkpoint.format import MANIFEST, manifest_checksum

hf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is in the `test` extra")


def _base():
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _trained(model, tmp_path):
    engine = zerorun.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                                {"zero": {"stage": 1}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.module.eval()
    with torch.no_grad():
        return engine.module(input_ids=ids).logits, ids


def _lora(tmp_path):
    base = _base()
    base.save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    return _trained(model, tmp_path)


def test_a_peft_checkpoint_like_its_base_is_an_adapter_directory_peft_loads(tmp_path):
    logits, ids = _lora(tmp_path)
    done = consolidate(tmp_path / "ckpt", tmp_path / "adapter", like=tmp_path / "base")
    assert done["adapter"] and done["tensors"] == 8  # lora_A and lora_B of q_proj and v_proj, two layers
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 16 and config["r"] == 4 and config["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(hf.LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    loaded.eval()
    with torch.no_grad():
        again = loaded(input_ids=ids).logits
    assert torch.allclose(again, logits, rtol=1e-5, atol=1e-6), (again - logits).abs().max()
    assert not torch.allclose(again, hf.LlamaForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits)


def test_a_peft_checkpoint_without_its_adapter_config_is_refused_naming_the_mismatch(tmp_path):
    _lora(tmp_path)
    path = tmp_path / "ckpt" / "global_step2" / MANIFEST
    manifest = json.loads(path.read_text())
    del manifest["peft"]  # as zerorun saved it before
    manifest["checksum"] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as caught:
        consolidate(tmp_path / "ckpt", tmp_path / "out", like=tmp_path / "base")
    message = str(caught.value)
    assert message.startswith(f"the checkpoint's names do not fit the model of --like '{tmp_path / 'base'}': ")
    assert "names are not in the checkpoint" in message and "\n" not in message
    assert "merge_and_unload" in caught.value.hint
    assert not (tmp_path / "out").exists()


class Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_a_wrapped_model_is_refused_until_its_prefix_is_stripped(tmp_path):
    base = _base()
    base.save_pretrained(tmp_path / "base")
    logits, ids = _trained(Wrapped(base), tmp_path)
    with pytest.raises(CheckpointError, match=r"names do not fit .* \(first 'inner\.") as caught:
        consolidate(tmp_path / "ckpt", tmp_path / "out", like=tmp_path / "base")
    assert "--strip-prefix" in caught.value.hint and not (tmp_path / "out").exists()
    consolidate(tmp_path / "ckpt", tmp_path / "out", like=tmp_path / "base", strip_prefix="inner.")
    loaded = hf.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-6)
