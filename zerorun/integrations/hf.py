"""Hugging Face Trainer on a zerorun engine.

    args = ZerorunTrainingArguments(output_dir="out", zerorun="ds_config.json", ...)
    trainer = ZerorunTrainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train(); trainer.evaluate(); trainer.save_model("final")

or from the command line, through ``HfArgumentParser((ZerorunTrainingArguments,))``:
``--zerorun ds_config.json``. The config is a zerorun YAML or a DeepSpeed JSON; its ``"auto"``
values are filled from the arguments by transformers' rules for DeepSpeed (hf_auto.py), and a
concrete value that disagrees with an argument is an error naming both.

The engine owns what DeepSpeed owns under Trainer: backward, the accumulation boundaries,
clipping (by the config's ``gradient_clipping``) and the step. Trainer keeps its loop, logging,
evaluation, data loading and its own optimizer and schedule unless the config names one:

| config has   | optimizer                              | scheduler                                 |
|--------------|----------------------------------------|-------------------------------------------|
| neither      | Trainer's (create_optimizer)           | Trainer's, built on the engine's groups   |
| optimizer    | the config's, over Trainer's two groups| Trainer's, built on the engine's groups   |
| scheduler    | either of the above                    | the engine's, from the config             |

Checkpoints: ``save_model`` gathers the whole model (every rank calls it; rank 0 writes a
``from_pretrained`` directory). A Trainer checkpoint also holds the engine's sharded checkpoint
(``engine.save_checkpoint``, where the runtime has it; else the model alone, with a warning),
which ``resume_from_checkpoint`` and ``load_best_model_at_end`` load back with
``engine.load_checkpoint``. Evaluation runs the model itself: at stage 3 its
modules gather their parameters in forward hooks. ``generate`` at stage 3 runs with
``synced_gpus=True`` unless told otherwise (every rank must run every forward, since each
forward gathers collectively: Note [synced generate] in zero/uneven.py).

This subclass overrides a few private Trainer methods (``_prepare_for_training``,
``_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_best_model``, ``_clip_grad_norm``) as transformers 5.23 has them; importing this module
with a transformers that lacks them is an ImportError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Trainer, TrainingArguments

from zerorun.errors import RuntimeConfigError
from zerorun.integrations.accelerate import (
    EngineModule,
    EngineOptimizer,
    EngineRouter,
    route_accelerator,
    whole_model_state,
)
from zerorun.integrations.hf_auto import fill_from_args, fill_from_model, hidden_size_of, read_config

# The Trainer methods overridden below; a transformers without them runs another loop.
_OVERRIDDEN = ("_prepare_for_training", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
               "_load_from_checkpoint", "_load_best_model", "_clip_grad_norm")
if not all(hasattr(Trainer, name) for name in _OVERRIDDEN):
    import transformers

    raise ImportError(f"zerorun.integrations.hf needs transformers>=5.23 (this is {transformers.__version__}): "
                      "pip install 'zerorun[hf]'")

ENGINE_CHECKPOINT_TAG = "zerorun_step{step}"
CLIENT_SCHEDULER_KEY = "trainer_lr_scheduler"


@dataclass
class ZerorunTrainingArguments(TrainingArguments):
    """TrainingArguments plus ``zerorun``: a zerorun YAML / DeepSpeed JSON path, JSON text or dict."""

    zerorun: dict | str | None = field(
        default=None,
        metadata={"help": "zerorun config: a zerorun YAML or DeepSpeed JSON file (or a dict); "
                          "'auto' values are filled from these arguments"},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.zerorun is None:
            self.zerorun_config = None
            return
        if self.deepspeed is not None:
            raise RuntimeConfigError("both --deepspeed and --zerorun are set", hint="keep one of them")
        raw = read_config(self.zerorun)
        # transformers fills at this point too: mismatches surface before any model is built.
        self.zerorun_config = fill_from_args(raw, self)


class _EngineScheduler:
    """Trainer's view of a scheduler the engine builds and steps itself: step() does nothing.

    get_last_lr() gives the rates the last update used, as a Trainer-owned scheduler does when
    Trainer logs (it reads them before stepping its scheduler); the engine has already stepped
    its own by then, so its current rates are the next update's."""

    def __init__(self, engine, router: EngineRouter):
        self.engine = engine
        self.router = router

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        if self.router.update_lrs is not None:
            return list(self.router.update_lrs)
        return list(self.engine.get_lr())

    def state_dict(self) -> dict:
        return {}  # inside the engine's checkpoint

    def load_state_dict(self, state: dict) -> None:
        pass


class ZerorunTrainer(Trainer):
    """A Trainer whose model, optimizer step and checkpoints run on a zerorun engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = getattr(self.args, "zerorun_config", None)  # ZerorunTrainingArguments' filled config
        if config is None:
            raise RuntimeConfigError("ZerorunTrainer needs ZerorunTrainingArguments with a zerorun config",
                                     hint="ZerorunTrainingArguments(..., zerorun='ds_config.json')")
        self.args_config: dict = config
        self.engine = None
        self._router: EngineRouter | None = None

    # -- setting up --------------------------------------------------------------------------
    def zerorun_config_for(self, num_training_steps: int) -> dict:
        """The config handed to zerorun.initialize: every auto Trainer can decide, filled."""
        return fill_from_model(
            self.args_config, self.args,
            hidden_size=hidden_size_of(getattr(self.model, "config", None)),
            num_training_steps=num_training_steps,
            warmup_steps=self.args.get_warmup_steps(num_training_steps),
        )

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        import zerorun

        if self.engine is not None:
            raise RuntimeConfigError("ZerorunTrainer.train() runs once per trainer: the engine already "
                                     "holds this model", hint="build a new ZerorunTrainer to train again")
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        config = self.zerorun_config_for(max_steps)
        optimizer = self._config_optimizer(config) if "optimizer" in config else self.create_optimizer()
        self.engine = engine = zerorun.initialize(self.model, optimizer, config)
        self._router = EngineRouter(
            engine, sync_gradients=lambda: self.accelerator.sync_gradients,
            step_in_backward=True,  # Trainer reads the gradient norm before optimizer.step()
            loss_scaled_for_accumulation=True)  # training_step divides by the accumulation steps
        self.optimizer = EngineOptimizer(engine, self._router)
        self._router.optimizer = self.optimizer
        route_accelerator(self.accelerator, self._router)
        if engine.lr_scheduler is not None:
            self.lr_scheduler = _EngineScheduler(engine, self._router)
        else:
            self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        model = EngineModule(engine)
        self.model_wrapped = model
        # Registered with the Accelerator so that evaluation uses the model as it is (its stage-3
        # hooks gather) instead of preparing, i.e. DDP-wrapping, it; and so its skipped-step flag
        # is seen.
        self.accelerator._models.append(model)
        self.accelerator._optimizers.append(self.optimizer)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _config_optimizer(self, config: dict):
        """Note [config optimizer over Trainer's groups]: the config's optimizer (type and
        hyper-parameters) built over Trainer's own two parameter groups, so biases and norm
        weights are spared weight decay exactly as Trainer spares them (HF with DeepSpeed decays
        every parameter instead, which is why its weights drift from the same run under DDP)."""
        import torch

        from zerorun.config import load_config

        section = load_config(config).optimizer
        if section is None:  # the caller saw an "optimizer" key; a null one has no type to build
            raise RuntimeConfigError("the zerorun config's optimizer section is empty", hint="give optimizer.type")
        cls = getattr(torch.optim, section.type, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise RuntimeConfigError(f"optimizer.type {section.type!r} is not a torch.optim optimizer")
        params = dict(section.params)
        model = self.model
        if model is None:  # Trainer refuses to start without one; said here for the type's sake
            raise RuntimeConfigError("ZerorunTrainer has no model to build the optimizer over")
        decayed = set(self.get_decay_parameter_names(model))
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for name, p in trainable if name in decayed], "weight_decay": params.get("weight_decay", 0.0)},
                  {"params": [p for name, p in trainable if name not in decayed], "weight_decay": 0.0}]
        return cls([group for group in groups if group["params"]], **params)

    def _clip_grad_norm(self, model):
        """The engine already clipped at its step (config gradient_clipping, as under DeepSpeed);
        this returns that step's global norm before clipping."""
        return self._router.clip_grad_norm_(None, float("inf"))

    # -- saving and loading -----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained`` directory of the whole model. Collective: call it on every rank."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = whole_model_state(self.engine)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self._require_engine("saving a resumable checkpoint")
        client_state = {}
        if not isinstance(self.lr_scheduler, _EngineScheduler) and self.lr_scheduler is not None:
            client_state[CLIENT_SCHEDULER_KEY] = self.lr_scheduler.state_dict()
        engine.save_checkpoint(output_dir, tag=ENGINE_CHECKPOINT_TAG.format(step=self.state.global_step),
                               client_state=client_state)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        engine = self._require_engine("resuming from a checkpoint")
        _path, client_state = engine.load_checkpoint(checkpoint)  # DeepSpeed's shape
        client_state = client_state or {}
        scheduler = self.lr_scheduler
        if CLIENT_SCHEDULER_KEY in client_state and scheduler is not None and not isinstance(scheduler, _EngineScheduler):
            scheduler.load_state_dict(client_state[CLIENT_SCHEDULER_KEY])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing before the engine exists: the engine's checkpoint restores the model with the
        optimizer (in _prepare_for_training), as DeepSpeed's does."""

    def _load_best_model(self) -> None:
        engine = self._require_engine("load_best_model_at_end")
        engine.load_checkpoint(self.state.best_model_checkpoint)

    def _require_engine(self, what: str):
        if self.engine is None:
            raise RuntimeConfigError(f"{what} needs a zerorun engine; call train() first")
        return self.engine


__all__ = ["ZerorunTrainer", "ZerorunTrainingArguments"]
