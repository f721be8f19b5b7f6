"""``deepspeed.moe.utils``: the helpers DeepSpeed's examples call unconditionally.

No zerorun model can hold an MoE layer (``deepspeed.moe.layer.MoE`` refuses to be built), so
these give DeepSpeed's answers for a model without one: no parameter is an expert's, and
splitting param groups into expert groups leaves them as they are.
"""

from __future__ import annotations

from zerorun.deepspeed.unsupported import module_getattr


def is_moe_param(param) -> bool:
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=None) -> list[dict]:
    """DeepSpeed's normal form (a list of group dicts) with nothing split off."""
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise TypeError(f"param_groups must be a dict or a list of dicts, got {type(param_groups).__name__}")


__getattr__ = module_getattr("deepspeed.moe.utils", "mixture-of-experts (MoE) layers")
