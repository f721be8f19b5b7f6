"""Fill a config's ``"auto"`` values from Hugging Face ``TrainingArguments`` (pure: no torch, no
transformers; the arguments are read by attribute, so tests pass a SimpleNamespace).

    filled = fill_from_args(raw_config, args)                      # when the arguments exist
    filled = fill_from_model(filled, args, hidden_size=h, num_training_steps=n, warmup_steps=w)

The rules are the ones transformers applies to a DeepSpeed config under Trainer
(``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``), so a
DeepSpeed JSON written for Trainer means the same thing here:

- a key whose value is ``"auto"`` takes the value derived from the arguments;
- a key with a concrete value that disagrees with the arguments is a mismatch, unless the rule
  is fill-only (values that no argument decides, such as bucket sizes); every mismatch of a call
  is reported together in one ``AutoConfigMismatch`` naming the config key, its value, the
  argument and its value;
- a key the config does not have stays absent (transformers does not add keys either: a
  DeepSpeed config without ``gradient_clipping`` does not clip, whatever ``max_grad_norm`` says).

The same rules apply to a zerorun-format config, on the zerorun key that carries the same
setting (``batch.micro_batch_size`` for ``train_micro_batch_size_per_gpu`` and so on), so
``"auto"`` can be written in either format.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping

from zerorun.config.deepspeed import looks_like_deepspeed
from zerorun.errors import ConfigError

AUTO = "auto"


class AutoConfigMismatch(ConfigError):
    """A concrete config value disagrees with the Trainer argument that decides the same thing."""


@dataclass(frozen=True)
class Rule:
    deepspeed: str | None  # dotted key in a DeepSpeed config (None: no DeepSpeed key)
    zerorun: str | None  # dotted key in a zerorun config (None: no zerorun key)
    argument: str  # what the value is derived from, as named in error messages
    value: Callable[..., Any]  # (args, facts) -> the value
    must_match: bool = True
    applies: Callable[[dict, bool], bool] = lambda config, deepspeed: True


def _stage(config: dict, deepspeed: bool) -> Any:
    section = config.get("zero_optimization" if deepspeed else "zero")
    return section.get("stage") if isinstance(section, dict) else None


def _stage3(config: dict, deepspeed: bool) -> bool:
    return _stage(config, deepspeed) == 3


def _dtype(args) -> str:
    if args.bf16 or getattr(args, "bf16_full_eval", False):
        return "bf16"
    if args.fp16 or getattr(args, "fp16_full_eval", False):
        return "fp16"
    return "fp32"


# Known from the arguments alone (transformers: trainer_config_process).
ARGUMENT_RULES = (
    Rule("train_micro_batch_size_per_gpu", "batch.micro_batch_size", "per_device_train_batch_size",
         lambda a, f: a.per_device_train_batch_size),
    Rule("gradient_accumulation_steps", "batch.gradient_accumulation_steps", "gradient_accumulation_steps",
         lambda a, f: a.gradient_accumulation_steps),
    Rule("train_batch_size", "batch.train_batch_size",
         "train_batch_size (world_size x per_device_train_batch_size x gradient_accumulation_steps)",
         lambda a, f: a.world_size * a.per_device_train_batch_size * a.gradient_accumulation_steps),
    Rule("gradient_clipping", "gradient_clipping", "max_grad_norm", lambda a, f: a.max_grad_norm),
    Rule("optimizer.params.lr", "optimizer.params.lr", "learning_rate", lambda a, f: a.learning_rate),
    Rule("optimizer.params.betas", "optimizer.params.betas", "adam_beta1+adam_beta2",
         lambda a, f: [a.adam_beta1, a.adam_beta2]),
    Rule("optimizer.params.eps", "optimizer.params.eps", "adam_epsilon", lambda a, f: a.adam_epsilon),
    Rule("optimizer.params.weight_decay", "optimizer.params.weight_decay", "weight_decay",
         lambda a, f: a.weight_decay),
    Rule("scheduler.params.warmup_min_lr", None, "(no argument: 0)", lambda a, f: 0, must_match=False),
    Rule("scheduler.params.warmup_max_lr", None, "learning_rate", lambda a, f: a.learning_rate),
    Rule("fp16.enabled", None, "fp16|fp16_full_eval",
         lambda a, f: bool(a.fp16 or getattr(a, "fp16_full_eval", False))),
    Rule("bf16.enabled", None, "bf16|bf16_full_eval",
         lambda a, f: bool(a.bf16 or getattr(a, "bf16_full_eval", False))),
    Rule(None, "precision.dtype", "bf16|fp16 (fp32 when neither)", lambda a, f: _dtype(a)),
)

# Known once the model and the number of steps are (transformers: trainer_config_finalize).
MODEL_RULES = (
    Rule("zero_optimization.reduce_bucket_size", "zero.reduce_bucket_size", "hidden_size^2",
         lambda a, f: f["hidden_size"] ** 2, must_match=False),
    Rule("zero_optimization.stage3_prefetch_bucket_size", "zero.prefetch_bucket_size", "0.9 x hidden_size^2",
         lambda a, f: int(0.9 * f["hidden_size"] ** 2), must_match=False, applies=_stage3),
    Rule("zero_optimization.stage3_param_persistence_threshold", "zero.param_persistence_threshold",
         "10 x hidden_size", lambda a, f: 10 * f["hidden_size"], must_match=False, applies=_stage3),
    Rule("scheduler.params.total_num_steps", None, "num_training_steps (calculated)",
         lambda a, f: f["num_training_steps"]),
    # Kept positive as transformers does: DeepSpeed rejects a warm-up of 0 steps.
    Rule("scheduler.params.warmup_num_steps", None, "warmup_steps", lambda a, f: max(1, f["warmup_steps"])),
)


def read_config(source: Any) -> dict:
    """A config path (.json/.yaml), JSON text or dict -> a fresh dict the caller may edit."""
    import json
    from pathlib import Path

    from zerorun.config.sources import read_file

    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, Path)):
        text = str(source).strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"the zerorun config looks like inline JSON but does not parse: {err}") from None
        return read_file(source)
    raise ConfigError(f"a zerorun config must be a file path, JSON text or a dict, not {type(source).__name__}")


def fill_from_args(config: dict, args, environ: Mapping[str, str] | None = None) -> dict:
    """Step 1 (the arguments exist): a copy of ``config`` with the argument-derived autos filled.
    Raises AutoConfigMismatch listing every concrete value that disagrees with the arguments.
    ``environ`` (os.environ by default): where the launcher's WORLD_SIZE is read (check_world)."""
    check_world(args, os.environ if environ is None else environ)
    return apply_rules(config, args, {}, ARGUMENT_RULES)


def check_world(args, environ: Mapping[str, str]) -> None:
    """Trainer's world size against the job's: on a machine without GPUs, TrainingArguments
    without ``use_cpu`` does not join the launcher's process group and counts one rank, and every
    batch size derived from it is the job's divided by its ranks. Said here, at the cause, not
    later as "train_batch_size = 8: must equal ... = 16"."""
    launched = environ.get("WORLD_SIZE", "")
    seen = getattr(args, "world_size", None)
    if launched.isdigit() and int(launched) > 1 and seen == 1:
        raise ConfigError(f"Trainer sees world size 1, but this job has {launched} ranks (WORLD_SIZE={launched}): "
                          "TrainingArguments did not join the job's process group",
                          hint="on a machine without GPUs pass use_cpu=True (--use_cpu), so that every rank "
                               "joins it with gloo")


def fill_from_model(config: dict, args, *, hidden_size: int | None, num_training_steps: int,
                    warmup_steps: int) -> dict:
    """Step 2 (the model and the step count are known): bucket sizes from the hidden size, the
    scheduler's total and warm-up steps. ``hidden_size`` None with a bucket size left "auto" is
    an error saying which keys need a number."""
    facts = {"hidden_size": hidden_size, "num_training_steps": num_training_steps, "warmup_steps": warmup_steps}
    deepspeed = looks_like_deepspeed(config)
    if hidden_size is None:
        wanting = [path for rule in MODEL_RULES if "hidden_size" in rule.argument
                   for path in [_path(rule, deepspeed)] if path and _get(config, path) == AUTO
                   and rule.applies(config, deepspeed)]
        if wanting:
            raise ConfigError(
                f"cannot fill {', '.join(wanting)}: they are 'auto' and the model's config has no "
                "hidden_size (nor hidden_sizes, nor text_config.hidden_size)",
                hint="write a number for these keys instead of 'auto'")
    return apply_rules(config, args, facts, MODEL_RULES)


def hidden_size_of(model_config) -> int | None:
    """The width transformers sizes buckets by: hidden_size, else the largest of hidden_sizes,
    else the same looked up on text_config (multimodal models)."""
    for candidate in (model_config, getattr(model_config, "text_config", None)):
        if candidate is None:
            continue
        if getattr(candidate, "hidden_size", None) is not None:
            return candidate.hidden_size
        if getattr(candidate, "hidden_sizes", None):
            return max(candidate.hidden_sizes)
    return None


def remaining_autos(config: dict, prefix: str = "") -> list[str]:
    """Dotted keys still holding "auto" (the zerorun loader then applies its own defaults)."""
    found = []
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if value == AUTO:
            found.append(path)
        elif isinstance(value, dict):
            found.extend(remaining_autos(value, path))
    return found


def _path(rule: Rule, deepspeed: bool) -> str | None:
    return rule.deepspeed if deepspeed else rule.zerorun


def apply_rules(config: dict, args, facts: dict, rules, source: str = "TrainingArguments") -> dict:
    """A copy of ``config`` with ``rules`` applied: autos filled, disagreements raised together;
    ``source`` names where the values come from in the error."""
    out = copy.deepcopy(config)
    deepspeed = looks_like_deepspeed(out)
    mismatches = []
    for rule in rules:
        path = _path(rule, deepspeed)
        if path is None or not rule.applies(out, deepspeed):
            continue
        parent, leaf = parent_of(out, path)
        if parent is None or leaf not in parent:
            continue  # absent keys stay absent
        wanted = rule.value(args, facts)
        if parent[leaf] == AUTO:
            parent[leaf] = wanted
        elif rule.must_match and not _same(parent[leaf], wanted):
            mismatches.append(f"{path}={parent[leaf]!r} in the zerorun config vs "
                              f"{source} {rule.argument}={wanted!r}")
    if mismatches:
        raise AutoConfigMismatch(
            f"the zerorun config disagrees with {source}:\n  - " + "\n  - ".join(mismatches),
            hint="set these config values to \"auto\" (filled from the arguments) or change the arguments")
    return out


def parent_of(config: dict, path: str) -> tuple[dict | None, str]:
    *parents, leaf = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node if isinstance(node, dict) else None), leaf


def _get(config: dict, path: str) -> Any:
    parent, leaf = parent_of(config, path)
    return None if parent is None else parent.get(leaf)


def _same(have: Any, want: Any) -> bool:
    if isinstance(have, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(have) == len(want) and all(_same(h, w) for h, w in zip(have, want, strict=True))
    if isinstance(have, bool) or isinstance(want, bool):
        return isinstance(have, bool) and isinstance(want, bool) and have == want
    if isinstance(have, (int, float)) and isinstance(want, (int, float)):
        return float(have) == float(want)
    return have == want
