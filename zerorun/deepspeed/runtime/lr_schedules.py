"""``deepspeed.runtime.lr_schedules``: DeepSpeed's five schedules, implemented in zerorun.schedulers
with DeepSpeed's formulas."""

from zerorun.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

# The names Accelerate checks a scheduler's class name against (DeepSpeed's list).
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
