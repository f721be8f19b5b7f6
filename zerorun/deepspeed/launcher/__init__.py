"""``deepspeed.launcher``: the names other launchers import from DeepSpeed's (``runner``)."""
