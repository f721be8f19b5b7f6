"""Stage 3: a partitioned parameter read where no gather covers it (Note [reads outside forward]).

    pytest tests/distributed/test_stage3_use.py

Note [reads outside forward]: hooks gather a unit around the forward and backward of every
module that holds one of its parameters (param_gather.py, Note [gather follows use]). A
parameter can still be read some other way: a parent's forward computing with a child's
``.weight`` (``F.linear(h, self.embed.weight)``), or a training script reading ``.weight``
between steps. While its unit is not gathered, a partitioned parameter's class is
``ShardedParameter``, whose ``__torch_function__`` sees every torch operation on it:
- reading metadata (shape, dtype, device, ``.grad``, ``requires_grad``) passes through: it needs
  no values, and code reads ``self.lm_head.weight.dtype`` everywhere;
- any other operation during a forward of the model (or an activation-checkpoint
  recomputation) gathers the unit first and holds it to the end of that step's backward; the
  gatherer notes the use, and from the next forward the module call that enclosed it gathers
  the unit in its own hooks, as for a stranded use;
- any other operation outside a forward is refused with one line naming the parameter and the
  module to call (a gather there would be a collective that the other ranks may never join; and
  running it on the empty storage is no option: a reduction reads a null pointer and crashes);
  only a move that stays in place (``.to()``, ``.cuda()`` or ``.cpu()`` to the device and dtype
  it has, in any spelling: ``torch.device("cuda")`` is the current GPU, so ``model.to(device)``
  and ``model.cuda()`` after initialize) still runs, a move elsewhere is refused in one line
  saying to move before initialize, and ``detach()`` gives what DeepSpeed's
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

Note [no tensor over an empty storage]: a property or method that returns a tensor sharing the
parameter's storage (``.data``, ``.T``, ``.mT``, ``.real``, ``view``, ``reshape``, slicing) is a
read like any other. Let through as metadata, it handed out a tensor of the full shape over the
released, empty storage: ``w.data.sum()`` read a null pointer (SIGSEGV) and PEFT's LoRA on an
embedding, which reads ``lora_embedding_A[name].T`` in its forward, failed in ``setStorage``. As
reads they gather the unit in a forward (so PEFT's ``.T`` sees the gathered values) and are
refused in one line outside it. Only ``detach()`` keeps DeepSpeed's placeholder (above).
"""

from __future__ import annotations

import sys
import weakref
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
    "__len__", "_has_compatible_shallow_copy_type", "is_pinned", "__hash__",
})
# Properties that give a tensor over the parameter's storage (``.data``, ``.T`` ...): reads of
# its values, not metadata (Note [no tensor over an empty storage]).
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Moves that are no-ops when the parameter is already there (``module.to(device)`` after initialize).
MOVES = frozenset({"to", "cpu", "cuda"})

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
        if not reads_no_values(func, name, args, kwargs):
            for leaf in pytree.tree_leaves((args, kwargs)):
                if isinstance(leaf, (ShardedParameter, ShardedData)):
                    refusal = refusal or _READERS[id(leaf)](leaf)
        with torch._C.DisableTorchFunctionSubclass():
            if refusal is None:
                return func(*args, **kwargs)
            # An op on the empty storage may not even raise (a reduction reads a null pointer),
            # so nothing but a move that stays in place runs.
            if name in MOVES:
                target = move_target(name, args, kwargs)
                if stays(target, args[0].device, args[0].dtype, current_index(args[0].device.type)):
                    return args[0]
                raise move_refusal(args[0], target)
            if name == "detach" and len(args) == 1 and not kwargs:
                return placeholder(args[0])
            if name == "__get__" and getattr(func.__self__, "__name__", "") == "data":
                return _guarded_data(args[0], func(*args, **kwargs))
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


class ShardedData(torch.Tensor):
    """``param.data`` of a partitioned parameter outside a forward (Note [no tensor over an
    empty storage]): its metadata reads as the parameter's (``p.data.shape``, ``.dtype``), and
    any read of its values is the parameter's read (gathered in a forward, refused outside)."""

    __torch_function__ = ShardedParameter.__torch_function__


def _guarded_data(param: nn.Parameter, data: torch.Tensor) -> torch.Tensor:
    """``data`` (over the parameter's storage) with the parameter's guard."""
    alias = data.as_subclass(ShardedData)
    reader = _READERS[id(param)]
    _READERS[id(alias)] = lambda _: reader(param)
    weakref.finalize(alias, _READERS.pop, id(alias), None)
    return alias


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


def reads_no_values(func, name: str, args, kwargs) -> bool:
    """Does this torch function read no values of its parameters (Note [no tensor over an empty
    storage])? A property counts by its own name (``func`` is the descriptor's ``__get__``)."""
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") not in VALUE_PROPERTIES
    if name == "type":  # ``p.type()`` names the type; ``p.type(dtype)`` converts the values
        return len(args) == 1 and not kwargs
    return name in METADATA


def move_target(name: str, args, kwargs) -> tuple[torch.device | None, torch.dtype | None]:
    """(device, dtype) that ``param.to(...)`` / ``.cpu()`` / ``.cuda(...)`` asks for (None: unchanged)."""
    if name == "cpu":
        return torch.device("cpu"), None
    if name == "cuda":
        device = args[1] if len(args) > 1 else kwargs.get("device")
        if device is None:
            return torch.device("cuda"), None
        return (torch.device("cuda", device) if isinstance(device, int) else torch.device(device)), None
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return (torch.device(device) if device is not None else None), dtype


def current_index(device_type: str) -> int | None:
    """The current device index of ``device_type`` (what ``torch.device("cuda")`` means), None
    when there is none to ask."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.current_device()
    return None


def same_device(wanted: torch.device, actual: torch.device, current: int | None) -> bool:
    """Pure: is ``wanted`` the device ``actual`` names? ``torch.device("cuda")`` is not equal to
    ``torch.device("cuda", 0)``: an index left out means the current device's (``current``)."""
    if wanted.type != actual.type:
        return False
    if wanted.index is None or actual.index is None:
        other = actual.index if wanted.index is None else wanted.index
        return current is None or other is None or other == current
    return wanted.index == actual.index


def stays(target: tuple[torch.device | None, torch.dtype | None], device: torch.device, dtype: torch.dtype,
          current: int | None) -> bool:
    """Pure: would a move to ``target`` leave a parameter on ``device`` in ``dtype`` where it is?"""
    wanted_device, wanted_dtype = target
    return ((wanted_device is None or same_device(wanted_device, device, current))
            and (wanted_dtype is None or wanted_dtype == dtype))


def move_refusal(param: torch.Tensor, target: tuple[torch.device | None, torch.dtype | None]) -> UsageError:
    wanted_device, wanted_dtype = target
    where = " in ".join(str(v).replace("torch.", "") for v in (wanted_device, wanted_dtype) if v is not None)
    here = f"{param.device} in {str(param.dtype).replace('torch.', '')}"
    return UsageError(f"the model is partitioned by ZeRO stage 3 on {here} and cannot move to {where} after "
                      "initialize (a move to where it is does nothing)",
                      hint="move the model before zerorun.initialize; the engine puts it on this worker's device")


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


def refuse_resizing(model: nn.Module, stage: int) -> None:
    """Note [resize before initialize]: after initialize every parameter is a view into a unit's
    flat storage, and the optimizer, the gradient buckets and (stage 3) the gather hooks are
    built for those units. Hugging Face's ``resize_token_embeddings`` replaces the embedding by a
    new module whose parameter is in none of them (at stage 2 a size mismatch deep in backward;
    at stage 3 it copies ``weight.data`` of a partitioned parameter). So on every module whose
    class has it, the call is refused in one line naming the way that works."""
    def refuse(*args, **kwargs):
        raise UsageError(f"resize_token_embeddings after initialize is not supported (ZeRO stage {stage} built its "
                         "units, optimizer and hooks on the current embedding): resize before zerorun.initialize",
                         hint="call model.resize_token_embeddings(...) first, then zerorun.initialize or deepspeed.initialize")

    for module in model.modules():
        if callable(getattr(type(module), "resize_token_embeddings", None)):
            object.__setattr__(module, "resize_token_embeddings", refuse)  # an instance attribute: this model only
