"""Pure checkpoint math: piece names, which saved pieces fill which ranges, tags to keep.

``pytest tests/unit/test_reshard.py`` tests it alone: plain strings and integers in, plain data
out, no torch, no files, no process group.

A checkpoint stores each rank's share of every parameter as *pieces*: ``length`` elements of
parameter ``name`` from element ``start`` of the flattened parameter, one piece per
``sharding.Segment`` of the rank's chunks. A piece's tensor key says which family it belongs to
(fp32 master, one optimizer-state tensor, a whole frozen parameter or buffer) and its range, so
a file is self-describing. Loading at another world size, stage or unit layout asks, for each
target segment, which saved pieces overlap it (Note [resharding]).

Note [resharding]: nothing about the saved layout is assumed: the saved pieces of one name may
be cut anywhere (another world size pads and splits units differently, another stage puts the
parameter in another unit). ``plan_reads`` intersects every target segment with the pieces of
the same name and returns element-range copies; it fails, naming the parameter, when some
element of a target segment is in no saved piece (an incompatible or incomplete checkpoint).
Overlapping pieces (stage 0 saves the whole of each unit once; no stage saves an element twice)
would be read once each, the first in order winning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterable, Mapping, Sequence

from zerorun.zero.unit.layout import Segment

MASTER = "master"  # fp32 master values of trainable parameters
FROZEN = "frozen"  # a whole frozen parameter, model dtype
BUFFER = "buffer"  # a whole persistent module buffer
STATE = "state"  # one per-element optimizer-state tensor (Adam's exp_avg ...): "state.<key>"
RNG = "rng"  # random-generator states (tensors), one rank's

STEP_TAG = re.compile(r"global_step(\d+)\Z")
_TAG_OK = re.compile(r"[A-Za-z0-9_.+-]+")


def step_tag(global_step: int) -> str:
    """DeepSpeed's default tag."""
    return f"global_step{global_step}"


def bad_tag(tag: str) -> str | None:
    """Why ``tag`` cannot name a checkpoint directory, or None when it can (one path
    component: ``fullmatch``, since ``$`` would let a trailing newline through)."""
    if not tag or tag in (".", "..") or not _TAG_OK.fullmatch(tag):
        return "a tag is letters, digits and . _ + - (it names a directory)"
    if tag.endswith(".partial") or ".replaced-" in tag or tag == "latest":
        return "tags ending in .partial, containing .replaced- or named latest are zerorun's own"
    return None


def piece_key(family: str, name: str, start: int, length: int) -> str:
    """Tensor key of one piece: ``master/layer.weight/0+120``."""
    return f"{family}/{name}/{start}+{length}"


def whole_key(family: str, name: str) -> str:
    """Tensor key of a whole tensor (frozen parameter, buffer, RNG state)."""
    return f"{family}/{name}"


def state_family(key: str) -> str:
    return f"{STATE}.{key}"


def parse_piece_key(key: str) -> tuple[str, str, int, int] | None:
    """(family, name, start, length) of a piece key, None for a whole-tensor key."""
    family, _, rest = key.partition("/")
    name, _, span = rest.rpartition("/")
    start, plus, length = span.partition("+")
    if not (name and plus and start.isdigit() and length.isdigit()):
        return None
    return family, name, int(start), int(length)


@dataclass(frozen=True)
class Piece:
    """A saved range of one parameter: elements [start, start+length) in ``file`` under ``key``."""

    name: str
    start: int
    length: int
    file: str
    key: str

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Read:
    """Copy ``length`` elements from ``offset`` of saved tensor (``file``, ``key``) to
    ``target_offset`` of the target chunk."""

    file: str
    key: str
    offset: int
    target_offset: int
    length: int


class Uncovered(ValueError):
    """Some element of a target range is in no saved piece; ``name`` is the parameter."""

    def __init__(self, name: str, start: int, end: int):
        super().__init__(f"{name}[{start}:{end}]")
        self.name, self.start, self.end = name, start, end


def index_pieces(files: Mapping[str, Iterable[str]], family: str) -> dict[str, list[Piece]]:
    """name -> pieces of ``family``, sorted by start, from each file's tensor keys."""
    index: dict[str, list[Piece]] = {}
    for file, keys in files.items():
        for key in keys:
            parsed = parse_piece_key(key)
            if parsed is None or parsed[0] != family:
                continue
            _, name, start, length = parsed
            index.setdefault(name, []).append(Piece(name, start, length, file, key))
    for pieces in index.values():
        pieces.sort(key=lambda p: (p.start, p.file))
    return index


def plan_reads(segments: Sequence[Segment], index: Mapping[str, Sequence[Piece]]) -> list[Read]:
    """Reads that fill every target segment from saved pieces (Note [resharding])."""
    reads: list[Read] = []
    for seg in segments:
        position, end = seg.param_offset, seg.param_offset + seg.length
        for piece in index.get(seg.name, ()):
            if position >= end:
                break
            if piece.end <= position:
                continue
            if piece.start > position:
                break  # sorted by start: nothing later covers ``position`` either
            length = min(piece.end, end) - position
            reads.append(Read(piece.file, piece.key, position - piece.start,
                              seg.shard_offset + position - seg.param_offset, length))
            position += length
        if position < end:
            raise Uncovered(seg.name, position, end)
    return reads


def first_mismatch(saved: Mapping[str, Sequence[int]], model: Mapping[str, Sequence[int]],
                   what: str = "parameter") -> str | None:
    """The first difference between two {name: shape} tables, as a phrase; None when equal.

    Model order decides which difference is "first", so the message names the parameter the
    user meets first in their model."""
    for name, shape in model.items():
        if name not in saved:
            return f"{what} {name!r} of the model is not in the checkpoint"
        if list(saved[name]) != list(shape):
            return (f"{what} {name!r} has shape {list(shape)} in the model but "
                    f"{list(saved[name])} in the checkpoint")
    for name in saved:
        if name not in model:
            return f"the checkpoint has {what} {name!r}, which the model does not"
    return None


def tags_to_delete(step_tags: Iterable[str], keep_last: int, just_saved: str) -> list[str]:
    """``global_step<N>`` tags beyond the newest ``keep_last`` (the one just saved always
    stays); other tags are the user's and never deleted."""
    numbered = sorted((int(m.group(1)), t) for t in step_tags if (m := STEP_TAG.match(t)))
    keep = {t for _, t in numbered[-keep_last:]} | {just_saved}
    return [t for _, t in numbered if t not in keep]


def micro_steps_after_load(saved_micro: int, saved_accumulation: int, global_step: int, accumulation: int) -> int:
    """Where the accumulation window stands after a load: as saved when the accumulation
    steps are unchanged, else at the boundary the saved optimizer step implies."""
    if saved_accumulation == accumulation:
        return saved_micro
    return global_step * accumulation
