"""Rules a well-typed config must still satisfy: ranges, combinations, the batch-size rule.

Pure functions of the built config (plus torch.optim for class names); each records problems
with the key path and the fix instead of raising, so one error lists everything.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import replace
from typing import Any
from collections.abc import Callable, Sequence

from zerorun.config.problems import Problems, did_you_mean
from zerorun.config.schema import BatchConfig, ZerorunConfig

Check = tuple[Callable[[Any], bool], str]


def _at_least(low: float) -> Check:
    return (lambda v: v >= low), f"must be at least {low}"


def _above(low: float) -> Check:
    return (lambda v: v > low), f"must be greater than {low}"


def _within(low: int, high: int) -> Check:
    return (lambda v: low <= v <= high), f"must be between {low} and {high}"


# A bucket of more elements than this (4 TiB in fp32) is a typo, and workers would fail to
# allocate it after start; the largest bucket any known config uses is about 1e9.
MAX_BUCKET = 2**40
# Seconds: beyond this (about 31 years) a timeout overflows the waits that use it.
MAX_SECONDS = 1e9
# Telemetry samples more often than this would busy the rank they measure (1e-9 was accepted).
MIN_INTERVAL_S = 0.01


def _seconds_or_zero(zero_means: str) -> Check:
    return (lambda v: v == 0 or MIN_INTERVAL_S <= v <= MAX_SECONDS), (
        f"must be 0 ({zero_means}) or a number of seconds from {MIN_INTERVAL_S} to {MAX_SECONDS:g}")


# Every numeric key and its allowed range; a unit test checks no numeric key is missing here.
RANGES: dict[str, Check] = {
    "zero.stage": ((lambda v: v in (0, 1, 2, 3)), "must be a ZeRO stage: 0, 1, 2 or 3"),
    "zero.reduce_bucket_size": _within(1, MAX_BUCKET),
    "zero.allgather_bucket_size": _within(1, MAX_BUCKET),
    "zero.update_bucket_size": _within(1, MAX_BUCKET),
    "zero.prefetch_bucket_size": _within(0, MAX_BUCKET),
    "zero.turn_prefetch_bucket_size": _within(0, MAX_BUCKET),
    "zero.max_live_parameters": _within(1, MAX_BUCKET),
    "zero.param_persistence_threshold": _at_least(0),
    "zero.max_reuse_distance": _at_least(0),
    "zero.quantization_block_size": _within(1, 2**30),
    "zero.hpz_partition_size": _within(1, 2**20),
    "zero.offload_optimizer.buffer_count": _at_least(1),
    "zero.offload_optimizer.buffer_size": _at_least(1),
    "zero.offload_param.buffer_count": _at_least(1),
    "zero.offload_param.buffer_size": _at_least(1),
    "precision.loss_scale": ((lambda v: v >= 0), "must be 0 (dynamic) or a positive static scale"),
    "precision.initial_scale_power": _within(0, 63),
    "precision.loss_scale_window": _at_least(1),
    "precision.hysteresis": _at_least(1),
    "precision.min_loss_scale": _above(0),
    "batch.train_batch_size": _at_least(1),
    "batch.micro_batch_size": _at_least(1),
    "batch.gradient_accumulation_steps": _at_least(1),
    "gradient_clipping": ((lambda v: v >= 0), "must be 0 (off) or a positive max gradient norm"),
    "telemetry.interval_s": ((lambda v: MIN_INTERVAL_S <= v <= MAX_SECONDS),
                             f"must be from {MIN_INTERVAL_S} to {MAX_SECONDS:g} seconds between samples"),
    "telemetry.total_steps": _at_least(1),
    "telemetry.hang_after_s": ((lambda v: MIN_INTERVAL_S <= v <= MAX_SECONDS),
                               f"must be from {MIN_INTERVAL_S} to {MAX_SECONDS:g} seconds"),
    "telemetry.hang_timeout_s": _seconds_or_zero("never"),
    "telemetry.startup_timeout_s": _seconds_or_zero("never"),
    "checkpoint.interval_steps": ((lambda v: v >= 0), "must be 0 (only when asked) or a step count"),
    "checkpoint.keep_last": _at_least(1),
    "seed": _within(0, 2**32 - 1),
}


def get_path(config: Any, path: str) -> Any:
    for part in path.split("."):
        if config is None:
            return None
        config = getattr(config, part)
    return config


def check_ranges(config: ZerorunConfig, problems: Problems) -> None:
    for path, (allowed, requirement) in RANGES.items():
        value = get_path(config, path)
        if value is not None and not allowed(value):
            problems.add(path, requirement, value)


def check_combinations(config: ZerorunConfig, problems: Problems) -> None:
    """Settings that are each valid but cannot work together."""
    zero = config.zero
    if zero.offload_param.device != "none" and zero.stage != 3:
        problems.add(
            "zero.offload_param.device", f"parameter offload needs ZeRO stage 3 (stage is "
            f"{zero.stage}); set zero.stage: 3 or offload_param.device: none",
            zero.offload_param.device)
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        problems.add(
            "zero.offload_optimizer.device", "optimizer offload needs ZeRO stage 1, 2 or 3 (stage "
            "is 0); raise zero.stage or set offload_optimizer.device: none",
            zero.offload_optimizer.device)
    for key, low, what in (("quantized_weights", 3, "quantized weight gathers (ZeRO++ qwZ) need ZeRO stage 3"),
                           ("quantized_nontrainable_weights", 3, "quantized weight gathers need ZeRO stage 3"),
                           ("quantized_gradients", 2, "quantized gradient reduce-scatters (ZeRO++ qgZ) need ZeRO stage 2 or 3")):
        if getattr(zero, key) and zero.stage < low:
            problems.add(f"zero.{key}", f"{what} (stage is {zero.stage}); raise zero.stage or set {key}: false", True)
    if zero.hpz_partition_size > 1 and zero.stage != 3:
        problems.add("zero.hpz_partition_size", "hierarchical partitioning (ZeRO++ hpZ) partitions stage 3's "
                     f"parameters (stage is {zero.stage}); set zero.stage: 3 or hpz_partition_size: 1",
                     zero.hpz_partition_size)
    if zero.turn_prefetch_bucket_size is not None and zero.prefetch_bucket_size <= 0:
        problems.add("zero.turn_prefetch_bucket_size", "the gathers at the turn into backward extend stage 3's "
                     "prefetch budget, which is 0; set zero.prefetch_bucket_size too, or remove "
                     "turn_prefetch_bucket_size", zero.turn_prefetch_bucket_size)
    if zero.tied_embedding_rows and zero.stage != 3:
        problems.add("zero.tied_embedding_rows", "a tied embedding's rows replace the gathers and reduce-scatters "
                     f"of stage 3's partitioned table (stage is {zero.stage}); set zero.stage: 3 or "
                     "tied_embedding_rows: false", True)
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, name)
        if offload.device == "nvme" and not offload.nvme_path:
            problems.add(f"zero.{name}.nvme_path", "NVMe offload needs a directory on a fast local "
                         f"disk; set zero.{name}.nvme_path", offload.nvme_path)
    ckpt = config.checkpoint
    if (ckpt.on_signal or ckpt.requeue) and not ckpt.dir:
        problems.add("checkpoint.dir", "checkpoint.on_signal saves a checkpoint on SIGUSR1/SIGUSR2 but "
                     "there is no directory to write to; set checkpoint.dir", ckpt.dir)
    if ckpt.requeue and not ckpt.on_signal:
        problems.add("checkpoint.requeue", "checkpoint.requeue requeues after the save on a signal; "
                     "set checkpoint.on_signal: true as well", ckpt.requeue)
    if ckpt.interval_steps > 0 and not ckpt.dir:
        problems.add("checkpoint.dir", f"checkpoint.interval_steps is {ckpt.interval_steps} but "
                     "there is no directory to write to; set checkpoint.dir", ckpt.dir)
    if ckpt.resume and not ckpt.dir:
        problems.add("checkpoint.dir", "checkpoint.resume (--resume) is set but there is no directory "
                     "to resume from; set checkpoint.dir", ckpt.dir)


def check_torch_names(config: ZerorunConfig, problems: Problems) -> None:
    """Optimizer/scheduler ``type`` must name a torch class whose keywords match ``params``."""
    if config.optimizer is None and config.scheduler is None:
        return
    import torch  # deferred: only configs naming torch classes pay for the import

    if config.optimizer is not None:
        classes = _subclasses_in(torch.optim, torch.optim.Optimizer)
        if _check_class("optimizer", config.optimizer.type, config.optimizer.params, classes,
                        "torch.optim", problems):
            _check_values("optimizer", classes[config.optimizer.type], config.optimizer.params, "torch.optim",
                          problems)
    if config.scheduler is not None:
        from zerorun.schedulers import scheduler_classes  # torch's classes and DeepSpeed's five

        classes = scheduler_classes()
        if _check_class("scheduler", config.scheduler.type, config.scheduler.params, classes,
                        "torch.optim.lr_scheduler", problems):
            _check_values("scheduler", classes[config.scheduler.type], config.scheduler.params,
                          "torch.optim.lr_scheduler", problems)


def _check_values(section: str, cls: type, params: dict, module_name: str, problems: Problems) -> None:
    """The class takes these values: built once here on a one-element stand-in parameter (a
    scheduler on an SGD with momentum over it), so ``lr: "abc"`` or ``lr: -1.0`` is refused
    before start instead of by every worker after it."""
    import torch

    module = cls.__module__ if cls.__module__.startswith("zerorun.") else module_name
    owner = f"{module}.{cls.__name__}"  # torch.optim.AdamW, torch.optim.lr_scheduler.StepLR
    defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items()}
    for key, value in params.items():
        default = defaults.get(key)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(value, str):
            problems.add(f"{section}.params.{key}", f"{owner} takes a number here (default {default!r}), "
                         "not a string", value)
            return
    stand_in = torch.nn.Parameter(torch.zeros(1))
    try:
        with warnings.catch_warnings():  # its notes about the stand-in are not the user's
            warnings.simplefilter("ignore")
            _build_stand_in(section, cls, stand_in, params)
    except Exception as err:  # the class's own check, in its own words
        why = " ".join(str(err).split()) or type(err).__name__
        problems.add(f"{section}.params", f"{owner} refuses them: {why[:200]}", params)


def _subclasses_in(module: Any, base: type) -> dict[str, type]:
    return {
        name: obj for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base
        and not name.startswith("_")
    }


def _check_class(section: str, name: str, params: dict, classes: dict[str, type],
                 module_name: str, problems: Problems) -> bool:
    """Whether ``name`` is a class of ``classes`` whose keywords match ``params`` (problems
    recorded otherwise)."""
    cls = classes.get(name)
    if cls is None:
        problems.add(f"{section}.type", f"not a class in {module_name}{did_you_mean(name, classes)}; "
                     f"choose one of {', '.join(sorted(classes))}", name)
        return False
    signature = inspect.signature(cls)  # the constructor's, without self
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return True
    before = len(problems.items)
    # The engine supplies the first positional argument (parameters or the optimizer).
    accepted = [p for p in list(signature.parameters)[1:]]
    ours = cls.__module__.startswith("zerorun.")
    owner = f"{cls.__module__ if ours else module_name}.{name}"  # zerorun.schedulers.WarmupLR, torch.optim.SGD
    if ours:
        # Our classes' required arguments are known data (DeepSpeed's total_num_steps, cycle
        # bounds): report them missing now, not when the first worker builds the scheduler.
        for param in list(signature.parameters.values())[1:]:
            if param.default is param.empty and param.name not in params:
                problems.add(f"{section}.params.{param.name}", f"{owner} needs this argument")
    for key, value in params.items():
        if key not in accepted:
            problems.add(f"{section}.params.{key}", f"{owner} takes no such argument"
                         f"{did_you_mean(key, accepted)}; it accepts {', '.join(accepted)}")
        elif value == "auto":
            problems.add(f"{section}.params.{key}", "'auto' is a Hugging Face Trainer placeholder; "
                         "give a value or remove the key to use torch's default", value)
    return len(problems.items) == before


def _build_stand_in(section: str, cls: type, stand_in, params: dict) -> None:
    import torch

    if section == "optimizer":
        cls([stand_in], **params)
    else:
        cls(torch.optim.SGD([stand_in], lr=0.1, momentum=0.9), **params)


def resolve_batch(batch: BatchConfig, world_size: int | None, problems: Problems) -> BatchConfig:
    """Apply train_batch = micro_batch x accumulation x world_size.

    With the world size known the missing size is derived (one given size alone implies
    accumulation 1) and a fully given triple is checked; without it only divisibility is checked.
    """
    train, micro, accum = batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps
    given = f"train_batch_size={train}, micro_batch_size={micro}, gradient_accumulation_steps={accum}"
    if world_size is None:
        if train is not None and micro is not None and accum is not None and train % (micro * accum):
            problems.add("batch.train_batch_size", f"is not a multiple of micro_batch_size x "
                         f"gradient_accumulation_steps = {micro * accum}, so no world size fits; "
                         f"adjust one of them", train)
        return batch
    if train is None:
        if micro is None:
            return batch  # the script batches its own data; nothing to derive
        accum = accum or 1
        return replace(batch, train_batch_size=micro * accum * world_size, gradient_accumulation_steps=accum)
    if micro is None:
        accum = accum or 1
        if train % (accum * world_size):
            problems.add("batch.train_batch_size", f"cannot be split evenly over {world_size} ranks x "
                         f"{accum} accumulation steps ({given}); make it a multiple of "
                         f"{accum * world_size}", train)
            return batch
        return replace(batch, micro_batch_size=train // (accum * world_size), gradient_accumulation_steps=accum)
    if accum is None:
        if train % (micro * world_size):
            problems.add("batch.train_batch_size", f"is not micro_batch_size x world_size "
                         f"({micro} x {world_size}) times a whole number of accumulation steps; "
                         f"make it a multiple of {micro * world_size}", train)
            return batch
        return replace(batch, gradient_accumulation_steps=train // (micro * world_size))
    if train != micro * accum * world_size:
        problems.add("batch.train_batch_size", f"must equal micro_batch_size x gradient_accumulation_steps"
                     f" x world_size = {micro} x {accum} x {world_size} = {micro * accum * world_size}; "
                     "fix one of them or leave one out to have it derived", train)
    return batch


def check_hpz(hpz: int, world_size: int | None, hosts: Sequence[int] | None, problems: Problems) -> None:
    """``zero.hpz_partition_size`` against the job (Note [secondary copy] in zero/unit/secondary.py):
    it divides the world size, and each group of that many consecutive ranks is on one host
    (``hosts``: each rank's host, ranks numbered host by host; None when not known)."""
    if hpz <= 1 or world_size is None:
        return
    if world_size % hpz:
        problems.add("zero.hpz_partition_size", f"must divide the world size ({world_size} ranks); use "
                     "the ranks per host or a divisor of it", hpz)
        return
    if hosts is None or len(hosts) != world_size:
        return
    per_host = {host: hosts.count(host) for host in hosts}
    split = [start for start in range(0, world_size, hpz) if len(set(hosts[start:start + hpz])) > 1]
    if split or any(count % hpz for count in per_host.values()):
        counts = ",".join(str(count) for count in per_host.values())
        problems.add("zero.hpz_partition_size", f"must equal the ranks per host or divide it (ranks per "
                     f"host: {counts}); the secondary copies are partitioned within one host", hpz)
