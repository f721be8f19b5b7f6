"""``deepspeed.launcher.runner``: what ``accelerate launch --use_deepspeed`` imports from DeepSpeed.

    PYTHONPATH=$(zerorun env --deepspeed-shim) accelerate launch --use_deepspeed --zero_stage 3 train.py
    pytest tests/unit/test_deepspeed_surface.py -k launcher

Accelerate's launcher, in its own process, checks that a ``deepspeed`` distribution exists and
imports ``DEEPSPEED_ENVIRONMENT_NAME`` from here before it starts torchrun's workers (on one
machine) or DeepSpeed's ``deepspeed`` command over pdsh (several). The names keep DeepSpeed
0.19.8's values. ``main`` is DeepSpeed's launcher entry (its ``deepspeed`` command calls it): here
it is zerorun's launcher with ``--as-deepspeed``, which takes DeepSpeed's launcher spellings
(``--num_gpus``, ``--hostfile``, ``--include``, ``--master_port``; docs/deepspeed.md).
"""

from __future__ import annotations

import os

# The file of KEY=VALUE lines DeepSpeed's multi-node launcher forwards to every node (Accelerate
# appends its variables to it); zerorun's launcher reads ``--env-file`` (default .zerorun.env).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
PDSH_MAX_FAN_OUT = 1024


def main(args: list[str] | None = None) -> None:
    """DeepSpeed's ``deepspeed`` command line, run by zerorun's launcher with ``--as-deepspeed``."""
    import sys

    from zerorun.cli.main import main as zerorun_main

    zerorun_main(["--as-deepspeed", *(sys.argv[1:] if args is None else args)])
