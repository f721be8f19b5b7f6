"""Activation checkpointing: recompute chosen submodules' activations in backward.

    from zerorun.zero.activation_checkpointing import apply_activation_checkpointing
    wrapped = apply_activation_checkpointing(model, ["Block"])      # -> ["blocks.0", ...]

Driven by ``config.activation_checkpointing`` (``enabled`` + ``modules``, class names).

Contract with the engine (zerorun/zero/engine.py, param_gather.py):
- ``initialize`` calls ``apply_from_config(model, config.activation_checkpointing)`` before it
  builds its stage-3 hooks (so hooks and partition see the final module classes).
- Stage 3 (param_gather.py) sees a recomputation of any kind, this one included, as the pass
  state RECOMPUTE (Note [pass state] in zero/gather_pass.py): units are gathered for it, not
  recorded into the forward order, and not released at its end (the tensors it saves alias the
  gathered storage); ``is_recomputing()`` is True while this module's recomputation runs.

Note [checkpoint at __call__, not at forward]. Stage 3 gathers a module's parameters in forward
pre-hooks and releases them in forward post-hooks. If we only replaced ``module.forward``, the
recomputation in backward would call the bare forward and skip the wrapped module's own hooks, so
any parameter held directly by that module (not by a child) would be recomputed while still
sharded. Instead we give the instance a subclass (same name, same behaviour) whose ``__call__``
runs ``torch.utils.checkpoint`` around the ordinary ``nn.Module.__call__``: recomputation is then
exactly "the forward again", hooks included, and stage 3 gathers parameters again for it.
Parameter names, ``state_dict`` keys, ``isinstance`` and ``type(m).__name__`` are unchanged.

Note [non-reentrant]. ``use_reentrant=False`` is required: the reentrant variant runs the
forward under no_grad, so the hooks stage 3 puts on module outputs (to gather parameters again
before each module's backward) are never installed, and when no input of the wrapped module
requires grad its parameters get no gradient at all. Both variants preserve the RNG state, so
dropout masks are identical in the recomputation.

Note [no cache in a recomputed call]. A layer that writes a key/value cache (T5's blocks with
``use_cache=True``, their default) writes it again when it is recomputed, so the recomputation
sees a longer cache than the forward did and torch refuses it (``CheckpointError``: recomputed
values have different metadata). A checkpointed call in training therefore runs without a cache,
as Hugging Face's own gradient checkpointing does: ``use_cache`` is False and the cache
arguments (``cache``, ``layer_past``, ``past_key_value(s)``) are None, except for a layer that
says it only reads the cache (``_can_checkpoint_with_cache``).

Note [no early stop]. By default the non-reentrant checkpoint aborts the recomputation as soon as
it has rebuilt every tensor backward needs, by raising out of the middle of the forward, so the
forward post-hooks of the calls it interrupts never run, but those registered ``always_call``.
Stage 3 needs no more than that (Note [anyone's checkpoint]); other hooks on a checkpointed
module (a user's, a profiler's) may pair every pre-hook with its post-hook. So our own checkpoint
turns early stop off: its recomputation is exactly the forward again, hooks included (Note
[checkpoint at __call__, not at forward]), at the cost of the recomputation's tail.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from zerorun.errors import RuntimeConfigError

_recomputation = threading.local()


def is_recomputing() -> bool:
    """True while backward is re-running a checkpointed module's forward (on this thread).

    Note [anyone's checkpoint]: ours says so through its context (``_recomputing``); a
    checkpoint the model applies itself (Hugging Face's ``gradient_checkpointing_enable``, a
    user's ``torch.utils.checkpoint`` around a block's ``__call__``) says nothing, and stage 3
    took its recomputation for a second forward (its prefetch plan indexed past the recorded
    order). A module's forward that runs while autograd executes a backward graph is a
    recomputation, whoever's checkpoint asked for it.

    Such a checkpoint keeps torch's early stop: its recomputation raises out of the forward once
    it has rebuilt what backward needs, past the post-hooks of the calls it interrupts. Stage 3's
    post-hooks are ``always_call`` (param_gather.py), which torch runs on the way out of a
    forward that raised, so the interrupted calls still let go of what they hold (a 2-layer
    Hugging Face Llama whose recomputations left their units held trained to a loss of 4.854
    against the reference's 4.892 by its third step). Stage 3 used to hold torch's flag off for
    the whole of each forward as well; with ``always_call`` that changed nothing but the user's
    own checkpoints (tests/distributed/test_stage3_recompute.py, torch's early stop on, passes
    without it, and fails with neither), so the flag is the user's again."""
    return getattr(_recomputation, "depth", 0) > 0 or torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _recomputing():
    _recomputation.depth = getattr(_recomputation, "depth", 0) + 1
    try:
        yield
    finally:
        _recomputation.depth -= 1


def _contexts():
    """torch.utils.checkpoint's context_fn: (context for the forward, context for the recompute)."""
    return contextlib.nullcontext(), _recomputing()


# Marker attribute on the generated subclasses, so applying twice never nests checkpoints.
_MARKER = "_zerorun_activation_checkpointed"
# One generated subclass per original class, so every Block instance shares one type.
_checkpointed_classes: dict[type, type] = {}


def _checkpointed_class(original: type) -> type:
    cls = _checkpointed_classes.get(original)
    if cls is not None:
        return cls

    def __call__(self, *args, **kwargs):
        # super(cls, ...) names the generated class itself, not type(self): a wrapper that later
        # subclasses the instance's class again (FSDP2's fully_shard does) must not make this
        # call resolve back to itself.
        call_with_hooks = super(cls, self).__call__
        if not torch.is_grad_enabled():
            # Nothing is saved for backward under no_grad/inference_mode: checkpointing would
            # only add overhead.
            return call_with_hooks(*args, **kwargs)
        kwargs = _without_cache(self, kwargs)  # Note [no cache in a recomputed call]
        # Note [no early stop]: the flag is read here, at forward time, for this checkpoint.
        with set_checkpoint_early_stop(False):
            return checkpoint(call_with_hooks, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

    cls = type(
        original.__name__,
        (original,),
        {"__call__": __call__, _MARKER: True, "__module__": original.__module__,
         "__qualname__": original.__qualname__},
    )
    _checkpointed_classes[original] = cls
    return cls


_CACHE_ARGUMENTS = ("cache", "layer_past", "past_key_value", "past_key_values")


def _without_cache(module: nn.Module, kwargs: dict) -> dict:
    """Note [no cache in a recomputed call]."""
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in _CACHE_ARGUMENTS:
            if changed.get(name) is not None:
                changed[name] = None
    return changed


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(type(module), _MARKER, False))


def apply_activation_checkpointing(model: nn.Module, module_class_names: Iterable[str]) -> list[str]:
    """Checkpoint every submodule of ``model`` whose class name is listed; return their names.

    The root module itself is never wrapped (checkpointing the whole model saves nothing).
    Raises RuntimeConfigError when a listed class name matches no submodule: a typo would
    otherwise silently train without checkpointing.
    """
    wanted = list(dict.fromkeys(module_class_names))
    if not wanted:
        return []
    wrapped: list[str] = []
    matched: set[str] = set()
    for name, module in model.named_modules():
        class_name = type(module).__name__
        if module is model or class_name not in wanted:
            continue
        matched.add(class_name)
        if not is_checkpointed(module):
            module.__class__ = _checkpointed_class(type(module))
        wrapped.append(name)
    missing = [n for n in wanted if n not in matched]
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise RuntimeConfigError(
            f"activation_checkpointing.modules: no submodule of class {', '.join(map(repr, missing))}",
            hint=f"class names in this model: {', '.join(present[:20])}"
            + (" ..." if len(present) > 20 else ""),
        )
    return wrapped


def apply_from_config(model: nn.Module, ac_config) -> list[str]:
    """Apply ``config.activation_checkpointing`` (an ActivationCheckpointingConfig) to ``model``."""
    if ac_config is None or not ac_config.enabled:
        return []
    if not ac_config.modules:
        raise RuntimeConfigError(
            "activation_checkpointing.enabled is true but activation_checkpointing.modules is empty",
            hint="list the class names to checkpoint, e.g. modules: [Block] or [GPT2Block]",
        )
    return apply_activation_checkpointing(model, ac_config.modules)
