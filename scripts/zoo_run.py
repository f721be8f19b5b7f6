"""Imported by scripts/model_zoo.py: one family trained in a 2-rank world, by plain torch and by
zerorun, and what came of it (``Outcome``, the line each world's rank 0 logs).

    python scripts/model_zoo.py --only llama

Rank 0 finds the first tiny model plain torch trains (``_plain_torch``) and its per-step losses
over the whole global batch; both ranks then train that model with zerorun, each on its half.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from zoo_families import (CHANNELS, GLOBAL_BATCH, IMAGE, LABELS, LORA_SUFFIX, SEQ, VARIANTS, VOCAB, Family, TooBig,
                          build_model)
from zoo_settings import DEFAULT, PREFETCH_SHARE, TOLERANCE, Setting

WORLD = 2
STEPS = 3
LR = 1e-3
Job = tuple["Family", int, Setting]
# Dynamo and AOT autograd as torch.compile runs them, without inductor's code generation, which
# takes minutes per graph on two shared cores and changes no hook or gather.
COMPILE_BACKEND = os.environ.get("ZERORUN_ZOO_COMPILE_BACKEND", "aot_eager")


@dataclass
class Outcome:
    family: str
    stage: int
    status: str  # passed / failed / skipped
    setting: str = ""  # Setting.tag
    detail: str = ""
    losses: list[float] | None = None
    reference: list[float] | None = None
    error_type: str = ""
    seconds: float = 0.0
    rss_mib: int = 0  # this rank's resident memory after the family: a leak shows as growth
    trainable: tuple[int, int] = (0, 0)  # parameters (elements) that train, of all
    tolerance: float = TOLERANCE  # relative, per step: Setting.tolerance


# -- the inputs ------------------------------------------------------------------------------
def batch(family: Family, config, step: int, rows: slice, setting: Setting = DEFAULT) -> dict:
    """Step ``step``'s global batch (the same on every rank), rows ``rows`` of it. With
    ``setting.skew`` rank 0's rows repeat one token, so that their hidden states, and the
    experts a router picks for them, are alike; ``setting.use_cache`` asks for the cache."""
    generator = torch.Generator().manual_seed(1000 + step)
    if family.task == "image-classification":
        channels = getattr(config, "num_channels", CHANNELS)
        size = getattr(config, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        pixels = torch.randn(GLOBAL_BATCH, channels, size, size, generator=generator)
        labels = torch.randint(0, LABELS, (GLOBAL_BATCH,), generator=generator)
        return {"pixel_values": pixels[rows], "labels": labels[rows]}
    vocab = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", VOCAB)
    low = min(4, vocab - 1)  # past the special ids the tiny config keeps below 4
    ids = torch.randint(low, vocab, (GLOBAL_BATCH, SEQ), generator=generator)
    if setting.skew:
        ids[_rank_rows(0)] = low
    cache = {"use_cache": True} if setting.use_cache else {}
    if family.task == "seq2seq-lm":
        labels = torch.randint(low, vocab, (GLOBAL_BATCH, SEQ), generator=generator)
        return {"input_ids": ids[rows], "labels": labels[rows], **cache}
    return {"input_ids": ids[rows], "labels": ids[rows], **cache}


def _loss(output) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output[0]


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


# -- one family in the world ------------------------------------------------------------------
def _rank_rows(rank: int) -> slice:
    per_rank = GLOBAL_BATCH // WORLD
    return slice(rank * per_rank, (rank + 1) * per_rank)


def prepare(family: Family, model, setting: Setting):
    """The setting's LoRA and Hugging Face's gradient checkpointing on ``model`` (plain torch and
    zerorun alike; zoo_settings.NotApplicable where the family has nothing to put LoRA on); the
    checkpointing recomputes only in training mode, so such a model trains with dropout at 0."""
    if setting.lora:
        from zoo_settings import apply_lora

        model = apply_lora(model, family.model_type, setting.lora)
    if setting.checkpointing in ("reentrant", "non-reentrant"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": setting.checkpointing == "reentrant"})
        model.train()
    return model


def reference_losses(family: Family, model, setting: Setting = DEFAULT) -> list[float]:
    """Plain torch, one process, the whole global batch per step, AdamW. The batch's gradient
    is taken as the mean of its halves' gradients, the way any data-parallel run forms it: the
    same value as one backward over the whole batch, with the rounding of the split, which
    Adam can blow up where a gradient is near zero (BiT's weight-standardized convolutions
    differ by 3.6e-4 after 3 steps otherwise, at every stage, DDP's included)."""
    from zoo_settings import Bf16Masters, cast_inputs

    def adamw(params):
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)

    if setting.dtype == "bf16":
        optimizer = Bf16Masters(model, adamw)
    else:
        optimizer = adamw([p for p in model.parameters() if p.requires_grad])
    dtype = next(model.parameters()).dtype
    config = model.config
    losses = []
    for step in range(STEPS):
        total = 0.0
        for rank in range(WORLD):
            loss = _loss(model(**cast_inputs(batch(family, config, step, _rank_rows(rank), setting), dtype)))
            (loss / WORLD).backward()
            total += float(loss.detach()) / WORLD
        optimizer.step()
        if not isinstance(optimizer, Bf16Masters):
            optimizer.zero_grad()
        losses.append(total)
    return losses


def zerorun_config(model, stage: int, setting: Setting) -> dict:
    zero: dict = {"stage": stage, "param_persistence_threshold": 0}
    if setting.plan == "fine":
        zero["allgather_bucket_size"] = 1
    if setting.prefetch:
        zero["prefetch_bucket_size"] = max(1, int(PREFETCH_SHARE * sum(p.numel() for p in model.parameters())))
    if setting.rows:
        zero["tied_embedding_rows"] = True
    config: dict = {"zero": zero, "precision": {"dtype": setting.dtype}}
    if setting.checkpointing == "zerorun":
        config["activation_checkpointing"] = {"enabled": True, "modules": list(model._no_split_modules or [])}
    return config


def zerorun_losses(family: Family, model, stage: int, rank: int, setting: Setting = DEFAULT) -> list[float]:
    """zerorun at ``stage`` on this world: each rank a half of the global batch; the logged
    loss is the mean over ranks, which is the global batch's mean (equal rows and tokens)."""
    import torch.distributed as dist

    import zerorun
    from zerorun.zero.unit.storage import GatherPool

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    pooled = GatherPool.SUPPORTED
    GatherPool.SUPPORTED = pooled and setting.pool  # the gatherer reads it when it is built
    if setting.compile == "before":
        model = torch.compile(model, backend=COMPILE_BACKEND)
    try:
        engine = zerorun.initialize(model, optimizer, zerorun_config(model, stage, setting))
    finally:
        GatherPool.SUPPORTED = pooled
    if setting.compile == "after":
        engine.module.compile(backend=COMPILE_BACKEND)
    config = model.config
    rows = _rank_rows(rank)
    losses = []
    for step in range(STEPS):
        loss = _loss(engine(**batch(family, config, step, rows, setting)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    return (mean / WORLD).tolist()


def _plain_torch(family: Family, setting: Setting = DEFAULT) -> tuple[str, object]:
    """On one rank: the first shrink variant that builds and that plain torch trains, with its
    losses; else why not (the first variant's reason)."""
    from zoo_settings import NotApplicable

    reasons = []
    for variant in range(len(VARIANTS)):
        try:
            model = prepare(family, build_model(family, variant), setting)
        except NotApplicable as error:
            return "skip", f"{setting.tag}: {error}"
        except TooBig as error:
            reasons.append(str(error))
            continue
        except Exception as error:  # any family may fail to build in its own way
            reasons.append(f"tiny config does not build: {first_line(error)}")
            continue
        try:
            reference = reference_losses(family, model, setting)
        except Exception as error:
            reasons.append(f"plain torch cannot train it on generated inputs: {first_line(error)}")
            continue
        if all(math.isfinite(v) for v in reference):
            return "ok", (variant, reference)
        reasons.append(f"plain torch's losses are not finite: {reference}")
    return "skip", reasons[0]


def run_family(family: Family, stage: int, rank: int, setting: Setting = DEFAULT) -> Outcome:
    """Rank 0 finds the tiny model plain torch trains and its losses, and tells the other rank;
    then both build that model and train it with zerorun."""
    import torch.distributed as dist

    started = time.perf_counter()
    outcome = Outcome(family.name, stage, "skipped", setting.tag, tolerance=setting.tolerance)
    status: list = [_plain_torch(family, setting) if rank == 0 else None]
    dist.broadcast_object_list(status, src=0)
    kind, value = status[0]
    if kind == "skip":
        outcome.detail = value
    else:
        variant, outcome.reference = value
        try:
            model = prepare(family, build_model(family, variant), setting)
            outcome.trainable = (sum(p.numel() for p in model.parameters() if p.requires_grad),
                                 sum(p.numel() for p in model.parameters()))
            outcome.losses = zerorun_losses(family, model, stage, rank, setting)
        except Exception as error:
            outcome.status, outcome.error_type, outcome.detail = "failed", type(error).__name__, first_line(error)
        else:
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(outcome.losses, outcome.reference, strict=True))
            if worst <= setting.tolerance:
                outcome.status, outcome.detail = "passed", f"max relative difference {worst:.1e}"
            else:
                outcome.status, outcome.error_type = "failed", "LossMismatch"
                outcome.detail = f"losses differ from plain torch's by up to {worst:.1e} relative"
        if variant:
            outcome.detail += f" (shrink variant {variant})"
        if family.model_type.endswith(LORA_SUFFIX) or setting.lora:
            outcome.detail += f" (LoRA: {outcome.trainable[0]:,} of {outcome.trainable[1]:,} parameters train)"
    outcome.seconds = round(time.perf_counter() - started, 2)
    return outcome
