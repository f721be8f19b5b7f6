"""The on-disk format of a checkpoint: file names, the model table, finding and reading one.

Shared by zerorun/zero/checkpoint/engine_state.py (save and load into an engine) and zerorun/zero/
checkpoint/consolidate.py (one full model, no engine); tests: tests/distributed/test_checkpoint*.py. The
directory layout and the commit order are described in checkpoint/engine_state.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerorun.errors import CheckpointError
from zerorun.zero.checkpoint.reshard import FROZEN, MASTER, Piece, index_pieces, whole_key
from zerorun.zero.checkpoint.tensor_files import DTYPE_NAMES, TensorFile, verify

FORMAT = "zerorun-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_FILE = "engine.pt"


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


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


# -- reading ----------------------------------------------------------------------------------
def latest_tag(root: Path) -> str | None:
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def tag_directory(root: Path, tag: str) -> Path:
    """``root/tag``, or the copy a crash left moved aside (Note [commit order])."""
    final = Path(root) / tag
    if (final / MANIFEST).is_file():
        return final
    aside = sorted(Path(root).glob(f"{tag}.replaced-*"))
    for candidate in reversed(aside):
        if (candidate / MANIFEST).is_file():
            return candidate
    if final.is_dir():
        raise CheckpointError(f"checkpoint {str(final)!r} has no {MANIFEST}: its save did not finish",
                              hint="load an earlier tag")
    raise CheckpointError(f"there is no checkpoint {str(final)!r}")


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} does not exist: not a complete zerorun checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} is unreadable ({exc})", hint="the checkpoint is damaged; load an earlier tag") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{str(path)!r} is not a zerorun checkpoint of format version {FORMAT_VERSION}")
    return manifest


def resolve(path, tag: str | None = None) -> Path | None:
    """The checkpoint directory for ``path`` (a checkpoint root or a tag directory) and ``tag``;
    None when the root has no ``latest`` yet."""
    path = Path(path)
    if tag is None and (path / MANIFEST).is_file():
        return path
    if tag is None:
        tag = latest_tag(path)
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
        """Verify file ``name`` against the manifest (once); its path."""
        if name not in self._checked:
            expected = self.manifest["files"].get(name)
            if expected is None:
                raise CheckpointError(f"checkpoint {str(self.directory)!r}: the manifest lists no file {name!r}")
            verify(self.directory / name, expected)
            self._checked.add(name)
        return self.directory / name

    def file(self, name: str) -> TensorFile:
        if name not in self._open:
            self._open[name] = TensorFile(self.check(name))
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


