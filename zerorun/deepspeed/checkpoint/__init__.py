"""``deepspeed.checkpoint``: ``utils.clone_tensors_for_torch_save``, which Accelerate calls when it
gathers a state dict below stage 3."""

from . import utils  # noqa: F401
