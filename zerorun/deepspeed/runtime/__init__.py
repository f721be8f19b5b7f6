"""``deepspeed.runtime``: ``utils.set_random_seed`` and the ``lr_schedules`` DeepSpeed scripts import."""

from . import lr_schedules, utils, zero  # noqa: F401
