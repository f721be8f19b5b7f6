"""What a collective is, and the ranks' check that they agree on it before any value is used.

    pytest tests/unit/test_collective_descriptors.py tests/distributed/test_collective_agreement.py

Note [collective agreement]: an SPMD runtime pairs the ranks' collectives by their order alone.
When one rank does different work (an extra eval forward, ``generate`` of more tokens without
``synced_gpus``, an expert that only its tokens reached), its all-gather of one unit pairs with
another rank's all-gather of another unit, or with a reduce-scatter of gradients: every rank
trains on with wrong values, and the job hangs only later, if at all. So every collective of an
engine says what it is, a ``Descriptor`` (operation, engine and unit, element count, dtype,
phase), and the ranks compare their descriptors before any rank reads the collective's output.
A mismatch raises ``CollectiveMismatch`` on every rank at once, naming each rank's collective
and the likely cause with its fix.

How the descriptors travel (collectives.py chooses; all three are fixed-size, so two ranks
whose collectives differ in kind or size still exchange their descriptors with each other):
- Ranks on one host (the host channel, comm/host_channel.py): the descriptor is written beside
  the data, in a 64-byte header of the slot that the collective's first round fills, and read
  from every peer's header after that round's READY, before any peer's data is copied out. No
  extra message or round at all: an all-gather or reduce-scatter costs two 64-byte copies and a
  comparison more. A collective that the channel does not carry (all-reduce, broadcast,
  barrier, a ring fallback) first runs a header-only round on the channel, waited before the
  collective is issued: the channel's rounds then order every collective of the group, so a
  rank in an all-reduce and a rank in an all-gather meet in the channel and see it.
- Ranks without a channel (other hosts, ZERORUN_HOST_CHANNEL=0): the group's ring driver thread
  sends the descriptor (8 int64) to every peer under a header tag, point to point, and compares
  before the collective's first byte moves (Note [headers in band] in ring_driver.py); the
  caller is not held at the issue. A collective the driver does not run (gloo's own all-reduce,
  broadcast, barrier) sends its descriptor in a header-only job, waited before it is issued.
Before, not beside: gloo aborts the whole process (SIGABRT from its own thread, "Received
data size doesn't match expected size") when a peer's message has another size, so no byte of
a collective moves through gloo before the ranks agreed on it.
- NCCL on a GPU's communication stream: not checked yet (a host comparison per collective would
  block the host on the stream; a device-side comparison is the way, not written).
Chosen over folding a fingerprint into the payload (extra elements summed by a reduce-scatter):
that changes every flat buffer's layout, needs values exact in bf16/fp16 and proves only
agreement of the sum, not which collective each rank issued; a header names it.

The phase is the engine's (an explicit ``phase(...)`` around backward, step, checkpoints and
set-up, ``generate`` around a model's generate) or else inferred where the collective is
issued: in autograd's backward -> backward; grad enabled -> forward; grad disabled -> eval. So an
eval forward on one rank against a training forward on another differs at its first gather.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zerorun.errors import ZerorunError

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier", "reduce_scatter_q", "lookup_rows")
PHASES = ("setup", "forward", "eval", "generate", "backward", "step", "checkpoint")
_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
HEADER_NUMEL = 8  # int64 values: the descriptor as it travels
HEADER_BYTES = HEADER_NUMEL * 8
_MAGIC = 0x5A52_4147  # "ZRAG": a header that was written at all
NO_UNIT = (-1, -1)


@dataclass(frozen=True)
class Descriptor:
    """What one collective is. ``unit``: (engine number, unit index), (-1, -1) for none;
    ``extra``: what else must agree (a broadcast's source, an all-reduce's op)."""

    op: str
    unit: tuple[int, int]
    numel: int
    dtype: torch.dtype | None
    phase: str
    extra: int = 0

    def encode(self) -> list[int]:
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else 99
        return [_MAGIC, OPS.index(self.op), self.unit[0], self.unit[1], self.numel, dtype,
                PHASES.index(self.phase), self.extra]

    @classmethod
    def decode(cls, values: list[int]) -> Descriptor | None:
        """None for a header that holds no descriptor (a peer that wrote none)."""
        magic, op, engine, unit, numel, dtype, phase, extra = values
        if magic != _MAGIC or not (0 <= op < len(OPS) and 0 <= phase < len(PHASES)):
            return None
        return cls(OPS[op], (engine, unit), numel, _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else None,
                   PHASES[phase], extra)


class CollectiveMismatch(ZerorunError):
    """The ranks issued different collectives at the same point (Note [collective agreement])."""

    exit_code = 1


# --- the phase -------------------------------------------------------------------------------
_local = threading.local()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Collectives issued by this thread inside are of phase ``name`` (one of PHASES)."""
    if name not in PHASES:
        raise ValueError(f"unknown collective phase {name!r}")
    stack = _local.__dict__.setdefault("phases", [])
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def current_phase() -> str:
    stack = getattr(_local, "phases", None)
    if stack:
        return stack[-1]
    if torch._C._current_graph_task_id() != -1:  # a hook or recomputation inside autograd's backward
        return "backward"
    return "forward" if torch.is_grad_enabled() else "eval"


def describe(op: str, tensor: torch.Tensor | None, unit: tuple[int, int] | None, extra: int = 0) -> Descriptor:
    return Descriptor(op, unit or NO_UNIT, 0 if tensor is None else tensor.numel(),
                      None if tensor is None else tensor.dtype, current_phase(), extra)


# --- names for the message -------------------------------------------------------------------
# Engines are built in the same order on every rank, so an engine's number names the same
# engine everywhere; unit labels are local but equal on every rank (the same model, the same plan).
_engine_numbers = itertools.count()
_unit_labels: dict[tuple[int, int], str] = {}


def new_engine_number() -> int:
    return next(_engine_numbers)


def register_units(engine: int, labels: dict[int, str]) -> None:
    """Each unit's label by its index, for messages naming engine ``engine``'s units."""
    for index, label in labels.items():
        _unit_labels[(engine, index)] = label


def unit_label(names: list[str]) -> str:
    """A unit's name for people: the module path its parameters share (``layers.0.mlp``; the
    empty path for the model's own parameters)."""
    split = [name.split(".")[:-1] for name in names]
    common = split[0]
    for parts in split[1:]:
        shared = 0
        while shared < min(len(common), len(parts)) and common[shared] == parts[shared]:
            shared += 1
        common = common[:shared]
    return ".".join(common)


def say(d: Descriptor | None) -> str:
    if d is None:
        return "no collective it could describe"
    what = d.op
    if d.unit != NO_UNIT:
        label = _unit_labels.get(d.unit)
        engine = f"engine {d.unit[0]} " if d.unit[0] > 0 else ""
        what += f" of {engine}unit {d.unit[1]}" + (f" (module '{label}')" if label is not None else "")
    dtype = str(d.dtype).removeprefix("torch.") if d.dtype is not None else "no tensor"
    return f"{what}, {d.numel:,} {dtype} elements, in {d.phase}"


# --- the check -------------------------------------------------------------------------------
def check(descriptors: list[Descriptor | None], ranks: list[int]) -> None:
    """Raise CollectiveMismatch unless every rank's descriptor is the same; ``ranks``: the
    global rank of each entry."""
    if all(d == descriptors[0] for d in descriptors[1:]) and descriptors[0] is not None:
        return
    message, hint = explain(descriptors, ranks)
    raise CollectiveMismatch(message, hint)


def explain(descriptors: list[Descriptor | None], ranks: list[int]) -> tuple[str, str]:
    """The one-line message and the likely cause with its fix (pure)."""
    said = "; ".join(f"rank {r}: {say(d)}" for r, d in zip(ranks, descriptors, strict=True))
    message = f"collective mismatch, stopped before any rank used its values: {said}"
    return message, likely_cause(descriptors)


def likely_cause(descriptors: list[Descriptor | None]) -> str:
    known = [d for d in descriptors if d is not None]
    phases = {d.phase for d in known}
    if "generate" in phases and len(phases) > 1:
        return ("likely `generate` of different lengths without synced_gpus: one rank stopped generating "
                "while another still runs forwards; pass synced_gpus=True to generate (the default at stage 3 "
                "with more than one rank; only an explicit synced_gpus=False turns it off)")
    if "eval" in phases and len(phases) > 1:
        return ("likely an extra forward on one rank: an eval loop with more batches on some ranks than others "
                "(or a forward one rank alone ran); wrap the eval loop in `with engine.join():` "
                "(zerorun.uneven_inputs(engine)), so that ranks out of batches shadow the others' forwards")
    gathers = {d.op for d in known} == {"all_gather"} and len(phases) == 1
    if gathers and len({d.unit for d in known}) > 1:
        return ("likely a module that ran on some ranks only, such as an expert that only one rank's tokens "
                "reached: gather the whole block as one unit, with deepspeed.utils.set_z3_leaf_modules(model, "
                "[BlockClass]) or the zero.leaf_modules config key, so every rank gathers the same units")
    return ("the ranks ran different work: every rank must run the same forwards, backwards, steps and "
            "checkpoint calls in the same order (a branch taken on one rank only, a rank that skipped a step)")
