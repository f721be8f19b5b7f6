"""``deepspeed.runtime``: ``utils.set_random_seed``, ``lr_schedules``, ``engine.DeepSpeedEngine`` and ``zero``."""

from . import engine, lr_schedules, utils, zero  # noqa: F401
