"""A checkpoint checked against itself before anything is loaded: the manifest's own shape, then
each file's safetensors header against what the manifest lists for it.

Used by checkpoint/format.py (``read_manifest`` and ``Reader.check``), so loading into an
engine (checkpoint/load.py) and ``zerorun consolidate`` (checkpoint/consolidate.py) apply the
same checks; tests: tests/unit/test_checkpoint_trust.py.

Note [checked against its own files]: the manifest's crc32 detects damage, not tampering: anyone
who can edit the manifest can recompute it. So nothing a manifest says is used before it is
checked against what it can be checked against. Every file it lists is one name inside the tag
directory (``rank<R>.safetensors`` for a saved rank, ``engine.pt``); every dtype is one zerorun
writes; every shape is a list of non-negative integers; every piece key names a parameter of the
table and a range inside it. Each safetensors file's own header must then hold every key the
manifest lists for it, with a known dtype, the shape the manifest implies (a piece is 1-D of its
length, a whole frozen parameter or buffer has the table's shape) and a byte range inside the
file's data, of exactly that shape's size. A load used to plan its reads from the manifest alone:
a piece the file did not hold raised a raw KeyError after earlier records had been loaded, and
consolidate allocated whatever shape the manifest claimed (2^33 elements: 32 GiB). Now any
mismatch refuses the whole load before the engine or the output is touched, and every tensor
consolidate allocates is one a file holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.reshard import BUFFER, FROZEN, MASTER, RNG, STATE, parse_piece_key

# The dtype names checkpoint/tensor_files.py writes, with their item sizes (no torch needed here).
ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
ENGINE_FILE = "engine.pt"
HINT = ("the manifest does not describe its own files: the checkpoint is damaged or was edited; "
        "load an earlier tag (docs/checkpoints.md: what the checksum proves)")


def _fail(where: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {where!r}: {problem}", hint=HINT)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shape_problem(shape) -> str | None:
    """Why ``shape`` is not a list of non-negative integers, or None."""
    if not isinstance(shape, list) or not all(_is_int(size) for size in shape):
        return f"shape {shape!r} is not a list of integers"
    if any(size < 0 for size in shape):
        return f"shape {shape!r} has a negative size"
    return None


def numel(shape: Iterable[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def rank_file_name(rank: int) -> str:
    return f"rank{rank}.safetensors"


def check_manifest(manifest: dict, where: str) -> None:
    """Note [checked against its own files]: the manifest's own structure (pure; raises
    CheckpointError naming the first problem)."""
    world = manifest.get("world_size")
    ranks = manifest.get("ranks")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1 or not isinstance(ranks, list) or len(ranks) != world:
        raise _fail(where, f"world_size {world!r} does not match its {len(ranks) if isinstance(ranks, list) else 0} rank entries")
    if manifest.get("dtype") not in ITEM_SIZES:
        raise _fail(where, f"training dtype {manifest.get('dtype')!r} is not one zerorun writes")
    files = manifest.get("files")
    allowed = {rank_file_name(r) for r in range(world)} | {ENGINE_FILE}
    if not isinstance(files, dict):
        raise _fail(where, "it lists no files")
    for name, entry in files.items():
        if name not in allowed:
            inside = "/" not in name and "\\" not in name and name not in ("", ".", "..")
            raise _fail(where, f"it lists file {name!r}, " + ("which is not one a save writes" if inside else
                                                               "a name outside its tag directory"))
        if (not isinstance(entry, dict) or not _is_int(entry.get("bytes")) or entry["bytes"] < 0
                or not isinstance(entry.get("crc32"), str)):
            raise _fail(where, f"file {name!r} has no size and checksum")
    tables = {}
    for section in ("parameters", "buffers"):
        table = manifest.get(section)
        if not isinstance(table, dict):
            raise _fail(where, f"it has no {section} table")
        for name, info in table.items():
            problem = shape_problem(info.get("shape") if isinstance(info, dict) else None)
            if problem:
                raise _fail(where, f"{section[:-1]} {name!r}: {problem}")
            if section == "parameters" and not isinstance(info.get("trainable"), bool):
                raise _fail(where, f"parameter {name!r} says neither trainable nor frozen")
            if info.get("dtype", manifest["dtype"]) not in ITEM_SIZES:
                raise _fail(where, f"{section[:-1]} {name!r} has dtype {info.get('dtype')!r}, not one zerorun writes")
        tables[section] = table
    aliases = manifest.get("aliases", {})
    if not isinstance(aliases, dict) or any(target not in tables["parameters"] for target in aliases.values()):
        raise _fail(where, "a tied name points at no parameter")
    for rank, entry in enumerate(ranks):
        keys = entry.get("keys") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _fail(where, f"rank {rank}'s entry lists no tensor keys")
        if rank_file_name(rank) not in files:
            raise _fail(where, f"rank {rank}'s file {rank_file_name(rank)!r} is not listed with a checksum")
        for key in keys:
            _check_key(key, tables, where)


def _check_key(key: str, tables: Mapping[str, dict], where: str) -> None:
    """A key the manifest lists: a piece inside its parameter, or a whole tensor of the tables."""
    parsed = parse_piece_key(key)
    family = key.partition("/")[0]
    if parsed is not None and (family == MASTER or family.startswith(STATE + ".")):
        _, name, start, length = parsed
        info = tables["parameters"].get(name)
        if info is None:
            raise _fail(where, f"tensor {key!r} is a piece of {name!r}, which is no parameter of the checkpoint")
        if start + length > numel(info["shape"]):
            raise _fail(where, f"tensor {key!r} claims elements {start}-{start + length} of {name!r}, which has "
                               f"{numel(info['shape'])}")
        return
    name = key.partition("/")[2]
    if family == FROZEN and name in tables["parameters"]:
        return
    if family == BUFFER and name in tables["buffers"]:
        return
    if family == RNG and name:
        return
    raise _fail(where, f"it lists tensor {key!r}, which is no piece, frozen parameter, buffer or RNG state it records")


def expected_shape(key: str, manifest: dict) -> list[int] | None:
    """The shape a file must hold under ``key`` (None: any, for RNG states)."""
    parsed = parse_piece_key(key)
    family, _, name = key.partition("/")
    if parsed is not None and (family == MASTER or family.startswith(STATE + ".")):
        return [parsed[3]]
    if family == FROZEN:
        return list(manifest["parameters"][name]["shape"])
    if family == BUFFER:
        return list(manifest["buffers"][name]["shape"])
    return None


def check_header(header: Mapping, data_bytes: int, listed: Iterable[str], manifest: dict, where: str) -> None:
    """Note [checked against its own files]: a safetensors header (metadata removed) against the
    file's data size and the keys the manifest lists for that file."""
    for key, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in ITEM_SIZES:
            raise _fail(where, f"tensor {key!r} has dtype {entry.get('dtype') if isinstance(entry, dict) else None!r}, "
                               "not one zerorun writes")
        problem = shape_problem(entry.get("shape"))
        if problem:
            raise _fail(where, f"tensor {key!r}: {problem}")
        span = entry.get("data_offsets")
        if (not isinstance(span, list) or len(span) != 2 or not all(_is_int(v) for v in span)
                or not 0 <= span[0] <= span[1] <= data_bytes):
            raise _fail(where, f"tensor {key!r} has byte range {span!r}, outside the file's {data_bytes} bytes of data")
        if span[1] - span[0] != numel(entry["shape"]) * ITEM_SIZES[entry["dtype"]]:
            raise _fail(where, f"tensor {key!r} has byte range {span!r}, not the size of its shape {entry['shape']}")
    for key in listed:
        entry = header.get(key)
        if entry is None:
            raise _fail(where, f"the manifest lists tensor {key!r}, which the file does not hold")
        wanted = expected_shape(key, manifest)
        if wanted is not None and list(entry["shape"]) != wanted:
            raise _fail(where, f"tensor {key!r} has shape {entry['shape']} in the file; the manifest implies {wanted}")
