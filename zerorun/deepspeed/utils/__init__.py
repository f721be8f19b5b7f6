"""``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``zero_to_fp32`` and the stage-3
leaf modules (``set_z3_leaf_modules``, ``unset_z3_leaf_modules``, ``get_z3_leaf_modules``, ``z3_leaf_module``).

Leaf modules are gathered whole when they run (Note [expert blocks] in zerorun/zero/unit/leaf.py);
mark them before ``initialize``, which plans the units."""

from __future__ import annotations

import logging
import sys

from . import zero_to_fp32  # noqa: F401


def _make_logger() -> logging.Logger:
    log = logging.getLogger("zerorun.deepspeed")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log on the given ranks only (all of them for None or [-1]), as DeepSpeed's log_dist."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


class RepeatingLoader:
    """Iterate ``loader`` forever, starting it again each time it is exhausted."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True):
    """Gather every module of these classes as one unit when it runs; returns the modules."""
    from zerorun.zero.unit.leaf import set_leaf_modules

    return set_leaf_modules(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True):
    from zerorun.zero.unit.leaf import set_leaf_modules

    return set_leaf_modules(model, leaf_module_classes, False, raise_if_not_found)


def get_z3_leaf_modules(model):
    """The modules marked as leaves (by ``set_z3_leaf_modules``)."""
    from zerorun.zero.unit.leaf import marked_leaf_modules

    return marked_leaf_modules(model)


def z3_leaf_module(model) -> bool:
    from zerorun.zero.unit.leaf import LEAF_ATTRIBUTE

    return bool(getattr(model, LEAF_ATTRIBUTE, False))
