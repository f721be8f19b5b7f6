"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 parameter status as DeepSpeed names it.

    pytest tests/unit/test_deepspeed_module.py

transformers, PEFT, TRL and DeepSpeed-Chat recognise a partitioned parameter by its ``ds_*``
attributes and its ``ds_status``; this module holds the names they import.
"""

from __future__ import annotations

import enum

import torch


class ZeroParamStatus(enum.Enum):
    """Where a stage-3 parameter's full value is, in DeepSpeed's terms.

    AVAILABLE: the full tensor is materialized on this rank (inside its unit's forward or
    backward, or a ``GatheredParameters`` block). NOT_AVAILABLE: only this rank's shard exists;
    the parameter's own storage is empty. INFLIGHT: an all-gather for it has been issued and not
    yet waited on.
    """

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# Names transformers reaches for around ``zero.Init`` (``prevent_arange_dtype_change`` swaps the
# wrapper out and back). DeepSpeed's Init wraps torch's tensor constructors with this function;
# zerorun's Init builds on the meta device instead and never calls it, so swapping it changes
# nothing, which is what transformers wants from the swap.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed's constructor wrapper (``fn`` with a default dtype and device); unused by zerorun's Init."""

    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        return fn(*args, **kwargs)

    return wrapped


def __getattr__(name: str):
    # Init, GatheredParameters and the accelerator, as DeepSpeed's module re-exports them (lazily:
    # zerorun.deepspeed.zero imports the engine, which imports this package).
    if name in ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"):
        from zerorun.deepspeed import zero

        return getattr(zero, name)
    if name == "get_accelerator":
        from zerorun.deepspeed.accelerator import get_accelerator

        return get_accelerator
    raise AttributeError(f"deepspeed.runtime.zero.partition_parameters has no {name!r} in zerorun "
                         "(docs/deepspeed.md lists the names it maps)")
