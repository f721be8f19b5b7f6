"""Stand-ins for DeepSpeed names that have no zerorun meaning: importable, failing on first use.

    pytest tests/unit/test_deepspeed_module.py -k unsupported

A DeepSpeed script often imports such a name at the top (DeepSpeed's cifar example imports its
MoE helpers whether or not ``--moe`` is given), so importing must work; constructing, calling or
subclassing the name raises ``UnsupportedFeature`` naming the feature, never an AttributeError
deep in a stack.
"""

from __future__ import annotations

from zerorun.errors import UnsupportedFeature

HINT = "zerorun shards data-parallel training only (ZeRO stages 0-3); run this part under DeepSpeed"


def refuse(name: str, feature: str) -> UnsupportedFeature:
    """The error for using ``name``. Often raised before ``initialize`` (a MoE layer or a
    PipelineModule is built first), so the one-line printing of zerorun errors is installed
    here too: each rank shows the line and hint, not a traceback of zerorun's stand-in."""
    from zerorun.zero.comm import process_group

    process_group._watch_for_uncaught_exceptions()
    return UnsupportedFeature(f"{name} is not supported: zerorun has no {feature}", hint=HINT)


def stand_in(name: str, feature: str) -> type:
    """A class named like DeepSpeed's ``name``; using it in any way raises."""

    def refuse_use(*args, **kwargs):
        raise refuse(name, feature)

    def refuse_subclass(cls, **kwargs):
        raise refuse(name, feature)

    return type(name.rsplit(".", 1)[-1], (), {
        "__new__": refuse_use, "__init_subclass__": classmethod(refuse_subclass),
        "__doc__": f"Not supported: {feature} (raises on use).", "__module__": name.rsplit(".", 1)[0],
    })


def module_getattr(module_name: str, feature: str):
    """A module ``__getattr__`` handing out stand-ins for every public name of ``module_name``."""

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return stand_in(f"{module_name}.{attr}", feature)

    return __getattr__
