"""Stage 3: a partitioned parameter read where no gather covers it (Note [reads outside forward]).

    pytest tests/distributed/test_stage3_use.py

Note [reads outside forward]: hooks gather a unit around the forward and backward of every
module that holds one of its parameters (param_gather.py, Note [gather follows use]). A
parameter can still be read some other way: a parent's forward computing with a child's
``.weight`` (``F.linear(h, self.embed.weight)``), or a training script reading ``.weight``
between steps. While its unit is not gathered, a partitioned parameter's class is
``ShardedParameter``, whose ``__torch_function__`` sees every torch operation on it:
- reading metadata (shape, dtype, device, ``.grad``, ``.data``, views) passes through: it needs
  no values, and code reads ``self.lm_head.weight.dtype`` everywhere;
- any other operation during a forward of the model (or an activation-checkpoint
  recomputation) gathers the unit first and holds it to the end of that step's backward; the
  gatherer notes the use, and from the next forward the module call that enclosed it gathers
  the unit in its own hooks, as for a stranded use;
- any other operation outside a forward is refused with one line naming the parameter and the
  module to call (a gather there would be a collective that the other ranks may never join; and
  running it on the empty storage is no option: a reduction reads a null pointer and crashes);
  only a move that stays in place (``.to()`` the device and dtype it has, so
  ``model.to(device)`` after initialize) still runs, and ``detach()`` gives what DeepSpeed's
  partitioned parameter gives, a zero-element placeholder. That is ``Module.state_dict()``:
  DeepSpeed-Chat's ``save_hf_format`` saves one on rank 0 and then overwrites the file with
  gathered weights. Refusing it stopped such programs at a line that is harmless under DeepSpeed;
  a placeholder of the full shape would be worse (its storage is empty: reading it crashes).
  Zero elements cannot pass for weights: ``load_state_dict`` of them fails on every shape, and
  the first one in a process prints a note naming the saves that gather.
Once its unit is gathered a parameter is an ``nn.Parameter`` again, so the common path (every
read inside a gathering module's forward) costs nothing. A unit that a module's forward leaves
gathered for a later use (Note [kept gathered] in param_gather.py) keeps the sharded class until
the next module call that gathers it, or the end of the forward: a read in between (NeoMME's
head computes ``h @ self.unembedding_projection.weight`` with a weight tied into the kept
embedding unit) is a read like any other and holds the unit to the end of backward, which
would otherwise release it before the read's backward (the holder's backward, Note [shared
units]). A subclass of ``nn.Parameter`` (a
user's own) is left as it is, unguarded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from zerorun.errors import UsageError
from zerorun.zero.unit.storage import FlatUnit, ParamState

# Torch functions that read no values of a parameter (by ``__name__``; ``__get__``/``__set__``
# are properties: shape, dtype, device, grad, data, requires_grad ...).
METADATA = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
    "is_contiguous", "untyped_storage", "data_ptr", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "is_floating_point", "is_complex", "get_device", "type",
    "view", "view_as", "reshape", "__len__", "_has_compatible_shallow_copy_type", "is_pinned", "__hash__",
})
# Moves that are no-ops when the parameter is already there (``module.to(device)`` after initialize).
MOVES = frozenset({"to", "cpu"})

# reader(param) -> None when it gathered the parameter's unit, else the error to raise
Reader = Callable[[nn.Parameter], UsageError | None]
# id(parameter) -> its reader. Not an attribute of the parameter: copying or pickling a parameter
# copies its __dict__, and a reader holds the gatherer.
_READERS: dict[int, Reader] = {}


class ShardedParameter(nn.Parameter):
    """The class of a partitioned parameter while its unit is not gathered."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        refusal = None
        if name not in METADATA:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, ShardedParameter):
                    refusal = refusal or _READERS[id(leaf)](leaf)
        with torch._C.DisableTorchFunctionSubclass():
            if refusal is None:
                return func(*args, **kwargs)
            # An op on the empty storage may not even raise (a reduction reads a null pointer),
            # so nothing but a move that stays in place runs.
            if name in MOVES and _stays(name, args, kwargs):
                return args[0]
            if name == "detach" and len(args) == 1 and not kwargs:
                return placeholder(args[0])
            raise refusal

    # Pickling and deep-copying read the values without a torch function that says so (``.data``
    # then ``clone``, on an empty storage): checked here first.
    def __reduce_ex__(self, protocol):
        self._read()
        return nn.Parameter.__reduce_ex__(self, protocol)

    def __deepcopy__(self, memo):
        self._read()
        return nn.Parameter.__deepcopy__(self, memo)

    def _read(self) -> None:
        refusal = _READERS[id(self)](self)
        if refusal is not None:
            raise refusal


_PLACEHOLDER_NOTED = False


def placeholder(param: nn.Parameter) -> torch.Tensor:
    """What ``param.detach()`` gives outside a forward (``Module.state_dict()``): DeepSpeed's
    zero-element placeholder, noted once per process (Note [reads outside forward])."""
    global _PLACEHOLDER_NOTED
    if not _PLACEHOLDER_NOTED:
        _PLACEHOLDER_NOTED = True
        print("zerorun: note: state_dict() of a ZeRO stage-3 model holds zero-element placeholders, as under "
              "DeepSpeed, not weights: save with engine.full_state_dict(), "
              "zero_gather_16bit_weights_on_model_save() or inside GatheredParameters", file=sys.stderr, flush=True)
    return torch.empty(0, dtype=param.dtype, device=param.device)


def _stays(name: str, args, kwargs) -> bool:
    """Would ``param.to(...)`` / ``param.cpu()`` return the parameter itself?"""
    param = args[0]
    if name == "cpu":
        return param.device.type == "cpu"
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return (device is None or torch.device(device) == param.device) and (dtype is None or dtype == param.dtype)


def guard(unit: FlatUnit, reader: Reader) -> Callable[[bool], None]:
    """Give ``unit``'s plain ``nn.Parameter``s the sharded class whenever the unit is not
    gathered; ``reader`` decides what a read does (the gatherer's ``read``). Returns
    ``watch(on)``: while the unit stays gathered, ``watch(True)`` gives its parameters the
    sharded class too, so that reads are seen (a unit kept gathered for reuse, Note [kept
    gathered] in param_gather.py), and ``watch(False)`` gives them back their plain class."""
    params = [p for p in unit.params if type(p) is nn.Parameter]
    for param in params:
        _READERS[id(param)] = reader

    def classify(sharded: bool) -> None:
        for param in params:
            param.__class__ = ShardedParameter if sharded else nn.Parameter

    def follow(unit: FlatUnit) -> None:
        classify(unit.state in (ParamState.SHARDED, ParamState.GATHERING))

    def watch(on: bool) -> None:
        classify(on or unit.state in (ParamState.SHARDED, ParamState.GATHERING))

    unit.state_listeners.append(follow)
    follow(unit)
    return watch


def refusal(name: str) -> UsageError:
    module = name.rsplit(".", 1)[0] if "." in name else "the model"
    return UsageError(
        f"parameter {name!r} is partitioned by ZeRO stage 3 and was read outside any forward: call "
        f"{module!r}'s forward, or read it inside zerorun.deepspeed.zero.GatheredParameters([param]) on every rank")
