"""What the planner knows about a model: its parameter count, its largest layer, and, when
known, the transformer shape that activations depend on.

Pure data and pure arithmetic. Two transformer families are counted by formula (GPT-2 style
and Llama style); tests check both formulas against a model built on the meta device by
transformers, so the formulas cannot drift from the real modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Family = Literal["gpt2", "llama"]


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a decoder-only transformer; enough to count parameters and activations.

    ``gated_mlp`` is the Llama SwiGLU MLP (three matrices); otherwise the GPT-2 MLP (two).
    ``kv_heads`` < ``heads`` is grouped-query attention.
    """

    family: Family
    layers: int
    hidden: int
    heads: int
    vocab: int
    intermediate: int
    kv_heads: int
    max_positions: int = 0          # learned position embeddings (GPT-2); 0 for rotary
    tied_embeddings: bool = True
    attention_bias: bool = False    # bias on q/k/v/o (GPT-2 always; some Llama-likes)
    mlp_bias: bool = False
    dropout: bool = False           # dropout layers active in training (GPT-2: yes; Llama: no)
    unfused_gelu: bool = False      # GeLU written as Python ops (HF "gelu_new"): saves 3 more s·b·i

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class ModelSpec:
    """A model as the memory model sees it.

    ``largest_layer_params``: elements of the largest single parameter tensor; ZeRO-3 must
    gather at least this much at once, so it sizes the gather buffer (0 = unknown).
    ``param_sizes``: element count of every trained parameter tensor when known (empty for a
    bare ``--params``).
    ``module_tree``: a ``zerorun.zero.unit.plan.ModuleNode`` (``--model``, config.json), else None.
    ``frozen_params``: elements of the parameters that do not train (``requires_grad=False``: a
    LoRA base), counted in ``num_params`` too; known only where a real module was counted.
    """

    name: str
    num_params: int
    largest_layer_params: int = 0
    shape: TransformerShape | None = None
    param_sizes: tuple[int, ...] = field(default=(), repr=False)
    # The module tree (zero/unit/plan.py) when a real module was counted: the planner then
    # sizes stage 3's gathers and buckets with the engine's own unit rules.
    module_tree: object = field(default=None, repr=False, compare=False)
    frozen_params: int = 0

    @property
    def trained_params(self) -> int:
        """Ψ of the gradient and optimizer columns: the parameters that train."""
        return self.num_params - self.frozen_params


def parameter_sizes(shape: TransformerShape) -> list[int]:
    """Element count of every parameter tensor of ``shape``, in module order."""
    h, v = shape.hidden, shape.vocab
    kv = shape.kv_heads * shape.head_dim
    sizes = [v * h]  # token embedding
    if shape.max_positions:
        sizes.append(shape.max_positions * h)
    for _ in range(shape.layers):
        sizes.extend(_layer_sizes(shape, h, kv))
    sizes.extend(_norm_sizes(shape, h))  # final norm
    if not shape.tied_embeddings:
        sizes.append(v * h)  # separate lm_head
    return sizes


def _norm_sizes(shape: TransformerShape, h: int) -> list[int]:
    # LayerNorm has weight and bias; RMSNorm (Llama) only a weight.
    return [h] if shape.family == "llama" else [h, h]


def _layer_sizes(shape: TransformerShape, h: int, kv: int) -> list[int]:
    i = shape.intermediate
    sizes = _norm_sizes(shape, h)
    if shape.family == "gpt2":
        # GPT-2 keeps q, k, v in one Conv1D (h x 3h) with bias, and always has biases.
        sizes += [h * 3 * h, 3 * h, h * h, h]
        sizes += _norm_sizes(shape, h)
        sizes += [h * i, i, i * h, h]
        return sizes
    sizes += [h * h, h * kv, h * kv, h * h]
    if shape.attention_bias:
        sizes += [h, kv, kv, h]
    sizes += _norm_sizes(shape, h)
    sizes += [h * i, h * i, i * h]
    if shape.mlp_bias:
        sizes += [i, i, h]
    return sizes


def spec_from_shape(name: str, shape: TransformerShape) -> ModelSpec:
    sizes = parameter_sizes(shape)
    return ModelSpec(
        name=name,
        num_params=sum(sizes),
        largest_layer_params=max(sizes),
        shape=shape,
        param_sizes=tuple(sizes),
    )
