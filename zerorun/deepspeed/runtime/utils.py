"""``deepspeed.runtime.utils``."""

from __future__ import annotations

import random


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators, as DeepSpeed does."""
    import torch

    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
