"""``deepspeed.runtime.zero``: the stage-3 names client code imports (``partition_parameters``)."""

from . import partition_parameters  # noqa: F401
