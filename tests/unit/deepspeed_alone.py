"""Imported by tests/unit/test_deepspeed_*.py: a fixture for ``deepspeed.initialize`` in a world of one.

``init_distributed`` starts a one-rank gloo group and writes RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
into the environment, as DeepSpeed does; the fixture gives each test a clean environment and
ends the group afterwards, so no test sees another's.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ZERORUN_CONFIG",
         "ZERORUN_DEVICE", "DS_ACCELERATOR")


@pytest.fixture
def alone():
    saved = dict(os.environ)
    for name in NAMES:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
