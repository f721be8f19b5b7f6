"""``deepspeed.runtime.engine.DeepSpeedEngine``: zerorun's engine class, under the name DeepSpeed code
checks with ``isinstance`` (Accelerate's ``unwrap_model``, Trainer's constructor)."""

from zerorun.zero.engine import Engine as DeepSpeedEngine  # noqa: F401
