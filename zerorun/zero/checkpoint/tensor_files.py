"""Streaming safetensors files, checksums and atomic renames for checkpoints.

Used by zerorun/zero/checkpoint/save.py, zerorun/zero/checkpoint/load.py and zerorun/zero/checkpoint/consolidate.py (tests: tests/distributed/
test_checkpoint.py); no command of its own.

Note [streaming safetensors]: ``safetensors.torch.save_file`` takes a dict of every tensor and
serialises them together, and reading through ``safe_open`` maps the file, so every page read
counts in the reader's resident memory until the file is closed. A checkpoint of a large model
must do neither: the writer here writes the standard header first (every key's dtype, shape
and offsets are known before any data, since shapes come from the layout) and then each tensor
as it is produced, updating the checksum on the way; the reader parses the header and reads
element ranges with plain ``readinto`` calls into tensors it allocates. The files are ordinary
safetensors files (the safetensors library loads them; tested), and resident memory stays at
the one tensor in hand.

Note [atomic save]: every file is written under a temporary name, fsynced, then renamed into
place, and its directory fsynced, so after a crash a name either holds the complete file or
does not exist. checkpoint/save.py builds its commit order on this. The temporary name
is unique (``NAME.tmp-<pid>-<random>``) and created with O_CREAT|O_EXCL|O_NOFOLLOW: a symlink
planted at a predictable name (``latest.tmp``) would otherwise make the save write wherever it
points, with the job's rights, and two jobs writing ``latest`` would share one temporary.

Note [untrusted files]: names and sizes read from a checkpoint are data, not trust. Every file
is opened non-blocking and must be a regular file (a FIFO would hang the reader, ``/dev/zero``
would be read until memory runs out), and small files (``latest``, the manifest) are read only
up to a stated bound.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import struct
import zlib
from pathlib import Path
from collections.abc import Iterable

import torch

from zerorun.errors import CheckpointError

CHECKSUM = "crc32"
_BLOCK = 16 << 20

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, on the host and contiguous (a copy only when it is not already)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it is a buffer on every version.
    return memoryview(flat.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: Path, limit: int | None = None):
    """A binary handle on ``path`` if it is a regular file (of at most ``limit`` bytes), else
    CheckpointError naming it (Note [untrusted files]). FileNotFoundError passes through."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{str(path)!r} is not a regular file", hint="a checkpoint holds only regular files")
        if limit is not None and info.st_size > limit:
            raise CheckpointError(f"{str(path)!r} is {info.st_size} bytes, more than the {limit} such a file may have",
                                  hint="the checkpoint is damaged or not a zerorun checkpoint")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path: Path, limit: int) -> bytes:
    """The whole of a small regular file (Note [untrusted files])."""
    with open_regular(path, limit) as handle:
        return handle.read(limit + 1)[:limit]


def temporary_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _storage_error(path: Path, done: int, exc: OSError) -> CheckpointError:
    return CheckpointError(f"rank {os.environ.get('RANK', '0')}: writing {str(path)!r} failed after {done} bytes "
                           f"({exc.strerror or type(exc).__name__})",
                           hint="free space on (or repair) the disk it writes to")


class Checksummed:
    """A file opened for writing that counts bytes and keeps a running checksum, under a
    temporary name created exclusively (Note [atomic save])."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.temporary = temporary_name(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._handle = os.fdopen(os.open(self.temporary, flags, 0o644), "wb")
        except OSError as exc:
            raise _storage_error(self.temporary, 0, exc) from None
        self.nbytes = 0
        self.checksum = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        try:
            self._handle.write(view)
        except OSError as exc:
            raise _storage_error(self.path, self.nbytes, exc) from None
        self.checksum = zlib.crc32(view, self.checksum)
        self.nbytes += len(view)

    def commit(self) -> dict:
        """fsync and rename into place (Note [atomic save]); the directory is fsynced by the caller."""
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(self.temporary, self.path)
        except OSError as exc:
            self.abandon()
            raise _storage_error(self.path, self.nbytes, exc) from None
        return {"bytes": self.nbytes, CHECKSUM: f"{self.checksum:08x}"}

    def abandon(self) -> None:
        try:
            self._handle.close()  # a full disk can fail the flush here too; the file goes anyway
        except OSError:
            pass
        self.temporary.unlink(missing_ok=True)


def write_bytes_atomically(path: Path, data: bytes) -> dict:
    out = Checksummed(path)
    try:
        out.write(data)
    except BaseException:
        out.abandon()
        raise
    return out.commit()


class TensorFileWriter:
    """A safetensors file written key by key, in the order of ``entries`` (Note [streaming
    safetensors]). ``entries``: (key, dtype, shape); ``write`` must follow that order."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {}
        self._order: list[tuple[str, int]] = []
        offset = 0
        for key, dtype, shape in entries:
            numel = 1
            for size in shape:
                numel *= size
            nbytes = numel * _itemsize(dtype)
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((key, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the format recommends
        self._out = Checksummed(path)
        self._out.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected, nbytes = self._order[self._next]
        data = _bytes(tensor)
        if key != expected or len(data) != nbytes:
            raise AssertionError(f"tensor file: wrote {key!r} ({len(data)} bytes), header expects {expected!r} ({nbytes})")
        self._out.write(data)
        self._next += 1

    @property
    def nbytes(self) -> int:
        """Bytes written so far (the heartbeat of a long save)."""
        return self._out.nbytes

    def commit(self) -> dict:
        if self._next != len(self._order):
            raise AssertionError(f"tensor file: {len(self._order) - self._next} tensors never written")
        return self._out.commit()

    def abandon(self) -> None:
        self._out.abandon()


class TensorFile:
    """Ranged reads from a safetensors file without mapping it (Note [streaming safetensors])."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._handle = open_regular(self.path)
            (length,) = struct.unpack("<Q", self._handle.read(8))
            if length > 1 << 30:
                raise ValueError("header length")
            self.header = json.loads(self._handle.read(length))
            if not isinstance(self.header, dict):
                raise ValueError("its header is not a JSON object")
            size = os.fstat(self._handle.fileno()).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {str(self.path)!r} is missing") from None
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"checkpoint file {str(self.path)!r} is not a readable safetensors file ({exc})",
                                  hint="the checkpoint is damaged; load an earlier tag") from None
        self.metadata = self.header.pop("__metadata__", {}) or {}
        self._base = 8 + length
        self.data_bytes = max(0, size - self._base)  # what the header's byte ranges may span

    def keys(self) -> list[str]:
        return list(self.header)

    def info(self, key: str) -> tuple[torch.dtype, list[int]]:
        entry = self.header[key]
        return DTYPES[entry["dtype"]], entry["shape"]

    def read(self, key: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Elements [start, start+length) of the flattened tensor ``key`` (all of it by default,
        in its shape)."""
        entry = self.header.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint file {str(self.path)!r} has no tensor {key!r}",
                                  hint="the checkpoint is damaged or from another zerorun version")
        dtype = DTYPES[entry["dtype"]]
        size = _itemsize(dtype)
        begin, end = entry["data_offsets"]
        whole = length is None
        if length is None:
            length = (end - begin) // size
        out = torch.empty(length, dtype=dtype)
        self.read_into(key, start, out)
        return out.view(entry["shape"]) if whole else out

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` from elements ``start`` on of ``key``."""
        entry = self.header[key]
        size = _itemsize(DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        lo = begin + start * size
        # numpy's stubs give ndarray __buffer__ only for Python >= 3.12 (as in _bytes above).
        view = (memoryview(out.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
                if out.numel() else memoryview(b""))
        if lo + len(view) > end:
            raise CheckpointError(f"checkpoint file {str(self.path)!r}: read past tensor {key!r}")
        self._handle.seek(self._base + lo)
        got = self._handle.readinto(view)
        if got != len(view):
            raise CheckpointError(f"checkpoint file {str(self.path)!r} is truncated (tensor {key!r})",
                                  hint="the checkpoint is damaged; load an earlier tag")

    def close(self) -> None:
        self._handle.close()


def verify(path: Path, expected: dict) -> None:
    """Raise CheckpointError, naming the file, unless its size and checksum are as recorded."""
    path = Path(path)
    hint = "the file was truncated or changed after the save; load an earlier tag (or re-save)"
    try:
        handle = open_regular(path)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing", hint=hint) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be opened ({exc.strerror})", hint=hint) from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {str(path)!r} is {size} bytes, the manifest says "
                                  f"{expected['bytes']}: it is truncated or damaged", hint=hint)
        checksum = 0
        while block := handle.read(_BLOCK):
            checksum = zlib.crc32(block, checksum)
    if f"{checksum:08x}" != expected[CHECKSUM]:
        raise CheckpointError(f"checkpoint file {str(path)!r} fails its {CHECKSUM} checksum "
                              f"({checksum:08x}, the manifest says {expected[CHECKSUM]}): it is damaged", hint=hint)


def _refused_name(described: str) -> str:
    """``a.B`` from torch's ``<class 'a.B'>`` or ``<function f at 0x..>``; else the text, cut short."""
    found = re.match(r"<(?:class|function|built-in function) '?([\w.]+)'?", described.strip())
    return found.group(1) if found else described.strip()[:120]


def load_refusal(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line of our own words.
    torch's message advises re-running with ``weights_only=False``, which runs whatever code the
    file carries: never advice to give about a file that may not be trusted. Only the refused
    name is kept ("it holds argparse.Namespace, which the safe unpickler does not load")."""
    text = " ".join(str(exc).split())
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it holds {found.group(1)}, which the safe unpickler does not load"
    # The other refusals that carry a name: a global of a blocked module (os.system, which
    # pickle spells posix.system), a call (REDUCE) of a function not allowed, an object of a
    # class not allowed; torch spells the last two as the object's repr, "<class 'a.B'>".
    found = re.search(r"unsupported GLOBAL ([\w.]+) whose module ([\w.]+) is blocked", text)
    if found:
        return f"it names {found.group(1)} (module {found.group(2)}), which the safe unpickler does not load"
    found = re.search(r"call reduce for unrecognized function (.+?)(?: which belongs to <module '([\w.]+)'.*)?$", text)
    if found:
        owner = f"{found.group(2)}." if found.group(2) else ""
        return f"it calls {owner}{_refused_name(found.group(1))}, which the safe unpickler does not call"
    found = re.search(r"Can only (?:create new object for|build) .*? but got (.+)$", text)
    if found:
        return f"it builds {_refused_name(found.group(1))}, which the safe unpickler does not load"
    if "Weights only load failed" in text:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
        return f"the safe unpickler refuses it: {found.group(1)[:200] if found else 'an object it does not load'}"
    return text[:200] if text else type(exc).__name__

