"""What a Hugging Face or PEFT directory written by ``zerorun consolidate`` must hold.

Used by checkpoint/save.py (``peft_configs``: a PEFT model's adapter configs go into the
manifest) and checkpoint/consolidate.py (``--like`` / ``--hf-config``); tests:
tests/unit/test_consolidate_like.py.

Note [names that fit]: ``consolidate --like BASE`` wrote whatever names the engine's module had.
For a PEFT model those are ``base_model.model.…q_proj.base_layer.weight`` and
``…lora_A.default.weight``: ``from_pretrained(OUT)`` then found 21 of the base model's names
missing and 29 unexpected, initialised the missing ones at random and said nothing that a user
reads. Now the names are checked against the model the directory is for (its config's
architecture built on the meta device, no memory) before anything is written, and a mismatch is
one line counting and naming both sides. A PEFT checkpoint is written as what it is, a PEFT adapter
directory (``adapter_config.json`` from the config the save recorded, and ``adapter_model.safetensors``
with PEFT's own names: the adapter name dropped, as ``save_pretrained`` writes them), which
``peft.PeftModel.from_pretrained(base, OUT)`` loads.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import torch

from zerorun.errors import CheckpointError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_MARKS = (".base_layer.", ".lora_A.", ".lora_B.", ".lora_embedding_A.", ".modules_to_save.")


def _plain(value):
    """JSON for a PEFT config's values (sets, enums, nested)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(_plain(v) for v in value) if isinstance(value, (set, frozenset)) else [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def peft_configs(module: torch.nn.Module) -> dict | None:
    """{adapter name: config as JSON} of a PEFT model (``module.peft_config``), else None."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    found = {}
    for name, config in configs.items():
        to_dict = getattr(config, "to_dict", None)
        if callable(to_dict):
            found[str(name)] = _plain(to_dict())
    return found or None


def looks_like_peft(names) -> bool:
    return any(mark in name for name in names for mark in PEFT_MARKS)


def adapter_key(name: str, adapter: str) -> str | None:
    """PEFT's file name for a trainable parameter of ``adapter`` (None: not the adapter's):
    ``…lora_A.default.weight`` -> ``…lora_A.weight``, ``…modules_to_save.default.weight`` ->
    ``….weight`` (as peft.utils.get_peft_model_state_dict writes them)."""
    if f".{adapter}." not in name and not name.endswith(f".{adapter}"):
        return None
    return name.replace("modules_to_save.", "").replace(f".{adapter}", "")


def model_names(config_dir: Path) -> tuple[set[str], set[str]] | None:
    """(names a state dict of the directory's model must hold, every name it may hold: tied
    aliases too), from its config's architecture built on the meta device; None when the config
    names no architecture transformers has, or when transformers cannot read it (then nothing is
    checked: the output is written as before)."""
    import transformers

    try:
        if Path(config_dir).is_dir():
            config = transformers.AutoConfig.from_pretrained(str(config_dir))
        else:  # --hf-config: a config.json of its own
            fields = json.loads(Path(config_dir).read_text())
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        classes = [getattr(transformers, arch, None) for arch in (getattr(config, "architectures", None) or [])]
        cls = next((c for c in classes if c is not None), None)
        if cls is None:
            return None
        with torch.device("meta"):
            model = cls(config)
    except Exception:  # transformers' refusals are many types; an unreadable config is not ours to judge
        return None
    first = {name for name, _ in model.named_parameters()}
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = set(model.state_dict().keys()) - every
    return first | buffers, every | buffers


def check_names_fit(out_names: list[str], config_dir: Path, what: str) -> None:
    """Note [names that fit]: refuse, in one line, output names that are not the model's."""
    names = model_names(config_dir)
    if names is None:
        return
    needed, allowed = names
    have = set(out_names)
    missing, unexpected = sorted(needed - have), sorted(have - allowed)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of its {len(needed)} names are not in the checkpoint (first {missing[0]!r})")
    if unexpected:
        parts.append(f"{len(unexpected)} names of the checkpoint are not in it (first {unexpected[0]!r})")
    hint = "pass --strip-prefix with the prefix of a wrapper module (e.g. 'model.'), or --like the model it was saved from"
    if looks_like_peft(have):
        hint = ("a PEFT checkpoint saved by an older zerorun does not record its adapter config: re-save it, or merge "
                "the adapter before saving (model.merge_and_unload())")
    raise CheckpointError(f"the checkpoint's names do not fit the model of {what}: {'; '.join(parts)}; "
                          "from_pretrained would initialise the missing ones at random", hint=hint)


def write_adapter_config(out: Path, config: dict, base) -> None:
    from zerorun.zero.checkpoint.tensor_files import write_bytes_atomically

    config = dict(config)
    config["base_model_name_or_path"] = str(base) if base is not None else config.get("base_model_name_or_path")
    config["inference_mode"] = True
    write_bytes_atomically(out / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True).encode())
