"""``deepspeed.add_config_arguments(parser)``: DeepSpeed's command-line flags on a script's parser.

``--deepspeed`` (a flag for the script's own use), ``--deepspeed_config PATH`` (read by
``initialize(args=...)``), their old ``--deepscale`` spellings, and ``--local_rank`` as
DeepSpeed's launcher and ``zerorun --local-rank-arg`` pass it (unless the script defines it).
"""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for the script; zerorun ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    if not any("--local_rank" in action.option_strings for action in parser._actions):
        group.add_argument("--local_rank", type=int, default=-1, help="Local rank, as the launcher passes it")
    return parser
