"""``deepspeed.initialize`` with DeepSpeed's signature and return value, on zerorun's engine.

    pytest tests/unit/test_deepspeed_initialize.py

What it does beyond ``zerorun.initialize`` is DeepSpeed's bookkeeping:
* the config comes from ``config``, ``config_params`` or ``args.deepspeed_config`` (two of them at
  once is an error, as in DeepSpeed); none of them: the launcher's ``--config``, else defaults;
* ``optimizer`` may be an optimizer or a callable taking the parameters; with none, the config's
  optimizer is built over ``model_parameters`` (tensors or param-group dicts) when given;
* ``lr_scheduler`` may be a scheduler or a callable taking the optimizer; a passed one wins over
  the config's, as in DeepSpeed, and ``engine.step()`` steps it after each applied update;
* ``training_data`` becomes a DataLoader of micro-batches over a DistributedSampler of this rank's
  share, shuffled with seed 0 and never re-seeded per epoch, exactly as DeepSpeed's loader.
At stage 3 every parameter, trainable or frozen, carries DeepSpeed's ``ds_*`` attributes
(deepspeed/ds_params.py, attached through the engine hook this package registers).
* no optimizer and no optimizer section: an engine for forward passes only (evaluation, a frozen
  reference model, Trainer's ``evaluate()`` before ``train()``), returned with optimizer None as
  DeepSpeed returns it; its ``backward``/``step`` raise. Underneath it is the same sharded engine
  over an SGD of learning rate 0 (it never steps), so stage 3 gathers as in training;
* ``engine.config`` is a DeepSpeed-shaped dict that still answers the typed fields
  (deepspeed/config_view.py); ``engine.optimizer.overflow`` says whether the last step was
  skipped (fp16), as DeepSpeed's optimizers do.
Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.
"""

from __future__ import annotations

import os
from typing import cast

from zerorun.config.schema import ZerorunConfig
from zerorun.deepspeed.config_view import DeepSpeedConfigView
from zerorun.deepspeed.unsupported import refuse
from zerorun.errors import ConfigError, UsageError


def _config_source(args, config, config_params):
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("a DeepSpeed config was given both as args.deepspeed_config and to initialize()",
                              hint="pass it once: config=... or --deepspeed_config")
        config = from_args
    return config


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    from torch import nn

    from zerorun.deepspeed.comm import init_distributed
    from zerorun.zero.engine import initialize as engine_initialize

    if not isinstance(model, nn.Module):
        raise ConfigError("deepspeed.initialize needs model= (a torch.nn.Module)",
                          hint="deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(), ...)")
    if mpu is not None:
        raise refuse("deepspeed.initialize(mpu=...)", "model parallelism (tensor and pipeline parallel groups)")
    if mesh_param is not None:
        raise refuse("deepspeed.initialize(mesh_param=...)", "sequence parallelism (a device mesh)")
    source = _config_source(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if model_parameters is not None:
        model_parameters = list(model_parameters)  # a generator would be spent by the first reader
    if callable(optimizer) and not hasattr(optimizer, "param_groups"):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    forward_only = optimizer is None and not _config_has_optimizer(source)
    if forward_only:
        optimizer = _never_stepping_optimizer(model, model_parameters)
    engine = engine_initialize(model, optimizer, source, model_parameters=model_parameters)
    # The view reads as the ZerorunConfig it wraps through attributes (and as DeepSpeed's dict by key).
    engine.config = cast(ZerorunConfig, DeepSpeedConfigView(engine.config, _given_dict(source)))
    engine.optimizer.overflow = False
    if forward_only:
        # Instance attributes: this engine only, the class keeps its methods.
        engine.backward = engine.step = _refuse_training  # type: ignore[method-assign]
    if lr_scheduler is not None:
        engine.lr_scheduler = lr_scheduler(engine.optimizer) if _is_factory(lr_scheduler) else lr_scheduler
    loader = _training_loader(engine, training_data, collate_fn) if training_data is not None else None
    return engine, None if forward_only else engine.optimizer, loader, engine.lr_scheduler


def _config_source_or_launchers(source):
    import os

    return source if source is not None else os.environ.get("ZERORUN_CONFIG") or None


def _config_has_optimizer(source) -> bool:
    from zerorun.config import load_config

    source = _config_source_or_launchers(source)
    if source is None:
        return False
    return load_config(source, environ={}).optimizer is not None


def _given_dict(source) -> dict | None:
    """The DeepSpeed dict behind the config (a dict, or a JSON file), for engine.config's view."""
    from zerorun.config.deepspeed import looks_like_deepspeed
    from zerorun.config.sources import read_file

    source = _config_source_or_launchers(source)
    if isinstance(source, (str, os.PathLike)):
        try:
            source = read_file(os.fspath(source))
        except Exception:  # the engine already loaded it; a view without it is still right
            return None
    return source if isinstance(source, dict) and looks_like_deepspeed(source) else None


def _never_stepping_optimizer(model, model_parameters):
    """SGD at learning rate 0 over the trainable parameters: the engine's shards need an
    optimizer to be built, and this one never steps (backward/step are refused)."""
    import torch

    params = list(model_parameters) if model_parameters is not None else [
        p for p in model.parameters() if p.requires_grad]
    # One group, possibly empty (a wholly frozen model): torch refuses only an empty list of groups.
    return torch.optim.SGD([{"params": params}], lr=0.0)


def _refuse_training(*args, **kwargs):
    raise UsageError("this engine was built without an optimizer (deepspeed.initialize without optimizer= "
                     "and a config without an 'optimizer' section): it runs forward passes only",
                     hint="pass optimizer=... or add an optimizer section to train with it")


def _is_factory(scheduler) -> bool:
    """A scheduler object has step(); a callable without one makes a scheduler from the optimizer."""
    return callable(scheduler) and not hasattr(scheduler, "step")


def _training_loader(engine, dataset, collate_fn):
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

    micro = engine.train_micro_batch_size_per_gpu()
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=micro, collate_fn=collate_fn)
    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.rank)
    return DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                      pin_memory=engine.device.type == "cuda", num_workers=0)
