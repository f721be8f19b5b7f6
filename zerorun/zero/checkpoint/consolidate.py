"""One full model from a sharded checkpoint, tensor by tensor.

``zerorun consolidate CKPT OUT`` (zerorun/cli/consolidate.py) runs it; tests:
tests/e2e/test_consolidate.py.

Note [bounded consolidation]: DeepSpeed's zero_to_fp32 loads every rank's optimizer file and
then builds the whole model, so consolidating a model needs several times its size in host
memory. Here the output's header is computed from the manifest alone (names, shapes, dtypes),
then each parameter is assembled from its saved pieces (reshard.plan_reads, ranged reads with no
file mapping: checkpoint/tensor_files.py), cast, written and dropped before the next. Resident memory
stays near the largest tensor (and its cast copy), whatever the model's size. Only the torch
format holds everything at once (``torch.save`` takes a whole dict); it says so.

Tied parameters: a model file (safetensors or torch) holds every name the model's
``state_dict()`` has, so a plain ``model.load_state_dict(torch.load/load_file(...), strict=True)``
works on the model it came from (the example GPT's ``head.weight`` is its ``tok_emb.weight``).
safetensors refuses two names sharing storage, so there each tied name is its own copy; the torch
format lets them share one tensor. A Hugging Face directory holds each tied tensor once, under its
first name, as ``save_pretrained`` writes it (``from_pretrained`` ties them again).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from zerorun.errors import CheckpointError
from zerorun.telemetry import get_recorder
from zerorun.zero.checkpoint.hf_output import ADAPTER_WEIGHTS, adapter_key, check_names_fit, write_adapter_config
from zerorun.zero.checkpoint.format import LATEST, MANIFEST, Reader, master_index, rank_file, read_manifest, resolve
from zerorun.zero.checkpoint.reshard import BUFFER, FROZEN, Uncovered, plan_reads, whole_key
from zerorun.zero.unit.layout import Segment
from zerorun.zero.checkpoint.tensor_files import DTYPES, TensorFileWriter, temporary_name, write_bytes_atomically
from zerorun.zero.precision import DTYPES as DTYPE_CHOICES

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


@dataclass(frozen=True)
class Entry:
    """One output tensor: where it comes from and what it becomes."""

    out_name: str
    name: str  # the saved name
    kind: str  # "param" (master pieces, or a whole frozen tensor) or "buffer"
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        total = 1
        for size in self.shape:
            total *= size
        return total


def plan_entries(manifest: dict, dtype: torch.dtype | None, strip_prefix: str = "",
                 tied_names: bool = True) -> list[Entry]:
    """The output tensors in model order (pure: from the manifest only). Trainable parameters
    become ``dtype`` (default: the training dtype); frozen parameters and buffers keep theirs
    unless ``dtype`` is given and they are floating point. With ``tied_names`` each tied name
    (manifest ``aliases``) is an entry of its own, read from the parameter it is tied to."""
    model_dtype = DTYPES[manifest["dtype"]]

    def out(name: str) -> str:
        return _strip(name, strip_prefix)

    entries = []
    for name, info in manifest["parameters"].items():
        saved = model_dtype if info["trainable"] else DTYPES.get(info.get("dtype", manifest["dtype"]), model_dtype)
        entries.append(Entry(out(name), name, "param", tuple(info["shape"]), _cast(saved, dtype, info["trainable"])))
    if tied_names:
        first = {entry.name: entry for entry in entries}
        entries += [Entry(out(alias), name, "param", first[name].shape, first[name].dtype)
                    for alias, name in manifest["aliases"].items()]
    for name, info in manifest["buffers"].items():
        saved = DTYPES.get(info["dtype"], torch.float32)
        entries.append(Entry(out(name), name, "buffer", tuple(info["shape"]), _cast(saved, dtype, False)))
    return entries


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _cast(saved: torch.dtype, wanted: torch.dtype | None, trainable: bool) -> torch.dtype:
    if wanted is None:
        return saved
    return wanted if (trainable or saved.is_floating_point) else saved


class Assembler:
    """Reads whole tensors out of a checkpoint, one at a time (Note [bounded consolidation])."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.reader = Reader(self.directory, self.manifest)
        self.index, _ = master_index(self.manifest)

    def verify_all(self) -> None:
        """Check every file's size, checksum and header before anything is written (Note
        [checked against its own files] in checkpoint/validate.py)."""
        for name in self.manifest["files"]:
            self.reader.check(name)

    def check_sources(self, entries: list[Entry]) -> None:
        """Every output tensor is held by the files: a whole tensor the manifest lists for rank 0
        (its shape then checked against the file's header), or saved pieces covering every element
        of a trainable parameter. So nothing is allocated for a shape the files do not hold
        (Note [bounded consolidation])."""
        whole = set(self.manifest["ranks"][0]["keys"])
        for entry in entries:
            if entry.kind == "buffer" or not self.manifest["parameters"][entry.name]["trainable"]:
                key = whole_key(BUFFER if entry.kind == "buffer" else FROZEN, entry.name)
                if key not in whole:
                    raise CheckpointError(f"checkpoint {str(self.directory)!r} lists no tensor {key!r}",
                                          hint="it is incomplete or damaged; consolidate an earlier tag")
                continue
            try:
                plan_reads([Segment(entry.name, 0, 0, entry.numel)], self.index)
            except Uncovered as gap:
                raise CheckpointError(f"checkpoint {str(self.directory)!r} holds no saved values for elements "
                                      f"{gap.start}-{gap.end} of parameter {entry.name!r} (shape {list(entry.shape)})",
                                      hint="it is incomplete or was edited; consolidate an earlier tag") from None

    def tensor(self, entry: Entry) -> torch.Tensor:
        if entry.kind == "buffer":
            return self.reader.file(rank_file(0)).read(whole_key(BUFFER, entry.name)).to(entry.dtype)
        if not self.manifest["parameters"][entry.name]["trainable"]:
            return self.reader.file(rank_file(0)).read(whole_key(FROZEN, entry.name)).to(entry.dtype)
        whole = torch.empty(entry.numel, dtype=torch.float32)
        self.reader.fill(plan_reads([Segment(entry.name, 0, 0, entry.numel)], self.index), whole)
        return whole.to(entry.dtype).view(entry.shape)

    def close(self) -> None:
        self.reader.close()


def _checkpoint_root(directory: Path) -> Path:
    """The directory holding ``latest`` and the tags (a tag directory's parent)."""
    return directory.parent if (directory / MANIFEST).is_file() else directory


def _check_output(out: Path, target: Path, directory: Path, hf: bool) -> None:
    """Note [output outside the checkpoint]: writing inside the checkpoint's root could replace
    ``latest``, a shard or a manifest (or be deleted by keep_last), so it is refused; so is a
    file output that is an existing directory."""
    root = _checkpoint_root(directory).resolve()
    for path in (out.resolve(), target.resolve()):
        if path == root or root in path.parents:
            raise CheckpointError(f"output {str(out)!r} is inside the checkpoint directory {str(root)!r}",
                                  hint="write the consolidated model somewhere outside the checkpoint")
    if not hf and out.is_dir():
        raise CheckpointError(f"output {str(out)!r} is a directory; without --hf-config or --like the output is one file",
                              hint=f"name a file, e.g. {str(out / 'model.safetensors')!r}, or pass --like/--hf-config")
    if hf and out.exists() and not out.is_dir():
        raise CheckpointError(f"output {str(out)!r} is a file; with --hf-config or --like the output is a directory")
    if os.path.lexists(target):  # a model someone may still need (or a link to one): never replaced
        raise CheckpointError(f"output {str(target)!r} exists; consolidate does not overwrite it",
                              hint="remove it first, or name another output")


def consolidate(checkpoint, out, *, tag: str | None = None, fmt: str = "safetensors", dtype: str | None = None,
                hf_config=None, like=None, strip_prefix: str = "") -> dict:
    """Write the full model of ``checkpoint`` (a checkpoint root or one tag's directory) to
    ``out``: a file, or with ``hf_config``/``like`` a Hugging Face model directory."""
    checkpoint = Path(checkpoint)
    if checkpoint.name.endswith(".partial") and checkpoint.is_dir():
        raise CheckpointError(f"{str(checkpoint)!r} is a save that did not finish (a .partial folder)",
                              hint="consolidate a complete tag, e.g. the checkpoint directory's latest")
    directory = resolve(checkpoint, tag, say=lambda line: print(line, file=sys.stderr, flush=True))
    if directory is None:
        raise CheckpointError(f"{str(checkpoint)!r} holds no checkpoint yet (no {LATEST!r} file)",
                              hint="pass a tag directory, or --tag")
    if fmt not in ("safetensors", "torch"):
        raise CheckpointError(f"--format {fmt!r} is not one of safetensors, torch")
    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    hf = hf_config is not None or like is not None
    if hf and fmt != "safetensors":
        raise CheckpointError("a Hugging Face directory is written as safetensors", hint="drop --format torch")
    out = Path(out)
    assembler = Assembler(directory)
    try:
        adapter = _adapter(assembler.manifest) if hf else None
        target = (out / (ADAPTER_WEIGHTS if adapter else "model.safetensors")) if hf else out
        _check_output(out, target, directory, hf)
        _check_hf_sources(hf_config, like)
    except BaseException:
        assembler.close()
        raise
    created: list[Path] = []
    try:
        assembler.verify_all()
        entries = plan_entries(assembler.manifest, DTYPE_CHOICES[dtype] if dtype is not None else None,
                               "" if adapter else strip_prefix, tied_names=not hf)
        if adapter is not None:
            entries = [replace(e, out_name=key) for e in entries
                       if e.kind == "param" and assembler.manifest["parameters"][e.name]["trainable"]
                       and (key := adapter_key(e.name, adapter[0])) is not None]
        elif hf:  # Note [names that fit] (checkpoint/hf_output.py)
            check_names_fit([e.out_name for e in entries], Path(like) if like is not None else Path(hf_config),
                            f"--like {str(like)!r}" if like is not None else f"--hf-config {str(hf_config)!r}")
        assembler.check_sources(entries)
        try:
            parent = out if hf else out.parent
            if not parent.exists():
                parent.mkdir(parents=True)
                created.append(parent)
        except OSError as exc:
            raise CheckpointError(f"cannot create {str(parent)!r} ({exc.strerror})") from None
        if fmt == "torch":
            written = _write_torch(assembler, entries, target)
        else:
            written = _write_safetensors(assembler, entries, target)
        if adapter is not None:  # last, so a failed run leaves nothing that looks like an adapter
            write_adapter_config(out, adapter[1], like)
        elif hf:  # last, so a failed run leaves no config.json that looks like a model directory
            _write_hf_files(out, hf_config, like)
    except BaseException:
        if hf:
            target.unlink(missing_ok=True)
        for path in reversed(created):
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        assembler.close()
        get_recorder().record_activity(None, 0)
    return {"source": str(directory), "out": str(target), "tensors": len(entries), "bytes": written,
            "adapter": adapter is not None,
            "peak_bytes": memory_bound(entries, fmt),
            "global_step": assembler.manifest["global_step"], "tied": None if adapter else tied_note(assembler.manifest, fmt, hf, strip_prefix)}


def _adapter(manifest: dict) -> tuple[str, dict] | None:
    """(adapter name, its PEFT config) of a PEFT checkpoint (Note [names that fit]), else None."""
    adapters = manifest.get("peft")
    if not isinstance(adapters, dict) or not adapters:
        return None
    if len(adapters) != 1:
        raise CheckpointError(f"the checkpoint holds {len(adapters)} PEFT adapters ({', '.join(sorted(adapters))}); "
                              "consolidate writes one", hint="save a model with one adapter")
    name, config = next(iter(adapters.items()))
    if not isinstance(config, dict):
        raise CheckpointError(f"the checkpoint's PEFT config for {name!r} is not a JSON object")
    return name, config


def memory_bound(entries: list[Entry], fmt: str) -> int:
    """Note [bounded consolidation]: the tensor bytes held at once (pure). The safetensors path
    holds one tensor at a time: its fp32 assembly plus the cast copy; the torch format holds
    every output tensor (tied names share one)."""
    def one(entry: Entry) -> int:
        size = torch.empty(0, dtype=entry.dtype).element_size()
        return entry.numel * (size + (4 if entry.kind == "param" else 0))
    if fmt == "torch":
        return sum(entry.numel * torch.empty(0, dtype=entry.dtype).element_size()
                   for entry in {(e.kind, e.name): e for e in entries}.values())
    return max((one(entry) for entry in entries), default=0)


def tied_note(manifest: dict, fmt: str, hf: bool, strip_prefix: str = "") -> str | None:
    """What the output holds for tied names (None: the model has none), for the command's output."""
    pairs = ", ".join(f"{_strip(alias, strip_prefix)} = {_strip(name, strip_prefix)}" for alias, name in manifest["aliases"].items())
    if not pairs:
        return None
    if hf:
        return f"tied names written once, under the first ({pairs} left out; from_pretrained ties them again)"
    how = "sharing one tensor" if fmt == "torch" else "each its own copy (safetensors stores no shared tensors)"
    return f"tied names all written, {how}: {pairs}; load_state_dict(strict=True) takes the file as it is"


def _write_safetensors(assembler: Assembler, entries: list[Entry], target: Path) -> int:
    writer = TensorFileWriter(target, [(e.out_name, e.dtype, e.shape) for e in entries], metadata={"format": "pt"})
    try:
        for entry in entries:
            writer.write(entry.out_name, assembler.tensor(entry))
            get_recorder().record_activity("consolidating", writer.nbytes)  # Note [saving is progress]
        return writer.commit()["bytes"]
    except CheckpointError as exc:
        writer.abandon()
        # The writer's own hint speaks of a checkpoint save; here only the output was being written.
        raise CheckpointError(exc.message, hint="free space on the output's disk, or choose another output; the "
                                                "checkpoint was only read and is unchanged") from None
    except BaseException:
        writer.abandon()
        raise


def _write_torch(assembler: Assembler, entries: list[Entry], target: Path) -> int:
    state: dict[str, torch.Tensor] = {}
    read: dict[tuple[str, str], torch.Tensor] = {}  # tied names share one tensor (torch.save keeps that)
    for entry in entries:
        if (entry.kind, entry.name) not in read:
            read[entry.kind, entry.name] = assembler.tensor(entry)
        state[entry.out_name] = read[entry.kind, entry.name]
    temporary = temporary_name(target)
    try:
        torch.save(state, temporary)
        temporary.replace(target)
    except (OSError, RuntimeError) as exc:
        temporary.unlink(missing_ok=True)
        raise CheckpointError(f"writing {str(target)!r} failed ({getattr(exc, 'strerror', None) or str(exc).splitlines()[0]})",
                              hint="free space on the output's disk, or choose another output") from None
    return target.stat().st_size


def _check_hf_sources(hf_config, like) -> None:
    """Before anything is written: --like is a model directory, --hf-config readable JSON."""
    if like is not None and not (Path(like) / "config.json").is_file():
        raise CheckpointError(f"--like {str(like)!r} has no config.json", hint="point it at a Hugging Face model directory")
    if hf_config is not None:
        try:
            json.loads(Path(hf_config).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"--hf-config {str(hf_config)!r} is not a readable JSON file ({exc})") from None


def _write_hf_files(out: Path, hf_config, like) -> None:
    """config.json from ``hf_config``, or every non-weight file of the directory ``like``."""
    if like is not None:
        like = Path(like)
        for path in like.iterdir():
            if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json"):
                _copy(path, out / path.name)
    if hf_config is not None:
        _copy(Path(hf_config), out / "config.json")


def _copy(source: Path, target: Path) -> None:
    """Whole or not at all (Note [atomic save]): a full disk leaves no 0-byte config.json."""
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {str(source)!r} ({exc.strerror})") from None
    write_bytes_atomically(target, data)
