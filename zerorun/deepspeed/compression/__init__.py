"""``deepspeed.compression``: model compression, which zerorun does not have. Every name imports and raises
UnsupportedFeature on first use (zerorun/deepspeed/unsupported.py)."""

from zerorun.deepspeed.unsupported import module_getattr

from . import compress, helper  # noqa: F401  (real submodules, not stand-ins)

__getattr__ = module_getattr("deepspeed.compression", "model compression")
