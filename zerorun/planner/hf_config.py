"""Read a Hugging Face ``config.json`` into a ModelSpec.

GPT-2 and Llama-family configs (llama, mistral) are counted by formula, without importing
transformers. Any other ``model_type`` is built on the meta device by transformers when it
is installed (no memory is allocated), and counted there.
"""

from __future__ import annotations

import json
from pathlib import Path

from zerorun.errors import PlannerError
from zerorun.planner.architecture import ModelSpec, TransformerShape, spec_from_shape

_LLAMA_LIKE = ("llama", "mistral")


def read_hf_config(path: str | Path) -> ModelSpec:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlannerError(f"no Hugging Face config at {str(path)!r}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise PlannerError(f"cannot read Hugging Face config {str(path)!r}: {err}") from None
    if not isinstance(config, dict):
        raise PlannerError(f"Hugging Face config {str(path)!r} is not a JSON object")
    name = config.get("_name_or_path") or path.parent.name or path.name
    try:
        shape = shape_from_hf_dict(config)
    except KeyError as err:
        raise PlannerError(f"Hugging Face config {str(path)!r} lacks key {err.args[0]!r}") from None
    if shape is not None:
        return spec_from_shape(str(name), shape)
    return _count_with_transformers(config, str(name), path)


def shape_from_hf_dict(config: dict) -> TransformerShape | None:
    """The shape of a GPT-2 or Llama-like config; None for any other model_type."""
    model_type = config.get("model_type", "")
    if model_type == "gpt2":
        hidden = config["n_embd"]
        return TransformerShape(
            family="gpt2", layers=config["n_layer"], hidden=hidden, heads=config["n_head"],
            vocab=config["vocab_size"], intermediate=config.get("n_inner") or 4 * hidden,
            kv_heads=config["n_head"], max_positions=config.get("n_positions", 1024),
            tied_embeddings=config.get("tie_word_embeddings", True),
            attention_bias=True, mlp_bias=True,
            dropout=any(config.get(k, 0.1) > 0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
            unfused_gelu=config.get("activation_function", "gelu_new") == "gelu_new",
        )
    if model_type in _LLAMA_LIKE:
        heads = config["num_attention_heads"]
        return TransformerShape(
            family="llama", layers=config["num_hidden_layers"], hidden=config["hidden_size"],
            heads=heads, vocab=config["vocab_size"], intermediate=config["intermediate_size"],
            kv_heads=config.get("num_key_value_heads") or heads,
            tied_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            dropout=config.get("attention_dropout", 0.0) > 0,
        )
    return None


def _count_with_transformers(config: dict, name: str, path: Path) -> ModelSpec:
    try:
        import transformers
    except ImportError:
        raise PlannerError(
            f"model_type {config.get('model_type')!r} in {str(path)!r} needs transformers to count",
            hint="pip install transformers, or use --params with the parameter count",
        ) from None
    from zerorun.planner.counting import count_module

    try:
        hf_config = transformers.AutoConfig.for_model(**config)
        import torch

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as err:  # transformers raises many kinds; the user needs one line
        raise PlannerError(f"transformers cannot build {str(path)!r}: {err}") from None
    return count_module(model, name)
