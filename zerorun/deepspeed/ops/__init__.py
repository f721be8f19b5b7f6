"""``deepspeed.ops``: DeepSpeed's optimizer names, built as the torch.optim classes zerorun steps."""

from . import adam, lamb  # noqa: F401
