"""Imported by scripts/model_zoo.py: which families the zoo trains, and the tiny model each is
built as.

    python scripts/model_zoo.py --only llama,opt

A family is a model class of transformers' causal-LM, masked-LM, seq-to-seq-LM or
image-classification auto mapping (``all_families``), plus PEFT LoRA variants of two of them and
a plain per-expert MoE (scripts/zoo_plain_moe.py). Its model is built from the family's config
defaults with the common size fields shrunk (``tiny_config``), in variants tried in turn.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

GLOBAL_BATCH, SEQ = 4, 8
VOCAB = 128
IMAGE, CHANNELS, LABELS = 32, 3, 3
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
        elif ("dropout" in key or "jitter" in key or key.endswith("_pdrop") or key in ("drop_path_rate", "layerdrop")) \
                and isinstance(value, float):
            out[key] = 0.0  # random in training mode: a rank's half batch draws apart from the whole batch
        elif key in ("depths", "num_layers", "block_repeats") and isinstance(value, list) and \
                all(isinstance(v, int) for v in value):
            out[key] = [1] * len(value)
    return out


def tiny_config(model_type: str, variant: int = 0):
    """The family's config class with its defaults, the common size fields shrunk (``SIZES``,
    but for those ``VARIANTS[variant]`` keeps), token ids kept inside the vocabulary and every
    dropout and router jitter (Switch Transformers' multiplicative noise) at 0; nested configs (a text and a vision config) shrunk the same way."""
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
