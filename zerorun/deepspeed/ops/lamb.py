"""``deepspeed.ops.lamb``: ``FusedLamb`` has no torch.optim counterpart, and zerorun steps torch.optim
classes only, so it raises UnsupportedFeature on first use (as the config's ``"type": "Lamb"``
is refused when the config is loaded)."""

from zerorun.deepspeed.unsupported import module_getattr, stand_in

FusedLamb = stand_in("deepspeed.ops.lamb.FusedLamb", "LAMB optimizer (torch.optim has none)")
__getattr__ = module_getattr("deepspeed.ops.lamb", "LAMB optimizer (torch.optim has none)")
