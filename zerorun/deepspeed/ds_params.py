"""DeepSpeed's stage-3 parameter attributes, attached by the shim through an engine hook.

    pytest tests/unit/test_ds_params.py tests/distributed/test_dschat_save.py tests/distributed/test_stage3_frozen.py

transformers, PEFT, TRL and DeepSpeed-Chat find ZeRO-3 parameters by ``hasattr(p, "ds_id")``,
read sizes from ``ds_numel``/``ds_shape``, skip gathering what ``ds_status`` says is available,
and then call ``deepspeed.zero.GatheredParameters`` (zerorun/deepspeed/zero.py). With
DeepSpeed's meanings:

    ds_id       a number unique to the parameter in this process
    ds_status   ``ZeroParamStatus``: AVAILABLE while its unit is gathered (or kept whole),
                INFLIGHT while the all-gather is in flight, NOT_AVAILABLE when only shards exist;
                kept current by the unit at every state change (``FlatUnit.state_listeners``)
    ds_numel    the full parameter's element count
    ds_shape    the full parameter's shape
    ds_tensor   this rank's shard of the parameter: a 1-D view of its elements inside this
                rank's chunk of the unit (possibly empty: a unit's chunk boundaries fall between
                parameters, where DeepSpeed pads every parameter to a multiple of the world)
    ds_persist  True for a unit kept whole on every rank (Note [persistent units] in unit/plan.py)

At stage 3 every parameter is in a unit, trainable or frozen (a LoRA base, a DPO reference:
partitioned like the rest, unit/partition.py), so every parameter carries them.

Note [attributes from the shim]: the runtime (``zerorun.zero``) knows nothing of DeepSpeed's
names and never imports this package; it calls the hooks registered with
``zerorun.zero.engine_api.on_engine_built`` once an engine has built its units. Importing
``zerorun.deepspeed`` registers ``attach_to_engine`` (and applies it to engines already built),
and so does importing the Hugging Face and Accelerate integrations, whose libraries read
``ds_status``/``ds_id`` whenever they see ZeRO-3. A plain ``zerorun.initialize`` loads no
module of this package (tests/unit/test_layering.py).
"""

from __future__ import annotations

import itertools

from zerorun.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zerorun.zero.unit.storage import FlatUnit, ParamState

_IDS = itertools.count()

STATUS = {
    ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
    ParamState.GATHERED: ZeroParamStatus.AVAILABLE,
    ParamState.REPLICATED: ZeroParamStatus.AVAILABLE,
}


def attach_to_engine(engine) -> None:
    """The engine hook: at stage 3, every unit's parameters (trainable and frozen) get the attributes."""
    if engine.stage == 3:
        attach([record.unit for record in engine.records + engine.frozen_records])


def attach(units: list[FlatUnit]) -> None:
    """Give every parameter of ``units`` the attributes; their ``ds_status`` follows the unit."""
    for unit in units:
        if publish_status in unit.state_listeners:  # attached already (a second registration)
            continue
        lo, hi = unit.layout.chunk_range(unit.rank)
        for param, offset in zip(unit.params, unit.layout.offsets, strict=True):
            start, end = max(lo, offset), min(hi, offset + param.numel())
            attributes = {
                "ds_id": next(_IDS), "ds_numel": param.numel(), "ds_shape": param.shape,
                "ds_tensor": unit.shard[start - lo : end - lo] if start < end else unit.shard[:0],
                "ds_persist": not unit.partitioned,
            }
            for name, value in attributes.items():
                setattr(param, name, value)
        unit.state_listeners.append(publish_status)
        publish_status(unit)


def publish_status(unit: FlatUnit) -> None:
    status = STATUS[unit.state]
    for param in unit.params:
        setattr(param, "ds_status", status)  # noqa: B010  # an attribute torch's Parameter does not declare
