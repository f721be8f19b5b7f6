"""Imported by tests/integrations/*: turn on transformers' ZeRO-3 loading path in one worker
process, with zerorun.deepspeed answering its ``import deepspeed``.

transformers decides that ZeRO-3 is on by ``is_deepspeed_zero3_enabled()``, which reads the
config registered by ``HfDeepSpeedConfig``; building that object needs a ``deepspeed``
distribution (its version check), which is what ``zerorun --as-deepspeed`` provides
to a job's workers. Until then this stands in for it inside the test's own worker: the
``deepspeed`` module names point at zerorun.deepspeed's modules, and the ZeRO-3 config is
registered the way ``HfDeepSpeedConfig.__init__`` registers it. Everything after that is
transformers' own code: ``from_pretrained`` builds the model under ``deepspeed.zero.Init``,
loads it module by module under ``GatheredParameters(modifier_rank=0)`` and initializes what
the checkpoint lacks the same way.
"""

from __future__ import annotations

import sys

import torch


class Zero3Config:
    """What transformers reads from a registered ``HfDeepSpeedConfig``: ``config`` and ``is_zero3``."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return self.config.get("zero_optimization", {}).get("stage") == 3


def enable_transformers_zero3(config: dict) -> Zero3Config:
    """Register ``config`` for transformers; keep the returned object alive (transformers holds
    only a weak reference, as it does to ``HfDeepSpeedConfig``)."""
    import zerorun.deepspeed  # noqa: F401 - imports the submodules aliased below
    import zerorun.deepspeed.runtime.zero.partition_parameters as partition_parameters
    from transformers.integrations import deepspeed as hf_deepspeed

    for name, module in list(sys.modules.items()):
        if name == "zerorun.deepspeed" or name.startswith("zerorun.deepspeed."):
            sys.modules["deepspeed" + name[len("zerorun.deepspeed"):]] = module
    # transformers' prevent_arange_dtype_change() unwraps DeepSpeed's tensor-constructor wrapper
    # for torch.arange; zerorun.deepspeed.zero.Init wraps no constructor, so these are identities.
    partition_parameters._orig_torch_arange = torch.arange
    partition_parameters.zero_wrapper_for_fp_tensor_constructor = lambda fn, *args, **kwargs: fn
    registered = Zero3Config(config)
    hf_deepspeed.set_hf_deepspeed_config(registered)
    assert hf_deepspeed.is_deepspeed_zero3_enabled()
    return registered
