"""python scripts/model_zoo.py [--stage 3] [--only llama,opt] [--worlds 1] [--fine [--setting TAG]] [--resume DIR [--no-run]] [--out docs/zoo.md] — Hugging Face families on zerorun.

Every model family in transformers' auto mappings for causal LM, masked LM, seq-to-seq LM and
image classification is built from a tiny config on the CPU (``tiny_config``: the family's
config defaults with the common size fields shrunk) and trained 3 steps on 2 gloo ranks at the
given ZeRO stage, its per-step losses compared with plain torch on the same global batch (fp32,
1e-4 relative; ``reference_losses`` says how the batch's gradient is formed). PEFT LoRA variants (a frozen base, trainable adapters) run as families of their
own. All families share one 2-rank world, trained in turn (a world per family would spend most
of its time starting processes and importing transformers); if a family takes the world down,
a new world goes on with the next one. The table goes to ``--out`` (docs/zoo.md).

``--fine`` runs the fine set instead (``fine_plan_jobs``, its table written to docs/zoo_fine.md): every module
that holds parameters gathers its own unit (``allgather_bucket_size: 1``), as a real model's
blocks and experts do, with the CPU gather pool on and off (off, units free and re-allocate
their storage as CUDA units do); the text families also under Hugging Face's gradient
checkpointing (reentrant and not); every family with PEFT LoRA on its attention projections,
and on them and its input embedding, and in bf16 against plain torch's own bf16 (these three
pool off: scripts/zoo_settings.py); the MoE set (``MOE_FAMILIES``, with a plain per-expert MoE
from scripts/zoo_plain_moe.py) on a batch whose rank-0 rows repeat one token, so that rank 0's
routers leave experts idle that rank 1 runs. Each job is a family at a stage under a ``Setting``.
``--setting`` runs only the fine jobs of that setting; ``--resume`` keeps what an earlier run
logged under its ``--work`` folder and runs the rest (scripts/zoo_table.py), so the fine set,
hours on 2 loaded cores, can be run in parts.

Outcomes: ``passed``; ``failed`` (zerorun raised, or the losses differ: the error's first line);
``skipped`` (the tiny config does not build, or plain torch cannot train the model on the inputs
generated here: a family that needs audio, a package we lack, or inputs beyond token ids or
pixels; the reason is the error's first line). Models run in eval mode: dropout, drop-path,
layer-drop and batch statistics would otherwise differ between a rank's half batch and the
whole batch under any data parallelism, which is not what is compared.

tests/integrations/test_model_zoo.py runs a named sample of these by default and the whole zoo
(and the fine set) under ``-m zoo``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

WORLD = 2
STEPS = 3
GLOBAL_BATCH, SEQ = 4, 8
VOCAB = 128
IMAGE, CHANNELS, LABELS = 32, 3, 3
LR = 1e-3
TOLERANCE = 1e-4  # relative, per step
# A family whose size fields are not the common ones stays big after shrinking (Perceiver's
# latents, a CNN's channel lists): beyond this it is skipped rather than trained on 2 cores.
MAX_PARAMS = 20_000_000

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
# The MoE set: families whose experts run only when routed to, trained on a skewed batch.
MOE_FAMILIES = ("causal-lm/mixtral", "causal-lm/qwen2_moe", "causal-lm/olmoe", "seq2seq-lm/switch_transformers",
                "causal-lm/plain_moe")
PLAIN_MOE = "plain_moe"  # scripts/zoo_plain_moe.py: one nn.Linear per expert
LORA_FAMILIES = ("llama", "opt")  # causal LMs that also run as PEFT LoRA: "llama+lora", "opt+lora"
LORA_SUFFIX = "+lora"

# Size fields shrunk wherever a config has them; everything else keeps the family's default.
SIZES = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32, "word_embed_proj_dim": 32,
    "embedding_size": 32, "projection_dim": 32, "hidden_dim": 64, "emb_dim": 32, "n_words": VOCAB,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "n_layers": 2,
    # Switch Transformers makes every (layers // sparse layers)-th block sparse: 3 sparse layers of 2
    # give a step of 0, and no expert at all.
    "num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "n_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "d_kv": 8, "rotary_dim": 8,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    "image_size": IMAGE, "patch_size": 8, "num_channels": CHANNELS,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "num_labels": LABELS,
}
# Token ids at or past the vocabulary would index outside the shrunk embedding.
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
             "cls_token_id", "mask_token_id", "unk_token_id", "forced_bos_token_id", "forced_eos_token_id")


@dataclass(frozen=True)
class Family:
    task: str
    model_type: str
    class_name: str

    @property
    def name(self) -> str:
        return f"{self.task}/{self.model_type}"


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
    "fp32" or "bf16" (scripts/zoo_settings.py says how plain torch matches each)."""

    plan: str = "default"
    checkpointing: str = ""
    pool: bool = True
    use_cache: bool = False  # each forward asks for the key/value cache (the tiny configs turn it off)
    skew: bool = False  # rank 0's rows repeat one token: its routers leave experts idle
    compile: str = ""  # "before" / "after" initialize: torch.compile of the model (COMPILE_BACKEND)
    lora: str = ""  # PEFT LoRA on "attention" or "attention+embedding" (zoo_settings.apply_lora)
    dtype: str = "fp32"  # "bf16": zerorun's bf16 mixed precision, plain torch's the same (zoo_settings.Bf16Masters)

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
        return ",".join(parts)

    @property
    def tolerance(self) -> float:
        """Relative, per step: ``TOLERANCE`` in fp32; bf16's own (zoo_settings.BF16_TOLERANCE)."""
        from zoo_settings import BF16_TOLERANCE

        return BF16_TOLERANCE if self.dtype == "bf16" else TOLERANCE


DEFAULT = Setting()
Job = tuple["Family", int, Setting]
CHECKPOINTING = ("reentrant", "non-reentrant", "zerorun")
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


# -- which families ---------------------------------------------------------------------------
def all_families() -> list[Family]:
    from transformers.models.auto import modeling_auto

    found = []
    for task, mapping in TASKS.items():
        for model_type, class_name in sorted(getattr(modeling_auto, mapping).items()):
            if isinstance(class_name, (list, tuple)):  # several heads: the first is the plain one
                class_name = class_name[0]
            found.append(Family(task, model_type, class_name))
    found += [Family("causal-lm", t + LORA_SUFFIX, by_name(found, "causal-lm", t).class_name) for t in LORA_FAMILIES]
    found.append(Family("causal-lm", PLAIN_MOE, "PlainMoe"))
    return found


def by_name(families: list[Family], task: str, model_type: str) -> Family:
    return next(f for f in families if f.task == task and f.model_type == model_type)


def select(families: list[Family], names: list[str]) -> list[Family]:
    """``names`` as ``task/model_type`` or a bare ``model_type`` (every task that has it)."""
    chosen = [f for f in families if f.name in names or f.model_type in names]
    unknown = [n for n in names if not any(n in (f.name, f.model_type) for f in families)]
    if unknown:
        raise SystemExit(f"model_zoo: no family named {', '.join(unknown)} (see the table in docs/zoo.md)")
    return chosen


# -- tiny models ----------------------------------------------------------------------------
# Shrinking is tried in variants, the first that plain torch can train being used: all of SIZES;
# then layer counts left at the default (per-layer lists such as ``layer_types`` must match them);
# then also the per-head sizes left (multi-head latent attention derives its rotary split from them).
LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "n_layers", "first_k_dense_replace", "depths", "block_repeats",
              "num_sparse_encoder_layers", "num_sparse_decoder_layers"}
HEAD_KEYS = {"head_dim", "d_kv", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"}
VARIANTS = (set(), LAYER_KEYS, LAYER_KEYS | HEAD_KEYS)


def _shrink_values(values: dict, keep: set[str] = frozenset()) -> dict:
    out = {}
    for key, value in values.items():
        if key in keep:
            continue
        if key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SIZES[key]) if key not in ("num_labels",) else SIZES[key]
        elif key in TOKEN_IDS and isinstance(value, int) and value >= 8:
            out[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(key, 3)
        elif ("dropout" in key or key.endswith("_pdrop") or key in ("drop_path_rate", "layerdrop")) \
                and isinstance(value, float):
            out[key] = 0.0
        elif key in ("depths", "num_layers", "block_repeats") and isinstance(value, list) and \
                all(isinstance(v, int) for v in value):
            out[key] = [1] * len(value)
    return out


def tiny_config(model_type: str, variant: int = 0):
    """The family's config class with its defaults, the common size fields shrunk (``SIZES``,
    but for those ``VARIANTS[variant]`` keeps), token ids kept inside the vocabulary and every
    dropout at 0; nested configs (a text and a vision config) shrunk the same way."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type.removesuffix(LORA_SUFFIX)]
    defaults = cls().to_dict()
    accepted = set(inspect.signature(cls.__init__).parameters)
    keep = VARIANTS[variant]
    overrides = {k: v for k, v in _shrink_values(defaults, keep).items() if k in accepted or k in defaults}
    for key, value in defaults.items():  # sub-configs come back as dicts: shrink them too
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            overrides[key] = {**value, **_shrink_values(value, keep)}
    config = cls(**overrides)
    for attribute in ("use_cache", "output_router_logits"):
        if hasattr(config, attribute):
            setattr(config, attribute, False)
    config.num_labels = LABELS  # classification heads: the labels generated here
    for attribute in ("pad_token_id", "decoder_start_token_id"):  # seq-to-seq shifts labels right with them
        if getattr(config, attribute, None) is None:
            setattr(config, attribute, 0)
    return config


class TooBig(Exception):
    def __init__(self, count: int):
        super().__init__(f"the tiny config still has {count / 1e6:.0f}M parameters (its size fields are not the "
                         f"common ones; more than {MAX_PARAMS / 1e6:.0f}M are not trained here)")


def build_model(family: Family, variant: int = 0):
    """The family's model class on a tiny config, seeded, in eval mode with dropout off."""
    import transformers

    if family.model_type == PLAIN_MOE:
        from zoo_plain_moe import PlainMoe

        torch.manual_seed(0)
        return PlainMoe(VOCAB).float().eval()
    config = tiny_config(family.model_type, variant)
    cls = getattr(transformers, family.class_name)
    try:  # counted on the meta device first: building a model too big to train here takes minutes
        with torch.device("meta"):
            count = sum(p.numel() for p in cls._from_config(config).parameters())
    except Exception:  # a model that cannot be built on meta is counted once built below
        count = 0
    if count > MAX_PARAMS:
        raise TooBig(count)
    torch.manual_seed(0)
    model = cls._from_config(config)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMS:
        raise TooBig(count)
    if family.model_type.endswith(LORA_SUFFIX):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model.float().eval()


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


def _resident_mib() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except OSError:  # not Linux
        return 0


def _world_tag(jobs: list[Job]) -> str:
    """Names one world's files: each world starts at a different job, and a crashed world's
    log must survive the next one (the families it finished are read from it)."""
    return f"{len(jobs)}-{jobs[0][0].name.replace('/', '_')}"


def _worker(rank: int, out_dir: str, jobs: list[Job]) -> None:
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two shared cores
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous-{_world_tag(jobs)}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    from zerorun.zero.comm.process_group import leaving_together

    with leaving_together(), open(Path(out_dir) / f"rank{rank}-{_world_tag(jobs)}.jsonl", "a") as log:
        for family, stage, setting in jobs:
            log.write(json.dumps({"start": family.name, "stage": stage, "setting": setting.tag}) + "\n")
            log.flush()
            outcome = run_family(family, stage, rank, setting)
            gc.collect()  # the family's model, engine and hooks, before the next one is built
            outcome.rss_mib = _resident_mib()
            log.write(json.dumps(asdict(outcome)) + "\n")
            log.flush()


def run_zoo(jobs: list[Job], out_dir: Path) -> list[Outcome]:
    """Run ``jobs`` in 2-rank worlds, a new world after any family that ends one."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    done: list[Outcome] = []
    remaining = list(jobs)
    while remaining:
        log = out_dir / f"rank0-{_world_tag(remaining)}.jsonl"
        log.unlink(missing_ok=True)
        crash = None
        try:
            mp.start_processes(_worker, args=(str(out_dir), remaining), nprocs=WORLD, start_method="spawn", join=True)
        except Exception as error:  # a rank died: what it finished is in its log
            crash = first_line(error)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        finished = [Outcome(**{**r, "trainable": tuple(r["trainable"])}) for r in records if "status" in r]
        done += finished
        remaining = remaining[len(finished):]
        if crash is not None and remaining:
            family, stage, setting = remaining.pop(0)
            done.append(Outcome(family.name, stage, "failed", setting.tag, f"the world ended while it ran: {crash}",
                                error_type="WorldCrash"))
            with open(out_dir / "crashes.jsonl", "a") as crashes:  # zoo_table.logged_records reads it
                crashes.write(json.dumps(asdict(done[-1])) + "\n")
    return done


def run_zoo_parallel(jobs: list[Job], out_dir: Path, worlds: int) -> list[Outcome]:
    """``jobs`` dealt over ``worlds`` 2-rank worlds that run at once (a family's outcome does not
    depend on its world: each is built, seeded and trained on its own), in the jobs' order."""
    from concurrent.futures import ThreadPoolExecutor

    if worlds <= 1:
        return run_zoo(jobs, out_dir)
    with ThreadPoolExecutor(worlds) as pool:
        parts = list(pool.map(lambda i: run_zoo(jobs[i::worlds], out_dir / f"world{i}"), range(worlds)))
    place = {(family.name, stage, setting.tag): n for n, (family, stage, setting) in enumerate(jobs)}
    return sorted((o for part in parts for o in part), key=lambda o: place[(o.family, o.stage, o.setting)])


def fine_plan_jobs(families: list[Family]) -> list[Job]:
    """The ``fine`` set at stage 3: every family with every module its own unit, with the gather
    pool on and off (the GPU path emulated); the text families also under Hugging Face's
    gradient checkpointing, reentrant and not; every family with PEFT LoRA on its attention
    projections, and on them and its input embedding (the LoRA families of the plain zoo are
    LoRA already), and in bf16; these with the pool off, the path the GPU takes; the MoE set on a
    skewed batch, pool on and off."""
    text = [f for f in families if f.task != "image-classification"]
    base = [f for f in families if not f.model_type.endswith(LORA_SUFFIX)]
    jobs = [(f, 3, Setting("fine", pool=pool)) for pool in (True, False) for f in families]
    jobs += [(f, 3, Setting("fine", kind, pool=False)) for kind in ("reentrant", "non-reentrant") for f in text]
    jobs += [(f, 3, Setting("fine", pool=False, lora=lora)) for lora in ("attention", "attention+embedding") for f in base]
    jobs += [(f, 3, Setting("fine", pool=False, dtype="bf16")) for f in families]
    moe = [f for f in families if f.name in MOE_FAMILIES]
    jobs += [(f, 3, Setting("fine", pool=pool, skew=True)) for pool in (True, False) for f in moe]
    return jobs


# -- the table -----------------------------------------------------------------------------
def summary(outcomes: list[Outcome]) -> dict[str, int]:
    from zoo_table import summary as count

    return count(outcomes)


def write_table(outcomes: list[Outcome], path: Path, command: str, fine: bool = False, planned: int = 0) -> None:
    import transformers
    from zoo_settings import BF16_TOLERANCE
    from zoo_table import overview, write_table as write

    intro = (
        f"Generated by `{command}` (scripts/model_zoo.py; transformers {transformers.__version__}, "
        f"torch {torch.__version__}). Each family of transformers' causal-LM, masked-LM, seq-to-seq-LM "
        "and image-classification auto mappings is built from a tiny config on the CPU and trained "
        f"{STEPS} steps with AdamW on {WORLD} gloo ranks, each rank half of a global batch of {GLOBAL_BATCH}; "
        f"its per-step losses are compared with plain torch in one process on the whole batch, the batch's "
        f"gradient formed as the mean of its halves' as data parallelism forms it (fp32, {TOLERANCE:g} relative). "
        "`+lora` rows are PEFT LoRA (r=4 on q_proj and v_proj) over a frozen base. Skipped: the tiny "
        "config does not build, or plain torch itself cannot train the model on token ids or pixels "
        "(audio, extra inputs, missing packages); the reason is the error's first line. "
        "Models run in eval mode (no dropout, drop-path or batch statistics, which differ between a "
        "rank's half batch and the whole batch under any data parallelism).")
    title = "Model zoo: Hugging Face families on zerorun"
    if fine:
        title += ", the fine set"
        intro += (
            "\n\nThe fine set (`fine_plan_jobs`), all at stage 3 with every module that holds parameters "
            "its own unit (`fine`: `allgather_bucket_size: 1`). `no-pool`: the CPU gather pool off, so "
            "units free and re-allocate their storage as CUDA units do (the GPU path, emulated). "
            "`ckpt=`: Hugging Face's `gradient_checkpointing_enable` (use_reentrant true or false) in "
            "training mode. `lora=`: PEFT LoRA (r=4) on every linear layer inside an attention module "
            "(scripts/zoo_settings.py), and on the input embedding too; a family without them is "
            "skipped with the reason. `bf16`: zerorun's bf16 mixed precision against plain torch's own "
            "(a bf16 model, fp32 masters stepped by AdamW, bf16 gradients), "
            f"{BF16_TOLERANCE:g} relative: the same roundings at the same points on both sides, exact at 2 ranks, "
            "but in AdamW's kernel (zerorun's fused on a CPU, plain torch's per-tensor: an fp32 ulp apart in "
            "some masters, now and then a bf16 weight a step apart; scripts/zoo_settings.py says why and how much). "
            "`skew`: the MoE set (Mixtral, Qwen2-MoE, OLMoE, Switch Transformers, a plain per-expert "
            "MoE) on a batch whose rank-0 rows repeat one token, so that rank 0's routers leave experts "
            "idle that rank 1 runs.\n\n" + "\n".join(overview(outcomes)))
    if planned > len(outcomes):
        intro += (f"\n\n**{len(outcomes)} of the {planned} jobs have run**; the rest have not (a family at a "
                  "setting missing from its section below): `--resume` runs them.")
    write(outcomes, path, title, intro)


def _logged(jobs: list[Job], directories: list[Path]) -> list[Outcome]:
    """The outcomes of ``jobs`` logged under ``directories`` by earlier runs (zoo_table.logged_records)."""
    from zoo_table import logged_records

    wanted = {(family.name, stage, setting.tag) for family, stage, setting in jobs}
    return [Outcome(**{**r, "trainable": tuple(r["trainable"])}) for r in logged_records(directories)
            if (r["family"], r["stage"], r["setting"]) in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, action="append", help="ZeRO stage(s) to run (default 3)")
    parser.add_argument("--only", default="", help="comma-separated families (task/model_type or model_type)")
    parser.add_argument("--out", type=Path, help="the table (default docs/zoo.md; with --fine docs/zoo_fine.md)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/zerorun-model-zoo"))
    parser.add_argument("--worlds", type=int, default=1, help="2-rank worlds run at once, the families dealt over them")
    parser.add_argument("--fine", action="store_true",
                        help="the fine set instead (every module its own unit; checkpointing, LoRA, bf16, pool off, MoE skew)")
    parser.add_argument("--setting", action="append", default=[],
                        help="with --fine: only the jobs of this setting (its tag, as the table's headings write it)")
    parser.add_argument("--resume", type=Path, action="append", default=[],
                        help="keep the outcomes logged under this --work folder of an earlier run (a later "
                             "--resume's replace an earlier's); run the rest")
    parser.add_argument("--no-run", action="store_true", help="with --resume: run nothing, write the table of what is logged")
    args = parser.parse_args(argv)
    args.out = args.out or Path("docs/zoo_fine.md" if args.fine else "docs/zoo.md")
    families = all_families()
    if args.only:
        families = select(families, [n.strip() for n in args.only.split(",") if n.strip()])
    stages = args.stage or [3]
    if any(s not in (0, 1, 2, 3) for s in stages):
        parser.error("--stage must be 0, 1, 2 or 3")
    jobs: list[Job] = [(family, stage, DEFAULT) for stage in stages for family in families]
    if args.fine:
        jobs = fine_plan_jobs(families)
        if args.setting:
            jobs = [job for job in jobs if job[2].tag in args.setting]
    started = time.perf_counter()
    if args.worlds < 1:
        parser.error("--worlds must be at least 1")
    outcomes = _logged(jobs, args.resume)
    done = {(o.family, o.stage, o.setting) for o in outcomes}
    rest = [job for job in jobs if (job[0].name, job[1], job[2].tag) not in done]
    if args.fine:  # the MoE set first, then family by family: a run cut short covers every setting alike
        first = {family.name: n for n, family in enumerate(families)}
        rest.sort(key=lambda job: (not job[2].skew, first[job[0].name]))
    print(f"{len(jobs)} jobs, {len(outcomes)} logged, {0 if args.no_run else len(rest)} to run", flush=True)
    if rest and not args.no_run:
        outcomes += run_zoo_parallel(rest, args.work / str(os.getpid()), args.worlds)
    command = "python scripts/model_zoo.py" + "".join(f" --stage {s}" for s in args.stage or []) + \
        (f" --only {args.only}" if args.only else "") + (f" --worlds {args.worlds}" if args.worlds > 1 else "") + \
        (" --fine" if args.fine else "") + "".join(f" --setting {t}" for t in args.setting) + \
        "".join(f" --resume {d}" for d in args.resume) + (" --no-run" if args.no_run else "")
    place = {(family.name, stage, setting.tag): n for n, (family, stage, setting) in enumerate(jobs)}
    outcomes.sort(key=lambda o: place[(o.family, o.stage, o.setting)])
    write_table(outcomes, args.out, command, fine=args.fine, planned=len(jobs))
    for stage in stages:
        counts = summary([o for o in outcomes if o.stage == stage])
        print(f"stage {stage}: {counts}")
    print(f"{args.out}: {len(outcomes)} rows in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # zerorun from this checkout, unless PYTHONPATH says
    sys.exit(main())
