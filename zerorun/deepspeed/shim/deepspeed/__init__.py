"""``import deepspeed`` in a ``zerorun --as-deepspeed`` job: zerorun.deepspeed under DeepSpeed's name
(zerorun/deepspeed/as_deepspeed.py). This directory is on the workers' PYTHONPATH only."""

from zerorun.deepspeed.as_deepspeed import install

install()
