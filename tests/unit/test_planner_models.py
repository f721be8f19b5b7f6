"""pytest tests/unit/test_planner_models.py: size parsing, presets, config.json and meta counting.

Formula counts are checked against the same models built on the meta device by transformers,
so the formulas cannot drift from the real modules.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.errors import PlannerError
from zerorun.planner.counting import build_on_meta, count_module, load_factory, spec_from_factory
from zerorun.planner.hf_config import read_hf_config
from zerorun.planner.presets import PRESETS, preset_spec
from zerorun.planner.quantities import format_count, parse_bytes, parse_count

transformers = pytest.importorskip("transformers")

MULTIPLIERS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@pytest.mark.parametrize("text, expected", [
    ("7B", 7_000_000_000), ("1.3b", 1_300_000_000), ("350M", 350_000_000),
    ("124439808", 124_439_808), ("7e9", 7_000_000_000), (" 70 B ", 70_000_000_000), ("2k", 2000),
])
def test_parse_count_examples(text, expected):
    assert parse_count(text) == expected


@settings(max_examples=300, deadline=None)
@given(whole=st.integers(1, 999_999), suffix=st.sampled_from(list(MULTIPLIERS)), lower=st.booleans())
def test_parse_count_whole_numbers_with_suffix(whole, suffix, lower):
    text = f"{whole}{suffix.lower() if lower else suffix}"
    assert parse_count(text) == whole * MULTIPLIERS[suffix]


@settings(max_examples=300, deadline=None)
@given(tenths=st.integers(1, 99_999), suffix=st.sampled_from(["M", "B", "T"]))
def test_parse_count_decimals(tenths, suffix):
    text = f"{tenths // 10}.{tenths % 10}{suffix}"
    assert parse_count(text) == tenths * MULTIPLIERS[suffix] // 10


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=12))
def test_parse_count_never_raises_anything_but_planner_error(text):
    try:
        value = parse_count(text)
    except PlannerError:
        return
    assert isinstance(value, int) and value > 0


@pytest.mark.parametrize("text", ["7Q", "", "B", "-7B", "0", "seven", "7BB", "nan", "1e999B"])
def test_parse_count_rejects(text):
    with pytest.raises(PlannerError):
        parse_count(text)


def test_parse_bytes_units():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    for bad in ("80XB", "-1GB", "GB"):
        with pytest.raises(PlannerError):
            parse_bytes(bad)


def test_format_count():
    assert format_count(124_439_808) == "124.4M"
    assert format_count(6_738_415_616) == "6.74B"
    assert format_count(7_000_000_000) == "7B"


# Published totals of the reference models (from their model cards / checkpoints).
@pytest.mark.parametrize("name, published", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-xl", 1_557_611_200),
    ("llama-7b", 6_738_415_616), ("llama-13b", 13_015_864_320), ("llama-70b", 68_976_648_192),
    ("llama3-8b", 8_030_261_248),
])
def test_presets_match_published_counts(name, published):
    assert preset_spec(name).num_params == published


def test_unknown_preset_suggests_the_close_name():
    with pytest.raises(PlannerError) as err:
        preset_spec("lama-7b")
    assert "llama-7b" in err.value.hint


def _meta_count(config) -> object:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return count_module(model, "reference")


HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "gpt2-untied-inner": lambda: transformers.GPT2Config(
        n_layer=3, n_embd=48, n_head=4, vocab_size=777, n_positions=64, n_inner=100, tie_word_embeddings=False),
    "llama-gqa": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=176, vocab_size=1000),
    "llama-tied-bias": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96,
        vocab_size=500, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": lambda: transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=300),
    "opt (no formula: built on meta)": lambda: transformers.OPTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128, vocab_size=300,
        word_embed_proj_dim=64, max_position_embeddings=64),
}


@pytest.mark.parametrize("key", list(HF_CONFIGS))
def test_hf_config_counts_match_meta_built_model(key, tmp_path):
    config = HF_CONFIGS[key]()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    ours = read_hf_config(path)
    reference = _meta_count(config)
    assert ours.num_params == reference.num_params
    assert sorted(ours.param_sizes) == sorted(reference.param_sizes)


def test_preset_formula_matches_transformers_for_full_gpt2_shape():
    shape = PRESETS["gpt2"]
    config = transformers.GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads)
    assert _meta_count(config).num_params == preset_spec("gpt2").num_params


@pytest.mark.parametrize("content, message", [
    (None, "no Hugging Face config"), ("{not json", "cannot read"), ('{"model_type": "gpt2"}', "lacks key"),
])
def test_bad_hf_configs(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlannerError, match=message):
        read_hf_config(path)


FACTORY_FILE = '''
import torch

class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)
        self.body = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once

def build():
    return Tied()

def not_a_model():
    return 42
'''


def test_model_factory_is_built_on_meta_and_counts_tied_weights_once(tmp_path):
    path = tmp_path / "factory_for_planner_test.py"
    path.write_text(FACTORY_FILE)
    model = build_on_meta(load_factory(f"{path}:build"))
    assert all(p.device.type == "meta" for p in model.parameters())
    spec = spec_from_factory(f"{path}:build")
    assert spec.num_params == 1000 * 64 + 64 * 64 + 64
    assert spec.largest_layer_params == 1000 * 64
    with pytest.raises(PlannerError, match="not a torch.nn.Module"):
        spec_from_factory(f"{path}:not_a_model")
    with pytest.raises(PlannerError, match="no function"):
        spec_from_factory(f"{path}:missing")


@pytest.mark.parametrize("target", ["nocolon", "no_such_module_xyz:build", ":build", "missing.py:build"])
def test_bad_model_targets(target):
    with pytest.raises(PlannerError):
        spec_from_factory(target)
