"""Activation memory of a decoder-only transformer for one micro-batch (pure).

ZeRO shards model state, never activations: every rank holds the activations of its own
micro-batch, so this figure is per GPU and does not shrink with the number of ranks.

The counting follows Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), Section 4.1, generalised to any MLP width and to the gated
(SwiGLU) MLP. Symbols: b micro-batch, s sequence length, h hidden, a heads, i MLP width,
V vocabulary, L layers, q bytes per activation element (2 in 16-bit training, 4 in fp32).
docs/estimate.md derives every term.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.planner.architecture import TransformerShape


@dataclass(frozen=True)
class ActivationJob:
    micro_batch: int
    seq_len: int
    checkpointing: bool = False


def layer_activation_bytes(shape: TransformerShape, job: ActivationJob, q: int) -> float:
    """Bytes one transformer layer keeps for backward when nothing is recomputed.

    In units of q-byte elements (1-byte dropout masks counted as q/2, exact in 16-bit):
      attention: 5sbh (norm input, qkv input, q, k, v) + sbh (out-proj input)
                 + a·s²·b (softmax output)
                 with dropout: + 1.5·a·s²·b (dropout output and mask) + sbh/2 (residual mask)
      MLP (GPT-2): sbh (fc input) + 2·sbi (GeLU input, fc2 input) [+ sbh/2 mask with dropout]
                   [+ 3·sbi when GeLU is unfused Python ops: tanh output, 1 + tanh, x/2]
      MLP (gated): sbh (input) + 4·sbi (gate out, up out, SiLU out, product)
      norms: the second norm's input, sbh.
    GPT-2 with dropout and i = 4h then gives the paper's 34sbh + 5as²b bytes at q = 2.
    """
    b, s, h, a, i = job.micro_batch, job.seq_len, shape.hidden, shape.heads, shape.intermediate
    sbh = s * b * h
    scores = a * s * s * b
    masks = 0.5 if shape.dropout else 0.0
    attention = 6 * sbh + scores + (1.5 * scores + masks * sbh if shape.dropout else 0.0)
    mlp: float
    if shape.gated_mlp:
        mlp = sbh + 4 * s * b * i
    else:
        mlp = sbh + (5 if shape.unfused_gelu else 2) * s * b * i + masks * sbh
    norms = sbh
    return q * (attention + mlp + norms)


def logits_bytes(shape: TransformerShape, job: ActivationJob, q: int) -> float:
    """The output layer: logits in the training dtype plus the fp32 copy the loss makes."""
    return job.micro_batch * job.seq_len * shape.vocab * (q + 4)


def activation_bytes(shape: TransformerShape, job: ActivationJob, q: int) -> float:
    """Peak activation bytes of one micro-batch, per GPU.

    Without checkpointing every layer keeps all its activations (L x per-layer). With
    checkpointing each layer keeps only its input (q·sbh) and one layer at a time is
    recomputed in full during backward, so the peak is L·q·sbh + one full layer.
    """
    per_layer = layer_activation_bytes(shape, job, q)
    if job.checkpointing:
        kept = shape.layers * q * job.seq_len * job.micro_batch * shape.hidden + per_layer
    else:
        kept = shape.layers * per_layer
    return kept + logits_bytes(shape, job, q)
