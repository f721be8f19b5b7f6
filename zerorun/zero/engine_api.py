"""The names DeepSpeed code calls on its engine, as a mixin the ``Engine`` inherits.

    pytest tests/unit/test_deepspeed_initialize.py

DeepSpeed's engine is an ``nn.Module`` with a few dozen accessor methods; training scripts,
Hugging Face's and Accelerate's integration code call them (docs/deepspeed.md lists which). Here
they are thin reads of what the engine already owns (its config, process group, counters), so a
DeepSpeed script runs on zerorun's engine unchanged. Nothing here changes how the engine trains.

Two DeepSpeed habits worth a word:
* the engine stands in for the model: ``parameters()``, ``named_parameters()``, ``state_dict()``,
  ``train()``/``eval()`` and any other attribute the engine lacks reach ``engine.module``;
* ``gradient_accumulation_steps()`` is a method (zerorun's own counter is ``accumulation_steps``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import CheckpointError


# Every engine alive in this process, so ``deepspeed.zero.GatheredParameters`` can find the unit
# that holds a parameter (zerorun/deepspeed/zero.py).
LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()

# Note [engine hooks]: what another layer adds to an engine once its units are built (the
# DeepSpeed shim's ds_* attributes and tput_timer: zerorun/deepspeed/ds_params.py, Note
# [attributes from the shim]). The runtime calls them and never imports their layer.
_BUILT_HOOKS: list[Callable[[Any], None]] = []


def on_engine_built(hook: Callable[[Any], None]) -> None:
    """Call ``hook(engine)`` for every engine built from now on, and now for each one alive."""
    if hook not in _BUILT_HOOKS:
        _BUILT_HOOKS.append(hook)
        for engine in list(LIVE_ENGINES):
            hook(engine)


def engine_built(engine) -> None:
    """The engine's call, once its records exist (zero/engine.py)."""
    for hook in _BUILT_HOOKS:
        hook(engine)


class DeepSpeedEngineAPI:
    """Mixed into ``zerorun.zero.engine.Engine``; every name reads state the engine owns."""

    # -- where and who ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device the model was moved to (DeepSpeed: ``cuda:LOCAL_RANK``, or the CPU)."""
        return self.pg.device

    @property
    def local_rank(self) -> int:
        """DeepSpeed's ``engine.local_rank``: the index of this worker's GPU, so the idiom
        ``inputs.to(engine.local_rank)`` lands where the model is. DeepSpeed reads LOCAL_RANK and
        trains on ``cuda:LOCAL_RANK``; here the device contract chose the GPU (zerorun/worker/
        device.py), which under Slurm's per-task binding is the task's first visible GPU (0),
        not its local rank. On the CPU it is the local rank (LOCAL_RANK, SLURM_LOCALID, MPI's),
        for ``local_rank == 0`` checks; no integer means the CPU to ``.to()``: use ``engine.device``
        (DeepSpeed's ``get_accelerator().device_name(engine.local_rank)`` says "cpu" there)."""
        index = self.pg.device.index if self.pg.device.type == "cuda" else None
        if index is not None:
            return index
        from zerorun.worker.device import local_rank

        return local_rank(os.environ)

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    # -- the config, as DeepSpeed's accessors ----------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_size

    def fp16_enabled(self) -> bool:
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.dtype == "bf16"

    def zero_optimization_stage(self) -> int:
        return self.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (DeepSpeed's name for ``global_step``)."""
        return self.global_step

    # -- the engine standing in for the model ---------------------------------------------
    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        return self.module.named_parameters(prefix=prefix, recurse=recurse)

    def state_dict(self, *args, **kwargs) -> dict:
        """The model's state dict. At stage 3 a module holds only 0-byte views between uses, so
        there it is the gathered one (``full_state_dict(rank0_only=False)``: every rank must call)."""
        if self.stage == 3:
            return self.full_state_dict(rank0_only=False)
        return self.module.state_dict(*args, **kwargs)

    def zero_grad(self) -> None:
        """A no-op, as in DeepSpeed's training loop: ``step()`` clears gradients after each update."""

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails: the model's attributes (DeepSpeed's engine is an
        # nn.Module wrapping it, so ``engine.config`` of a HF model ... is the model's there; here
        # zerorun's own names win and only the rest falls through).
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"neither the engine nor its model ({type(module).__name__}) has an "
                                 f"attribute {name!r}") from None

    # -- DeepSpeed's engine surface beyond training ----------------------------------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save`` (or its older fp16 name),
        False when absent, as DeepSpeed answers it: Accelerate and Trainer then gather the whole
        model for ``save_model`` at stage 3, or save an engine checkpoint instead."""
        # Only a DeepSpeed config (deepspeed.initialize's dict view) can hold the key.
        zero = (self.config.get("zero_optimization") or {}) if isinstance(self.config, dict) else {}
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save",
                             zero.get("stage3_gather_fp16_weights_on_model_save", False)))

    def destroy(self) -> None:
        """DeepSpeed's teardown of an engine: nothing stays gathered, writes are on disk, and
        ``GatheredParameters`` no longer looks in this engine. The model and process group stay."""
        self.quiesce()
        LIVE_ENGINES.discard(self)

    # -- whole-model exports ---------------------------------------------------------------
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model in its training dtype on the CPU on rank 0, ``{}`` on the other ranks
        (every rank must call it). Unlike DeepSpeed it also works below stage 3.

        DeepSpeed gives None on the other ranks; Accelerate's idiom
        ``unwrap_model(m).save_pretrained(d, state_dict=accelerator.get_state_dict(m), is_main_process=...)``
        then reads the module's own state dict there, which works on DeepSpeed's shape-[0]
        parameters but not on zerorun's stage-3 ones (full shape over empty storage): an empty
        dict keeps that idiom working, and rank 0's caller writes either way."""
        state = self.full_state_dict(rank0_only=True)
        if self.rank != 0:
            return {}
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """``torch.save`` of the whole model (training dtype) to ``save_dir/save_filename`` by
        rank 0; every rank must call it. True, as DeepSpeed returns when it saved."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        from zerorun.zero.comm import collectives

        collectives.barrier(group=self.group)  # the file exists on return, on every rank
        return True

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)

    # -- checkpoints -----------------------------------------------------------------------
    def _check_same_checkpoint_dir(self, save_dir, tag) -> None:
        """One all-gather: every rank must save to the same folder, or the save fails later with a
        missing-file error on one rank (a folder named after the current second, say)."""
        if self.world_size == 1:
            return
        mine = (str(Path(save_dir).resolve()), None if tag is None else str(tag))
        every = [None] * self.world_size
        torch.distributed.all_gather_object(every, mine, group=self.group)
        differing = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
        if differing:
            first = differing[0]
            raise CheckpointError(
                f"ranks disagree on the checkpoint folder: rank 0 saves to {_where(every[0])}, "
                f"rank {first} to {_where(every[first])}",
                hint="compute save_dir and tag once (e.g. on rank 0, then broadcast) or from values "
                     "every rank shares, such as engine.global_steps")


def _where(entry) -> str:
    directory, tag = entry
    return repr(directory) + ("" if tag is None else f" tag {tag!r}")
