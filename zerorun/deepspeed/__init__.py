"""DeepSpeed's module API on zerorun's engine: port a DeepSpeed script by changing one import.

    import zerorun.deepspeed as deepspeed            # was: import deepspeed
    zerorun --nproc 2 train.py --deepspeed --deepspeed_config ds_config.json

A thin mapping, not a second engine: ``initialize`` builds ``zerorun.initialize``'s engine from a
DeepSpeed config and returns DeepSpeed's 4-tuple; the engine answers DeepSpeed's accessor names
itself (zero/engine_api.py). docs/deepspeed.md has the table of names and what each maps to;
names with no zerorun meaning (pipeline, MoE layers, tensor and sequence parallelism,
compression) import and raise UnsupportedFeature on first use.
"""

from __future__ import annotations

from zerorun.deepspeed.as_deepspeed import version as _version

# DeepSpeed's API version this module follows, labelled as zerorun's: "0.19.8+zerorun.<zerorun's>".
__version__ = _version()
from zerorun.deepspeed import (  # noqa: F401
    accelerator, ds_params, checkpoint, checkpointing, comm, compression, moe, ops, pipe, runtime, utils, zero,
)
from zerorun.deepspeed.accelerator import get_accelerator  # noqa: F401  (DeepSpeed re-exports it here)
from zerorun.deepspeed.arguments import add_config_arguments  # noqa: F401
from zerorun.deepspeed.comm import init_distributed  # noqa: F401
from zerorun.deepspeed.initialize import initialize  # noqa: F401
from zerorun.deepspeed.runtime.engine import DeepSpeedEngine  # noqa: F401
from zerorun.deepspeed.unsupported import stand_in
from zerorun.deepspeed.utils.timer import ThroughputTimer
from zerorun.zero.engine_api import on_engine_built


def _on_engine_built(engine) -> None:
    """What DeepSpeed code finds on an engine and its parameters (Note [attributes from the
    shim] in ds_params.py): the ds_* attributes at stage 3, and ``engine.tput_timer``."""
    ds_params.attach_to_engine(engine)
    engine.__dict__.setdefault("tput_timer", ThroughputTimer(engine))


on_engine_built(_on_engine_built)

# Tensor parallelism and inference: names a DeepSpeed script calls at the top level.
tp_model_init = stand_in("deepspeed.tp_model_init", "tensor parallelism (AutoTP)")
init_inference = stand_in("deepspeed.init_inference", "inference engine (kernel injection, tensor parallelism)")
PipelineModule = pipe.PipelineModule


def __getattr__(name: str):
    """A DeepSpeed name this module does not map: one clear line, not a bare AttributeError."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"zerorun.deepspeed has no {name!r}: a DeepSpeed name zerorun does not map "
                         "(docs/deepspeed.md lists the ones it does)")
