"""Named model shapes for ``zerorun estimate --preset NAME``: the GPT-2 and Llama sizes.

Shapes follow the published configs (GPT-2: 1024 positions, 50257 tokens, tied embeddings;
Llama 1/2: 32000 tokens, untied lm_head; Llama 3: 128256 tokens, grouped-query attention).
"""

from __future__ import annotations

import difflib

from zerorun.errors import PlannerError
from zerorun.planner.architecture import ModelSpec, TransformerShape, spec_from_shape


def _gpt2(layers: int, hidden: int, heads: int) -> TransformerShape:
    return TransformerShape(
        family="gpt2", layers=layers, hidden=hidden, heads=heads, vocab=50257,
        intermediate=4 * hidden, kv_heads=heads, max_positions=1024, tied_embeddings=True,
        attention_bias=True, mlp_bias=True, dropout=True, unfused_gelu=True,
    )


def _llama(layers: int, hidden: int, heads: int, intermediate: int, *, kv_heads: int | None = None,
           vocab: int = 32000) -> TransformerShape:
    return TransformerShape(
        family="llama", layers=layers, hidden=hidden, heads=heads, vocab=vocab,
        intermediate=intermediate, kv_heads=kv_heads or heads, tied_embeddings=False,
    )


PRESETS: dict[str, TransformerShape] = {
    "gpt2": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "llama-7b": _llama(32, 4096, 32, 11008),
    "llama-13b": _llama(40, 5120, 40, 13824),
    "llama-30b": _llama(60, 6656, 52, 17920),
    "llama-65b": _llama(80, 8192, 64, 22016),
    "llama-70b": _llama(80, 8192, 64, 28672, kv_heads=8),
    "llama3-8b": _llama(32, 4096, 32, 14336, kv_heads=8, vocab=128256),
    "llama3-70b": _llama(80, 8192, 64, 28672, kv_heads=8, vocab=128256),
    # examples/gpt.py's "bench" preset (33,674,240 parameters), the benchmarks' model: GPT-2's shape
    "gpt-bench": TransformerShape(family="gpt2", layers=8, hidden=512, heads=8, vocab=16384, intermediate=2048,
                                  kv_heads=8, max_positions=128, tied_embeddings=True, attention_bias=True,
                                  mlp_bias=True),
}


def preset_spec(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PlannerError(
            f"unknown preset {name!r}",
            hint=f"{hint}known presets: {', '.join(PRESETS)}",
        )
    return spec_from_shape(key, PRESETS[key])
