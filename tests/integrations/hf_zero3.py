"""Imported by tests/integrations/*: a worker process set up as ``zerorun --as-deepspeed`` sets
up a job's workers, then transformers' own ``HfDeepSpeedConfig`` turning its ZeRO-3 path on.

``--as-deepspeed`` puts zerorun/deepspeed/shim first on the workers' PYTHONPATH: ``import
deepspeed`` then gives zerorun.deepspeed, and ``importlib.metadata`` finds a ``deepspeed``
distribution, which ``HfDeepSpeedConfig`` checks for. A spawned test worker cannot take the
launcher's environment, so it puts the same directory first on ``sys.path`` before
transformers' DeepSpeed integration is imported (it decides at import whether DeepSpeed is
available). Everything after
that is transformers' own code: ``from_pretrained`` builds the model under
``deepspeed.zero.Init``, loads it module by module under ``GatheredParameters(modifier_rank=0)``
and initializes what the checkpoint lacks the same way.
"""

from __future__ import annotations

import importlib
import sys


def enable_transformers_zero3(config: dict):
    """Register ``config`` with transformers as ``HfDeepSpeedConfig``; keep the returned object
    alive (transformers holds only a weak reference to it)."""
    if "transformers.integrations.deepspeed" in sys.modules:
        raise RuntimeError("enable_transformers_zero3 must run before transformers' DeepSpeed integration is imported")
    from zerorun.deepspeed.as_deepspeed import SHIM_DIR

    sys.path.insert(0, str(SHIM_DIR))
    importlib.invalidate_caches()
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    registered = HfDeepSpeedConfig(config)
    assert is_deepspeed_zero3_enabled()
    return registered
