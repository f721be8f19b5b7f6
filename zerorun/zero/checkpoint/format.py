"""The on-disk format of a checkpoint: file names, the model table, finding and reading one.

Shared by zerorun/zero/checkpoint/save.py and zerorun/zero/checkpoint/load.py (save and load into
an engine) and zerorun/zero/checkpoint/consolidate.py (one full model, no engine); tests:
tests/distributed/test_checkpoint*.py. The directory layout and the commit order are described in
checkpoint/save.py.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.reshard import BUFFER, FROZEN, MASTER, Piece, bad_tag, index_pieces, whole_key
from zerorun.zero.checkpoint.tensor_files import DTYPE_NAMES, DTYPES, TensorFile, read_small, verify
from zerorun.zero.checkpoint.validate import ENGINE_FILE, check_header, check_manifest, rank_file_name

FORMAT = "zerorun-checkpoint"
# Version 2 adds the manifest's own checksum and each parameter's optimizer group; version 1
# checkpoints (without them) still load.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_VERSION_2_ONLY = frozenset({"checksum", "param_groups", "group_of"})
MANIFEST = "manifest.json"
# Note [untrusted files] (checkpoint/tensor_files.py): bounds on what is read whole.
LATEST_LIMIT = 4096
MANIFEST_LIMIT = 1 << 30
LATEST = "latest"
rank_file = rank_file_name


# -- what the model holds -------------------------------------------------------------------
def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state-dict name, tensor) of each persistent buffer, each tensor once."""
    seen, found = set(), []
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            found.append((f"{prefix}.{name}" if prefix else name, buf))
    return found


def frozen_and_buffers(engine) -> list[tuple[str, torch.Tensor]]:
    """What rank 0's file holds whole: each frozen parameter and each persistent buffer."""
    frozen = [(whole_key(FROZEN, n), p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    return frozen + [(whole_key(BUFFER, n), b) for n, b in persistent_buffers(engine.module)]


def model_table(module: torch.nn.Module) -> dict:
    """Parameters (each once, model order), their aliases (tied names) and buffers, as the
    manifest records them."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    params = {name: {"shape": list(p.shape), "trainable": p.requires_grad, "dtype": DTYPE_NAMES[p.dtype]}
              for name, p in module.named_parameters()}
    buffers = {name: {"shape": list(b.shape), "dtype": DTYPE_NAMES.get(b.dtype, str(b.dtype))}
               for name, b in persistent_buffers(module)}
    return {"parameters": params, "aliases": aliases, "buffers": buffers}


# -- scalars as JSON (the manifest's scalar optimizer state) ------------------------------
def encode_scalar(value):
    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": DTYPE_NAMES[value.dtype]}
    json.dumps(value)  # raises TypeError for what JSON cannot hold
    return {"value": value}


def decode_scalar(entry, device: torch.device):
    if "tensor" in entry:
        return torch.tensor(entry["tensor"], dtype=DTYPES[entry["dtype"]], device=device)
    value = entry["value"]
    return tuple(value) if isinstance(value, list) else value


# -- reading ----------------------------------------------------------------------------------
def checked_tag(tag, where: str) -> str:
    """``tag`` if it names one checkpoint directory under the root (one path component, no
    glob, no newline: reshard.bad_tag), else CheckpointError saying where it came from."""
    problem = bad_tag(tag) if isinstance(tag, str) else "it is not a string"
    if problem:
        raise CheckpointError(f"{where} {tag!r} is not a checkpoint tag: {problem}",
                              hint="pass the name of a tag directory inside the checkpoint directory")
    return tag


class UnusableLatest(CheckpointError):
    """``latest`` exists but holds no tag: empty, unreadable, not a regular file (Note [unusable latest])."""


def latest_tag(root: Path) -> str | None:
    """The tag ``root/latest`` names; None when there is no ``latest`` (no checkpoint yet).
    UnusableLatest when it holds no tag; CheckpointError when what it holds is not a tag."""
    path = Path(root) / LATEST
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UnusableLatest(f"{str(path)!r} is not a regular file")
        text = read_small(path, LATEST_LIMIT).decode("utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UnusableLatest(f"{str(path)!r} is unreadable ({exc.strerror})") from None
    if not text:
        raise UnusableLatest(f"{str(path)!r} is empty")
    # A planted tag ("../elsewhere") is refused, not worked around: someone wrote it on purpose.
    return checked_tag(text, f"{str(path)!r} names")


def newest_complete_tag(root: Path) -> str | None:
    """The tag under ``root`` whose manifest reads and records the highest global step (the
    newer directory on a tie); None when there is none. Partial saves and moved-aside copies
    are never candidates (reshard.bad_tag)."""
    found = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return None
    for entry in entries:
        if bad_tag(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            step = read_manifest(Path(entry.path)).get("global_step")
            if isinstance(step, int) and not isinstance(step, bool):
                found.append((step, entry.stat(follow_symlinks=False).st_mtime, entry.name))
        except (CheckpointError, OSError):
            continue
    return max(found)[2] if found else None


def tag_directory(root: Path, tag: str) -> Path:
    """``root/tag``, or the copy a crash left moved aside (Note [commit order])."""
    checked_tag(tag, "checkpoint tag")
    final = Path(root) / tag
    if os.path.lexists(final / MANIFEST):  # whatever it is: read_manifest says what is wrong with it
        return final
    try:
        # Listed and compared, not globbed: a tag is never a pattern.
        aside = sorted(p for p in Path(root).iterdir() if p.name.startswith(f"{tag}.replaced-"))
    except OSError:
        aside = []
    for candidate in reversed(aside):
        if (candidate / MANIFEST).is_file():
            return candidate
    if final.is_dir():
        raise CheckpointError(f"checkpoint {str(final)!r} has no {MANIFEST}: its save did not finish",
                              hint="load an earlier tag")
    raise CheckpointError(f"there is no checkpoint {str(final)!r}")


def manifest_checksum(manifest: dict) -> str:
    """crc32 of the manifest without its own ``checksum`` field, in a canonical form."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    damaged = "the checkpoint is damaged; load an earlier tag"
    try:
        manifest = json.loads(read_small(path, MANIFEST_LIMIT))
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{str(path)!r} does not exist: not a complete zerorun checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} is unreadable ({exc})", hint=damaged) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{str(path)!r} is not a zerorun checkpoint of format version "
                              f"{' or '.join(map(str, READABLE_VERSIONS))}")
    # A version-2 manifest relabelled as version 1 still carries what only version 2 writes:
    # the label alone must not turn verification off (a changed label fails the checksum too).
    if manifest["format_version"] >= 2 or _VERSION_2_ONLY & manifest.keys():
        recorded, actual = manifest.get("checksum"), manifest_checksum(manifest)
        if recorded != actual:
            raise CheckpointError(f"{str(path)!r} fails its crc32 checksum ({actual}, it records {recorded!r}): "
                                  "it was changed after the save", hint=damaged)
    check_manifest(manifest, str(path))  # Note [checked against its own files]
    return manifest


def resolve(path, tag: str | None = None, say: Callable[[str], None] | None = None) -> Path | None:
    """The checkpoint directory for ``path`` (a checkpoint root or a tag directory) and ``tag``;
    None when the root has no ``latest`` yet.

    Note [unusable latest]: a ``latest`` that exists but holds no tag (empty, unreadable, not
    a regular file; a crash or a full disk can leave one) used to read as "no checkpoint yet", so a
    resuming job started from step 0 beside complete tags and then saved over them. Now the
    newest complete tag is taken instead, and ``say`` (when given) is told so in one line;
    with no complete tag at all the error is raised."""
    path = Path(path)
    if tag is None and (path / MANIFEST).is_file():
        return path
    if tag is not None:
        checked_tag(tag, "checkpoint tag")
    else:
        try:
            tag = latest_tag(path)
        except UnusableLatest as exc:
            tag = newest_complete_tag(path)
            if tag is None:
                raise CheckpointError(f"{exc}, and no complete checkpoint is beside it",
                                      hint="remove it to start from step 0, or write the tag to load into it") from None
            if say is not None:
                say(f"zerorun: {exc}; loading the newest complete tag {tag!r} instead")
        if tag is None:
            if not path.is_dir():
                raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
            return None
    return tag_directory(path, tag)


class Reader:
    """The saved files one rank opens, each checked once before its first read."""

    def __init__(self, directory: Path, manifest: dict):
        self.directory, self.manifest = directory, manifest
        self._open: dict[str, TensorFile] = {}
        self._checked: set[str] = set()

    def check(self, name: str) -> Path:
        """Verify file ``name`` against the manifest (once): its size, its checksum and, for a
        tensor file, its header against the keys the manifest lists for it (Note [checked
        against its own files] in checkpoint/validate.py); its path."""
        if name not in self._checked:
            expected = self.manifest["files"].get(name)
            if expected is None:
                raise CheckpointError(f"checkpoint {str(self.directory)!r}: the manifest lists no file {name!r}")
            verify(self.directory / name, expected)
            if name != ENGINE_FILE:
                handle = self._open.get(name) or TensorFile(self.directory / name)
                self._open[name] = handle
                listed = [key for rank, entry in enumerate(self.manifest["ranks"]) if rank_file(rank) == name
                          for key in entry["keys"]]
                check_header(handle.header, handle.data_bytes, listed, self.manifest, str(self.directory / name))
            self._checked.add(name)
        return self.directory / name

    def file(self, name: str) -> TensorFile:
        self.check(name)
        return self._open[name]

    def fill(self, reads, target: torch.Tensor) -> None:
        """Run reshard reads into the 1-D ``target`` (any dtype; cast when the file's differs)."""
        for read in reads:
            source = self.file(read.file)
            span = target[read.target_offset: read.target_offset + read.length]
            if source.info(read.key)[0] == target.dtype and span.device.type == "cpu":
                source.read_into(read.key, read.offset, span)
            else:
                span.copy_(source.read(read.key, read.offset, read.length))

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()


def master_index(manifest: dict) -> tuple[dict, dict]:
    files = {rank_file(r): entry["keys"] for r, entry in enumerate(manifest["ranks"])}
    index = index_pieces(files, MASTER)
    # A parameter frozen when saved and trainable now: its whole saved value is one piece.
    for name, info in manifest["parameters"].items():
        if not info["trainable"] and name not in index:
            numel = 1
            for size in info["shape"]:
                numel *= size
            index[name] = [Piece(name, 0, numel, rank_file(0), whole_key(FROZEN, name))]
    return index, files


