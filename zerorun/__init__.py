"""zerorun: ZeRO sharded data-parallel training, started with one command and watched live.

    engine = zerorun.initialize(model, optimizer, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from __future__ import annotations

__version__ = "0.1.0"


def initialize(model, optimizer=None, config=None):
    """Wrap ``model`` and ``optimizer`` in a ZeRO engine (see zerorun.zero.engine.initialize)."""
    from zerorun.zero.engine import initialize as _initialize

    return _initialize(model, optimizer, config)
