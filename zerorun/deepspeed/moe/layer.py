"""``deepspeed.moe.layer``: mixture-of-experts (MoE) layers, which zerorun does not have. Every name imports and raises
UnsupportedFeature on first use (zerorun/deepspeed/unsupported.py)."""

from zerorun.deepspeed.unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.moe.layer", "mixture-of-experts (MoE) layers")
