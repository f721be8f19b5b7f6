"""``deepspeed.moe``: mixture-of-experts. ``layer.MoE`` raises UnsupportedFeature on first use;
``utils`` answers as DeepSpeed does for a model without MoE layers (no zerorun model has any)."""

from . import layer, utils  # noqa: F401
