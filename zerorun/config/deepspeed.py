"""DeepSpeed JSON -> a zerorun config dict, with every DeepSpeed key accounted for.

Each DeepSpeed key is one of:
  Map         carried onto a zerorun key (the value is checked there, errors name the DeepSpeed key)
  Note        accepted, but has no effect in zerorun: loading records a note saying so; when the
              value asks for behaviour zerorun lacks (``harmless`` says no) it is an error instead
  Unsupported a feature zerorun does not have: always an error naming the key
A key with no rule is judged by where it is. Inside a section it is an unknown key, reported with
a did-you-mean (DeepSpeed's section models refuse extra fields too). At the top level DeepSpeed
reads only the names it knows and ignores the rest (TRL's ``prepare_deepspeed`` writes dotted
names such as ``"zero_optimization.reduce_bucket_size"`` there), so such a key is accepted with a
note saying it is ignored (Note [ignored top-level keys]). Nothing is dropped silently.

"auto" values are placeholders the Hugging Face integration fills in from the Trainer's own
arguments before loading. What it leaves is read as DeepSpeed reads it:
* the batch sizes are derived from the other two and the world size;
* a key of ``zero_optimization`` (offload sections included) takes zerorun's default, with a note
  naming the key: DeepSpeed's config models drop a field whose value is "auto", so its default
  applies there too (Trainer fills ``stage3_prefetch_bucket_size`` only at stage 3, and the same
  config runs at stage 2 under DeepSpeed);
* any other "auto" is an error naming the key: DeepSpeed has no rule for it (it would hand the
  string to the optimizer, or read ``bf16.enabled: auto`` as true), and a zerorun default in its
  place would train differently without saying so.
docs/config.md carries the same table for users.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from zerorun.config.problems import Problems, did_you_mean, join_path, unknown_key_message


@dataclass(frozen=True)
class Map:
    target: str
    transform: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Note:
    text: str
    harmless: Callable[[Any], bool] = lambda value: True


def _disabled(value: Any) -> bool:
    """A feature section that asks for nothing: false/null, ``{"enabled": false, ...}``, or (for
    ``compression_training``, which has no switch of its own) sub-sections all switched off."""
    if value is None or value is False or value == {}:
        return True
    if not isinstance(value, dict):
        return False
    if "enabled" in value:
        return not value["enabled"]
    parts = [part for part in value.values() if isinstance(part, dict)]
    return bool(parts) and len(parts) == len(value) and all(
        not (part.get("shared_parameters") or {}).get("enabled", False) for part in parts)


@dataclass(frozen=True)
class Unsupported:
    """A feature zerorun lacks: an error, unless the section leaves it off (DeepSpeed-Chat writes a
    disabled ``hybrid_engine`` section every time): then a note, as DeepSpeed ignores it."""

    text: str
    off: Callable[[Any], bool] = _disabled


@dataclass(frozen=True)
class Handled:
    """Read by a dedicated function (precision flags, optimizer, scheduler), not by the walker."""


HANDLED = Handled()


@dataclass(frozen=True)
class Section:
    """A nested mapping walked by ``spec``; when ``off`` says the section is switched off, one
    note replaces its keys' notes (DeepSpeed reads nothing else from it then)."""

    spec: dict
    off: Callable[[Any], bool] | None = None


@dataclass
class Translation:
    """The zerorun dict plus what the translation noticed; aliases map zerorun -> DeepSpeed paths."""

    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: Problems = field(default_factory=Problems)
    aliases: dict[str, str] = field(default_factory=dict)


def _off(value: Any) -> bool:
    return value is False or value is None or (isinstance(value, dict) and not value.get("enabled"))


def _offload_device(value: Any) -> Any:
    return "none" if value is None else value


NO_EFFECT = "has no effect in zerorun"
TELEMETRY = "zerorun's telemetry (live dashboard, metrics.jsonl) replaces it; " + NO_EFFECT

OFFLOAD_COMMON = {
    "device": Map("device", _offload_device),
    "nvme_path": Map("nvme_path"),
    "pin_memory": Map("pin_memory"),
    "buffer_count": Map("buffer_count"),
    "buffer_size": Map("buffer_size"),
}
OFFLOAD_OPTIMIZER = {
    **OFFLOAD_COMMON,
    "fast_init": Note(NO_EFFECT),
    "pipeline": Note(NO_EFFECT), "pipeline_read": Note(NO_EFFECT), "pipeline_write": Note(NO_EFFECT),
    "ratio": Note("partial optimizer offload is not supported; remove it or set 1.0",
                  harmless=lambda v: v in (1, 1.0)),
}
OFFLOAD_PARAM = {
    **OFFLOAD_COMMON,
    "max_in_cpu": Note(NO_EFFECT),
}

def _under(prefix: str, spec: dict) -> Section:
    """The offload specs map relative names; anchor them under a zerorun section."""
    return Section({key: Map(f"{prefix}.{rule.target}", rule.transform) if isinstance(rule, Map) else rule
                    for key, rule in spec.items()})


# ``checkpoint`` beside DeepSpeed keys: DeepSpeed's own keys tune its checkpoint engine and have
# no effect here; zerorun's keys (a user who wrote ``dir`` and ``resume`` asked for checkpoints)
# are carried over. The whole section used to be one "no effect" note, which a config dict in
# the script never showed: checkpoints were silently not written.
CHECKPOINT = {
    **{key: Map(f"checkpoint.{key}") for key in ("dir", "interval_steps", "keep_last", "resume", "on_signal",
                                                 "requeue")},
    **{key: Note("DeepSpeed's checkpoint engine setting; " + NO_EFFECT) for key in (
        "tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
        "checkpoint_serialization", "writer")},
}

# DeepSpeed's monitor sections, with its meanings: the launcher writes them (telemetry/monitor.py).
MONITOR_TENSORBOARD = {key: Map(f"monitor.tensorboard.{key}") for key in ("enabled", "output_path", "job_name")}
MONITOR_CSV = {key: Map(f"monitor.csv.{key}") for key in ("enabled", "output_path", "job_name")}
MONITOR_WANDB = {key: Map(f"monitor.wandb.{key}") for key in ("enabled", "project", "group", "team")}

ZERO_OPTIMIZATION = {
    "stage": Map("zero.stage"),
    "overlap_comm": Map("zero.overlap_comm"),
    "reduce_bucket_size": Map("zero.reduce_bucket_size"),
    "allgather_bucket_size": Map("zero.allgather_bucket_size"),
    "stage3_prefetch_bucket_size": Map("zero.prefetch_bucket_size"),
    "stage3_param_persistence_threshold": Map("zero.param_persistence_threshold"),
    "offload_optimizer": _under("zero.offload_optimizer", OFFLOAD_OPTIMIZER),
    "offload_param": _under("zero.offload_param", OFFLOAD_PARAM),
    "cpu_offload": Map("zero.offload_optimizer.device", lambda v: "cpu" if v is True else "none" if v is False else v),
    "cpu_offload_params": Map("zero.offload_param.device", lambda v: "cpu" if v is True else "none" if v is False else v),
    "cpu_offload_use_pin_memory": Note("set pin_memory inside offload_optimizer/offload_param instead; " + NO_EFFECT),
    "contiguous_gradients": Note("zerorun manages its own gradient buffers; " + NO_EFFECT),
    "reduce_scatter": Note("zerorun reduce-scatters gradients from stage 2 on and all-reduces below it",
                           harmless=lambda v: v is True),
    "allgather_partitions": Note("zerorun all-gathers updated shards by bucket itself",
                                 harmless=lambda v: v is True),
    "sub_group_size": Note("zerorun steps the optimizer bucket by bucket; " + NO_EFFECT),
    "stage3_max_live_parameters": Map("zero.max_live_parameters"),
    "stage3_max_reuse_distance": Map("zero.max_reuse_distance"),
    "stage3_gather_16bit_weights_on_model_save": Note("engine.full_state_dict() gives the whole model; " + NO_EFFECT),
    "stage3_gather_fp16_weights_on_model_save": Note("engine.full_state_dict() gives the whole model; " + NO_EFFECT),
    "round_robin_gradients": Note(NO_EFFECT),
    "load_from_fp32_weights": Note(NO_EFFECT, harmless=lambda v: v is True),
    "elastic_checkpoint": Note(NO_EFFECT),
    "ignore_unused_parameters": Note("zerorun handles parameters unused in a step", harmless=lambda v: v is True),
    "memory_efficient_linear": Note(NO_EFFECT),
    "legacy_stage1": Note("there is only one stage 1 in zerorun", harmless=lambda v: v is False),
    "use_multi_rank_bucket_allreduce": Note(NO_EFFECT),
    "zero_hpz_partition_size": Map("zero.hpz_partition_size"),
    "zero_quantized_weights": Map("zero.quantized_weights"),
    "zero_quantized_gradients": Map("zero.quantized_gradients"),
    "zero_quantized_nontrainable_weights": Map("zero.quantized_nontrainable_weights"),
    "mics_shard_size": Note("MiCS sharding is not supported; remove it", harmless=lambda v: v in (-1, 0)),
    "mics_hierarchical_params_gather": Note("MiCS is not supported; remove it", harmless=lambda v: v is False),
}


LOSS_SCALING = {
    "loss_scale": Map("precision.loss_scale"),
    "initial_scale_power": Map("precision.initial_scale_power"),
    "loss_scale_window": Map("precision.loss_scale_window"),
    "hysteresis": Map("precision.hysteresis"),
    "min_loss_scale": Map("precision.min_loss_scale"),
}
FP16 = {
    "enabled": HANDLED,  # read by _precision
    **LOSS_SCALING,
    "consecutive_hysteresis": Note("zerorun's dynamic loss scaler resets hysteresis on overflow only",
                                   harmless=lambda v: v is False),
    "auto_cast": Note("zerorun does not cast model inputs; cast them in the script and remove it",
                      harmless=lambda v: v is False),
    "fp16_master_weights_and_grads": Note("zerorun keeps fp32 master weights; remove it",
                                          harmless=lambda v: v is False),
}
BF16 = {
    "enabled": HANDLED,
    "immediate_grad_update": Note(NO_EFFECT),
    "check_grad_overflow": Note(NO_EFFECT),
}
# DeepSpeed's hybrid engine runs generate() on inference kernels built from the training weights
# (DeepSpeed-Chat's step 3 turns it on with --enable_hybrid_engine). zerorun's generate() is the
# training model's own forward, stage-3 parameters gathered unit by unit as in training, so the
# answers are the model's; the kernels' tuning options have nothing to act on.
HYBRID_ENGINE_KERNELS = "an inference-kernel option of DeepSpeed's hybrid engine; " + NO_EFFECT
HYBRID_ENGINE = {
    "enabled": Note("generate() runs the training model's own forward (stage 3 gathers parameters "
                    "as in training); DeepSpeed's inference kernels are not used"),
    **{key: Note(HYBRID_ENGINE_KERNELS) for key in (
        "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
        "tp_gather_partition_size", "enable_cuda_graph")},
}
UNSUPPORTED_FEATURE = "is a DeepSpeed feature zerorun does not have; remove this section"

TOP_LEVEL: dict[str, Any] = {
    "train_batch_size": Map("batch.train_batch_size"),
    "train_micro_batch_size_per_gpu": Map("batch.micro_batch_size"),
    "gradient_accumulation_steps": Map("batch.gradient_accumulation_steps"),
    "gradient_clipping": Map("gradient_clipping"),
    "zero_optimization": Section(ZERO_OPTIMIZATION),
    "fp16": Section(FP16),
    "bf16": Section(BF16),
    "bfloat16": Section(BF16),
    "optimizer": HANDLED,  # _optimizer
    "scheduler": HANDLED,  # _scheduler
    "steps_per_print": Note(TELEMETRY),
    "wall_clock_breakdown": Note(TELEMETRY),
    "memory_breakdown": Note(TELEMETRY),
    "dump_state": Note(NO_EFFECT),
    "tensorboard": Section(MONITOR_TENSORBOARD), "wandb": Section(MONITOR_WANDB),
    "csv_monitor": Section(MONITOR_CSV),
    "comet": Note(TELEMETRY + "; tensorboard, wandb and csv_monitor are written"), "comms_logger": Note(TELEMETRY), "flops_profiler": Note(TELEMETRY),
    "zero_allow_untested_optimizer": Note("zerorun shards any torch.optim optimizer"),
    "zero_force_ds_cpu_optimizer": Note("zerorun steps offloaded shards with the torch optimizer; " + NO_EFFECT),
    "activation_checkpointing": Note(
        "DeepSpeed's section tunes deepspeed.checkpointing calls in model code; use zerorun's "
        "activation_checkpointing.modules in a zerorun YAML config instead; " + NO_EFFECT),
    "checkpoint": Section(CHECKPOINT),
    "hybrid_engine": Section(HYBRID_ENGINE, off=lambda v: _disabled(v) or not v.get("enabled", False)),
    "aio": Note("zerorun's NVMe offload sets its own I/O parameters; " + NO_EFFECT),
    "prescale_gradients": Note("zerorun averages gradients after reduction; remove it",
                               harmless=lambda v: v is False),
    "gradient_predivide_factor": Note("zerorun averages gradients after reduction; remove it",
                                      harmless=lambda v: v in (1, 1.0)),
    "sparse_gradients": Note("sparse gradients are not supported; remove it", harmless=lambda v: v is False),
    "amp": Note("Apex AMP is not supported; use fp16 or bf16 instead", harmless=_off),
    "communication_data_type": Note("zerorun communicates in the training dtype; remove it",
                                    harmless=lambda v: v is None),
    "seq_parallel_communication_data_type": Note(NO_EFFECT),
    **{name: Unsupported(UNSUPPORTED_FEATURE) for name in (
        "data_types", "pipeline", "elasticity", "compression_training", "autotuning",
        "curriculum_learning", "data_efficiency", "sequence_parallel_size", "tensor_parallel",
        "quantize_training", "sparse_attention", "nebula", "eigenvalue",
        "progressive_layer_drop", "fp8", "torch_autocast", "compile")},
}

# Note [ignored top-level keys]
# DeepSpeed builds its config by asking the top-level dict for the names it knows
# (runtime/config.py, DeepSpeedConfig._initialize_params) and never looks at the others, so a
# name it does not read is ignored there: TRL's prepare_deepspeed adds
# "zero_optimization.reduce_bucket_size", "...stage3_param_persistence_threshold" and
# "...stage3_prefetch_bucket_size" as dotted top-level names for its reference model, which
# DeepSpeed never applies. zerorun accepts such a name with a note saying it is ignored. Two kinds
# stay errors: names DeepSpeed does read that this table does not (below: they change DeepSpeed's
# training, so ignoring them would train differently), and a near-miss of a name in this table
# (``gradient_clippng``), which DeepSpeed would drop silently and which is surely a typo.
DEEPSPEED_READS_UNHANDLED = frozenset({
    "managed_gradient_accumulation", "gradient_allreduce_op", "disable_allgather", "disable_python_gc",
    "dataloader_drop_last", "log_level", "datastates_checkpointing", "weight_quantization", "timers",
    "expert_parallel", "use_data_before_expert_parallelism", "use_data_before_expert_parallel_",
    "graph_harvesting", "zenflow",
})

# Keys that only a DeepSpeed config has at its top level: any one of them marks a DeepSpeed config.
DEEPSPEED_MARKERS = frozenset(TOP_LEVEL) - {"optimizer", "scheduler", "gradient_clipping", "checkpoint",
                                            "activation_checkpointing"}

# DeepSpeed optimizer names (case-insensitive, as DeepSpeed reads them) -> torch.optim classes.
# DeepSpeed's "Adam" is decoupled-weight-decay Adam unless params.adam_w_mode is false.
OPTIMIZER_NAMES = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
DEEPSPEED_ONLY_OPTIMIZERS = {"lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion", "muadam",
                             "muadamw", "musgd", "muon", "fusedadam", "cpuadam"}
# DeepSpeed's own defaults where they differ from the torch class it runs as: its FusedAdam and
# DeepSpeedCPUAdam (behind "Adam" and "AdamW") decay by 0 unless told, torch's AdamW by 0.01.
# SGD and Adagrad are torch's classes in DeepSpeed too, so their defaults already agree. A
# DeepSpeed config that leaves the key out must train as it does under DeepSpeed.
DEEPSPEED_DEFAULTS = {"adam": {"weight_decay": 0.0}, "adamw": {"weight_decay": 0.0}}
# Sections DeepSpeed reads through its config models, which drop "auto" fields (their default applies).
DEFAULTS_FOR_AUTO = ("zero_optimization.",)
AUTO_FIX = "'auto' is filled in only by the Hugging Face integration (HfDeepSpeedConfig / Trainer)"


def looks_like_deepspeed(data: dict) -> bool:
    return any(key in DEEPSPEED_MARKERS for key in data)


def translate(data: dict) -> Translation:
    """A DeepSpeed config (already parsed) -> Translation; never raises for bad user values."""
    out = Translation()
    _walk(data, TOP_LEVEL, "", out)
    _param_offload_below_stage3(data, out)
    _precision(data, out)
    if "optimizer" in data:
        _optimizer(data["optimizer"], out)
    if "scheduler" in data:
        _scheduler(data["scheduler"], out)
    return out


def _walk(section: Any, spec: dict, path: str, out: Translation) -> None:
    if not isinstance(section, dict):
        out.problems.add(path, "must be a mapping of keys to values", section)
        return
    for key, value in section.items():
        key_path = join_path(path, key)
        rule = spec.get(key)
        if rule is None and not path:
            _top_level_unknown(key, out)
        elif rule is None:
            out.problems.add(key_path, unknown_key_message(key, spec, "DeepSpeed key"))
        elif isinstance(rule, Map):
            _map(rule, value, key_path, out)
        elif isinstance(rule, Section) and rule.off is not None and _safe(rule.off, value):
            out.notes.append(f"{key_path}: disabled, so ignored")
        elif isinstance(rule, Section):
            _walk(value, rule.spec, key_path, out)
        elif isinstance(rule, Note):
            if _safe(rule.harmless, value):
                out.notes.append(f"{key_path}: accepted; {rule.text}")
            else:
                out.problems.add(key_path, f"not supported: {rule.text}", value)
        elif isinstance(rule, Unsupported):
            if _safe(rule.off, value):
                out.notes.append(f"{key_path}: disabled, so ignored (a DeepSpeed feature zerorun does not have)")
            else:
                out.problems.add(key_path, rule.text)


def _top_level_unknown(key: Any, out: Translation) -> None:
    """A top-level key with no rule: ignored with a note, as DeepSpeed ignores it, unless DeepSpeed
    acts on it or it is a near-miss of a key it reads (Note [ignored top-level keys])."""
    name = str(key)
    head = name.split(".", 1)[0]
    if name in DEEPSPEED_READS_UNHANDLED:
        out.problems.add(name, "a DeepSpeed key zerorun does not handle; remove it")
    elif "." in name and head in TOP_LEVEL:
        out.notes.append(f"{name!r} (a dotted name at the top level): ignored, as DeepSpeed ignores it; "
                         f"DeepSpeed reads only the nested key, inside {head!r}")
    elif "." not in name and did_you_mean(name, TOP_LEVEL):
        out.problems.add(name, unknown_key_message(name, TOP_LEVEL, "DeepSpeed key"))
    else:
        out.notes.append(f"{name!r}: not a key DeepSpeed reads; ignored, as DeepSpeed ignores it")


def _param_offload_below_stage3(data: dict, out: Translation) -> None:
    """DeepSpeed reads ``offload_param`` only at stage 3 and ignores it below (DeepSpeed-Chat
    writes it whenever --offload is given); zerorun, which would refuse it there, does the same
    with a note. Stage "auto" or absent is DeepSpeed's default, 0."""
    zero = data.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    offload = out.data.get("zero", {}).get("offload_param")
    if offload is None or (isinstance(stage, int) and stage >= 3) or stage == 3:
        return
    del out.data["zero"]["offload_param"]
    if offload.get("device", "none") != "none":
        out.notes.append(f"zero_optimization.offload_param: ignored below stage 3 (stage {stage!r}), as DeepSpeed "
                         "ignores it; parameters are offloaded only at stage 3")


def _safe(predicate: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(predicate(value))
    except Exception:  # a predicate meeting a value of the wrong type: not harmless
        return False


def _map(rule: Map, value: Any, ds_path: str, out: Translation) -> None:
    out.aliases[rule.target] = ds_path
    if value == "auto":
        if rule.target.startswith("batch."):
            out.notes.append(f"{ds_path}: 'auto' derived from the other batch sizes and the world size")
        elif ds_path.startswith(DEFAULTS_FOR_AUTO):
            out.notes.append(f"{ds_path}: 'auto' was not filled in; zerorun's default applies "
                             "(DeepSpeed takes its default for it too)")
        else:
            out.problems.add(ds_path, f"{AUTO_FIX}; give a value here, or remove the key for "
                             f"zerorun's default", value)
        return
    if rule.transform is not None:
        value = rule.transform(value)
    _set_path(out.data, rule.target, value)


def _set_path(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def _enabled(data: dict, name: str, out: Translation) -> bool:
    section = data.get(name)
    if not isinstance(section, dict):
        return False  # a non-mapping is reported by _walk
    value = section.get("enabled", False)
    if value == "auto":
        out.problems.add(f"{name}.enabled", f"{AUTO_FIX}; set it to true or false, or train through "
                         "the Hugging Face integration, which fills it in", value)
        return False
    if not isinstance(value, bool):
        out.problems.add(f"{name}.enabled", "must be true, false or 'auto'", value)
        return False
    return value


def _precision(data: dict, out: Translation) -> None:
    fp16 = _enabled(data, "fp16", out)
    bf16 = _enabled(data, "bf16", out) or _enabled(data, "bfloat16", out)
    if fp16 and bf16:
        out.problems.add("fp16.enabled", "fp16 and bf16 are both enabled; enable only one of them", True)
    out.aliases["precision.dtype"] = "fp16.enabled / bf16.enabled"
    _set_path(out.data, "precision.dtype", "fp16" if fp16 else "bf16" if bf16 else "fp32")


def _type_and_params(section: Any, key: str, kind: str, out: Translation) -> tuple[str, dict] | None:
    """A ``{"type": NAME, "params": {...}}`` section checked for shape; None when unusable."""
    if not isinstance(section, dict):
        out.problems.add(key, "must be a mapping with 'type' and 'params'", section)
        return None
    for name in section:
        if name not in ("type", "params"):
            out.problems.add(f"{key}.{name}", unknown_key_message(name, ["type", "params"]))
    params = section.get("params", {})
    if not isinstance(params, dict):
        out.problems.add(f"{key}.params", "must be a mapping of keyword arguments", params)
        params = {}
    name = section.get("type")
    if not isinstance(name, str):
        out.problems.add(f"{key}.type", f"must name {kind}", name)
        return None
    return name, dict(params)


def _optimizer(section: Any, out: Translation) -> None:
    checked = _type_and_params(section, "optimizer", "an optimizer, e.g. AdamW", out)
    if checked is None:
        return
    name, params = checked
    adam_w_mode = params.get("adam_w_mode", True)
    # DeepSpeed's implementation switches, meaningless for a torch.optim class.
    for switch in ("torch_adam", "adam_w_mode"):
        if switch in params:
            del params[switch]
            out.notes.append(f"optimizer.params.{switch}: accepted; zerorun runs a torch.optim class")
    if "bias_correction" in params:  # FusedAdam's switch; torch's Adam/AdamW always correct
        if params.pop("bias_correction") is not True:
            out.problems.add("optimizer.params.bias_correction", "torch's Adam and AdamW always apply bias "
                             "correction; remove it or set it to true", False)
    lowered = name.lower()
    for key, value in DEEPSPEED_DEFAULTS.get(lowered, {}).items():
        if key not in params:
            params[key] = value
            out.notes.append(f"optimizer.params.{key}: not given; DeepSpeed's default {value!r} applies")
    if lowered in DEEPSPEED_ONLY_OPTIMIZERS:
        out.problems.add("optimizer.type", "is a DeepSpeed-only optimizer; use a torch.optim class "
                         "such as AdamW, Adam or SGD", name)
        return
    torch_name = OPTIMIZER_NAMES.get(lowered, name)
    if lowered == "adam" and adam_w_mode is False:
        torch_name = "Adam"
    if torch_name != name:
        out.notes.append(f"optimizer.type: DeepSpeed's {name!r} runs as torch.optim.{torch_name}")
    out.data["optimizer"] = {"type": torch_name, "params": _without_auto(params, "optimizer.params", out)}
    out.aliases["optimizer.type"] = "optimizer.type"


def _scheduler(section: Any, out: Translation) -> None:
    checked = _type_and_params(section, "scheduler", "a torch.optim.lr_scheduler class", out)
    if checked is None:
        return
    name, params = checked
    # DeepSpeed's own schedulers (WarmupLR, ...) keep their names and parameters: zerorun.schedulers
    # implements them with DeepSpeed's formulas, beside every torch.optim.lr_scheduler class.
    out.data["scheduler"] = {"type": name, "params": _without_auto(params, "scheduler.params", out)}


def _without_auto(params: dict, path: str, out: Translation) -> dict:
    kept = {}
    for key, value in params.items():
        if value == "auto":
            out.problems.add(f"{path}.{key}", f"{AUTO_FIX}; give a value, or remove the key for the "
                             "class's default", value)
        else:
            kept[key] = value
    return kept
