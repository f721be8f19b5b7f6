"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five schedules, implemented in zerorun.schedulers
with DeepSpeed's formulas."""

from zerorun.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401
