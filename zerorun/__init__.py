"""zerorun: ZeRO sharded data-parallel training, started with one command and watched live.

    engine = zerorun.initialize(model, optimizer, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from __future__ import annotations

__version__ = "0.1.0"


def initialize(model, optimizer=None, config=None, *, weights=None, param_init_fn=None):
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine (see zerorun.zero.engine.initialize)."""
    from zerorun.zero.engine import initialize as _initialize

    return _initialize(model, optimizer, config, weights=weights, param_init_fn=param_init_fn)


def __getattr__(name):
    # zerorun.Weights(source, strict=False, cast=True) for initialize(weights=...); imported
    # lazily, as everything here is, so ``import zerorun`` stays free of torch.
    # zerorun.meta_parameters(): build a model whose parameters alone are deferred (construct.py).
    if name in ("Weights", "meta_parameters"):
        from zerorun.zero import construct

        return getattr(construct, name)
    raise AttributeError(f"module 'zerorun' has no attribute {name!r}")


def uneven_inputs(engine):
    """``with zerorun.uneven_inputs(engine):`` the same as ``engine.join()``: an eval loop whose
    ranks have different numbers of batches (Note [uneven inputs] in zerorun/zero/uneven.py)."""
    from zerorun.zero.uneven import uneven_inputs as _uneven_inputs

    return _uneven_inputs(engine)


def leave_together(group=None):
    """End a script's process group: a barrier, then destroy it without gloo's exit abort
    (Note [clean exit] in zerorun/zero/comm/process_group.py). The engine does this by itself at
    exit for a group it created; call it in scripts that made their own group."""
    from zerorun.zero.comm.process_group import leave_together as _leave_together

    _leave_together(group)
