"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 parameter status as DeepSpeed names it.

    pytest tests/unit/test_deepspeed_module.py

transformers, PEFT, TRL and DeepSpeed-Chat recognise a partitioned parameter by its ``ds_*``
attributes and its ``ds_status``; this module holds the names they import.
"""

from __future__ import annotations

import enum


class ZeroParamStatus(enum.Enum):
    """Where a stage-3 parameter's full value is, in DeepSpeed's terms.

    AVAILABLE: the full tensor is materialized on this rank (inside its unit's forward or
    backward, or a ``GatheredParameters`` block). NOT_AVAILABLE: only this rank's shard exists;
    the parameter's own storage is empty. INFLIGHT: an all-gather for it has been issued and not
    yet waited on.
    """

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
