"""``deepspeed.sequence``: sequence parallelism (Ulysses), which zerorun does not have. Every name imports and raises
UnsupportedFeature on first use (zerorun/deepspeed/unsupported.py)."""

from zerorun.deepspeed.unsupported import module_getattr

from . import layer  # noqa: F401  (a real submodule, not a stand-in)

__getattr__ = module_getattr("deepspeed.sequence", "sequence parallelism (Ulysses)")
