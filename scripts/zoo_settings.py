"""Imported by scripts/model_zoo.py: a job's ``Setting`` (how a family is trained beyond the
plain loop), and what the fine set's LoRA and bf16 settings do, applied alike to plain torch and
to zerorun.

    python scripts/model_zoo.py --fine --setting fine,no-pool,lora=attention --only llama

LoRA (PEFT, r=4) goes on a family's attention projections (``attention_targets``: every linear
layer inside a module named like attention, else PEFT's own list for the family),
and for ``lora="attention+embedding"`` also on the input embedding, as people fine-tune a
model with new tokens. A family without such modules is skipped with the reason
(``NotApplicable``).

bf16 is zerorun's mixed precision (``precision.dtype: bf16``): the model in bf16, fp32 masters
that the optimizer steps, gradients reduced in bf16. Plain torch does the same in one process
(``Bf16Masters``): the model cast to bf16, fp32 copies stepped by AdamW and copied back, each
half batch's bf16 gradient summed into ``.grad`` in bf16, floating inputs cast to bf16 (the
engine casts them). Both then round the same values at the same points but in the optimizer's
kernel; see ``BF16_TOLERANCE``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

TOLERANCE = 1e-4  # relative, per step, in fp32

LORA_RANK, LORA_ALPHA = 4, 8
# A linear layer counts as an attention projection when a module on its path is named like one.
ATTENTION_WORDS = ("attn", "attention")
# bf16 against bf16 plain torch, relative per step. Both sides round the same values at the same
# points: the same bf16 forward and backward on the same half batches, the two halves' bf16
# gradients summed once (a sum of two correctly rounded whatever the order, so exact at 2 ranks),
# fp32 AdamW on masters taken from the same bf16 weights. Not the same AdamW kernel: on a CPU
# zerorun switches the user's AdamW to torch's fused kernel (Note [host optimizer kernels] in
# zerorun/zero/offload/placements.py), plain torch steps with its per-tensor default, and the two
# round some masters an fp32 ulp apart. In fp32 that is noise; in bf16 a master an ulp apart now
# and then publishes the neighbouring bf16 weight, and Adam turns that into more: Gemma 4
# unified's text model had 2,411 of the 65,536 fp32 masters of one o_proj an ulp apart after the
# first step and one of its bf16 weights a step apart, and its loss 2.3e-5 apart by the third;
# with plain torch's AdamW fused too, masters and weights are bit-identical and the losses 4.9e-8
# apart. Beside that, fp32 noise in the mean of the two halves' losses (observed <= 1e-7). So the
# fp32 bound holds. A bound at bf16's own resolution (2^-8 = 3.9e-3) would let through defects of the size issue 36 found
# (4.6e-4 to 1.3e-2); at 3 ranks the order of a 16-bit sum matters, and this bound would not hold.
BF16_TOLERANCE = 1e-4
CHECKPOINTING = ("reentrant", "non-reentrant", "zerorun")
# Setting.prefetch: the budget as a share of the model's elements. Hugging Face's "auto" asks
# 0.9 x hidden^2, under one unit of the zoo's tiny configs (hidden 32-64), which would leave
# the window where it is without a budget.
PREFETCH_SHARE = 0.25


@dataclass(frozen=True)
class Setting:
    """How a family is trained beyond the plain loop (the same for plain torch, where it applies).

    plan: "default" (the engine's unit plan) or "fine" (``allgather_bucket_size: 1``: every
    module holding parameters gathers its own unit, as the blocks and experts of a real model
    do). checkpointing: "" or Hugging Face's ``gradient_checkpointing_enable`` with
    "reentrant" / "non-reentrant", or "zerorun" (our own, config ``activation_checkpointing``
    over the model's ``_no_split_modules``). pool: False switches the CPU gather pool off, so
    units free and re-allocate their storage as CUDA units do (the GPU path, emulated).
    use_cache: each forward asks for the key/value cache. skew: rank 0's rows repeat one token
    (its routers leave experts idle). compile: torch.compile before or after ``initialize``.
    lora: PEFT LoRA on the attention projections, or on them and the input embedding. dtype:
    "fp32" or "bf16" (below: how plain torch matches each). prefetch: a ``prefetch_bucket_size``
    of a quarter of the model's elements (``PREFETCH_SHARE``), so stage 3's window reaches
    several units ahead and runs on from forward's end into backward (Note [forward runs on
    into backward] in zerorun/zero/gather_prefetch.py), as Hugging Face's "auto" DeepSpeed
    config asks of real models; plain torch is unchanged by it. rows: ``zero.tied_embedding_rows``
    (a token embedding tied to the head reads the rows it looks up and sends its lookup's
    gradient as rows: zerorun/zero/lookup_rows.py, lookup_gradients.py); a family without a
    tied embedding trains as without it."""

    plan: str = "default"
    checkpointing: str = ""
    pool: bool = True
    use_cache: bool = False  # each forward asks for the key/value cache (the tiny configs turn it off)
    skew: bool = False  # rank 0's rows repeat one token: its routers leave experts idle
    compile: str = ""  # "before" / "after" initialize: torch.compile of the model (COMPILE_BACKEND)
    lora: str = ""  # PEFT LoRA on "attention" or "attention+embedding" (``apply_lora``)
    dtype: str = "fp32"  # "bf16": zerorun's bf16 mixed precision, plain torch's the same (``Bf16Masters``)
    prefetch: bool = False  # stage 3's prefetch budget: PREFETCH_SHARE of the model's elements
    rows: bool = False  # zero.tied_embedding_rows: a tied embedding's lookup reads and sends rows

    @property
    def tag(self) -> str:
        parts = [self.plan] if self.plan != "default" else []
        parts += [f"ckpt={self.checkpointing}"] if self.checkpointing else []
        parts += [] if self.pool else ["no-pool"]
        parts += ["use_cache"] if self.use_cache else []
        parts += ["skew"] if self.skew else []
        parts += [f"compile-{self.compile}"] if self.compile else []
        parts += [f"lora={self.lora}"] if self.lora else []
        parts += [self.dtype] if self.dtype != "fp32" else []
        parts += ["prefetch"] if self.prefetch else []
        parts += ["rows"] if self.rows else []
        return ",".join(parts)

    @property
    def tolerance(self) -> float:
        """Relative, per step: ``TOLERANCE`` in fp32; bf16's own (``BF16_TOLERANCE``)."""
        return BF16_TOLERANCE if self.dtype == "bf16" else TOLERANCE


DEFAULT = Setting()


class NotApplicable(Exception):
    """The setting does not apply to this family (the message says why): a skip, not a failure."""


def _wrappable(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D))


def attention_targets(model: nn.Module, model_type: str) -> list[str]:
    """The qualified names of ``model``'s attention projections that LoRA wraps: every linear
    layer under a module whose name holds "attn" or "attention" (query, key, value and output,
    self- and cross-attention); else PEFT's default targets for ``model_type``, if it has them."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as KNOWN

    linear = [(name, name.split(".")) for name, module in model.named_modules() if _wrappable(module)]
    names = [name for name, parts in linear
             if any(word in part.lower() for part in parts[:-1] for word in ATTENTION_WORDS)]
    known = KNOWN.get(model_type)
    if not names and isinstance(known, list):
        names = [name for name, parts in linear if parts[-1] in known]
    if not names:
        raise NotApplicable("no attention projection (a linear layer inside an attention module) to put LoRA on")
    return names


def embedding_target(model: nn.Module) -> str:
    """The qualified name of the input embedding, if it is an ``nn.Embedding`` PEFT can wrap."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError) as error:
        raise NotApplicable(f"no input embedding ({type(error).__name__})") from None
    if not isinstance(embedding, nn.Embedding):
        raise NotApplicable(f"the input embedding is a {type(embedding).__name__}, not a token embedding")
    return next(name for name, module in model.named_modules() if module is embedding)


def apply_lora(model: nn.Module, model_type: str, lora: str) -> nn.Module:
    """``model`` wrapped by PEFT LoRA on the modules ``lora`` names ("attention",
    "attention+embedding"), its base frozen; the adapters seeded, so every rank builds the same."""
    from peft import LoraConfig, get_peft_model

    targets = attention_targets(model, model_type)
    if lora == "attention+embedding":
        targets.append(embedding_target(model))
    elif lora != "attention":
        raise ValueError(f"unknown LoRA setting {lora!r}")
    torch.manual_seed(1)
    try:
        return get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=targets,
                                                lora_dropout=0.0))
    except Exception as error:  # PEFT's own refusal: a layer type or a model it cannot wrap
        text = str(error).strip().splitlines()
        raise NotApplicable(f"PEFT cannot wrap it: {type(error).__name__}: {text[0][:200] if text else ''}") from None


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    """Floating tensors cast to ``dtype`` as the engine casts a forward's inputs."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


class Bf16Masters:
    """Plain torch's bf16 mixed precision: ``model`` cast to bf16, ``optimizer_class`` over fp32
    copies of its trainable parameters; ``step`` hands each bf16 gradient to its copy, steps
    and copies the result back rounded to bf16."""

    def __init__(self, model: nn.Module, make_optimizer):
        model.to(torch.bfloat16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.optimizer = make_optimizer(self.masters)

    def step(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master)
                master.grad = None
