"""Sharded construction: give a model built on the meta device real values one unit at a time,
and stream pretrained weights into any model, each rank reading only what its units need.

    with zerorun.meta_parameters():      # or torch.device("meta"), see Note [parameters only]
        model = GPT(config)
    engine = zerorun.initialize(model, optimizer, config, weights="model.safetensors")

Note [materialize per unit]: unit/partition.py builds the units one after another; just before a
unit copies its parameters into its flat buffer, ``Materializer.ensure`` gives those
parameters values: read from the weights source by name, or, for a parameter the source lacks
(or with no source), by running the owning module's ``reset_parameters()`` (or the
``param_init_fn`` given to initialize) on fresh memory. The unit then keeps only its chunk
(stage 3), so a rank's memory during set-up is its shards plus about one unit, never the whole
model. A parameter keeps its Python identity and attributes through this (``swap_values``), so an
optimizer built on the meta model's parameters still names them.

Note [same values on every rank]: nothing is broadcast for a materialized model. Every rank
builds the units in the same order and initializes modules under the same seed
(``config.seed``, else 0) in a forked RNG, so random initialization yields identical values
everywhere; weights come from the same file on every rank. An eager model given ``weights=``
is broadcast from rank 0 first as usual, so what the weights lack agrees across ranks too.

Note [parameters only]: ``meta_parameters()`` (and ``deepspeed.zero.Init``, which uses it)
defers parameters alone. Everything else a constructor computes is real: a rotary embedding's
``inv_freq``, a causal mask, ``position_ids``. Under ``torch.device("meta")`` those buffers
would be meta too, and their values, computed from the config in ``__init__``, cannot be
recovered afterwards (a module has no initializer for them; ``finish`` then fails naming the
buffer). A parameter is moved to the meta device the moment it is registered, before the
constructor's own initializer runs on it, so that initializer works on a meta tensor and costs
nothing; the only real memory a parameter ever had is its ``torch.empty``, which the allocator
does not touch. The move keeps the Python object (``swap_values``), so a reference
the constructor holds, a weight tied to two modules, and attributes set on the parameter stay
valid. This is the idea of Accelerate's ``init_empty_weights(include_buffers=False)``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping

import torch
from torch import nn

from zerorun.worker.device import rng_devices, seed_generators
from zerorun.errors import RuntimeConfigError
from zerorun.zero.host_memory import trim_host_heap


INDEX_FILE = "model.safetensors.index.json"
INDEX_LIMIT = 64 << 20  # bytes: an index names files, it never holds tensors


@dataclass(frozen=True)
class Weights:
    """``initialize(..., weights=Weights(source, strict=False, cast=True))``: where pretrained
    weights come from and how strictly they must fit (a bare path or state dict means the
    defaults). Note [strict weights]: as torch's ``load_state_dict``, a parameter or buffer the
    weights lack, or a tensor they hold that the model has no name for, is an error unless
    ``strict=False``, which warns with the exact counts and the first names instead (so a
    ``model.`` prefix never trains silently from random values). Integer or boolean data for a
    floating-point parameter is refused unless ``cast=True``."""

    source: str | Path | Mapping[str, torch.Tensor]
    strict: bool = True
    cast: bool = False


@contextlib.contextmanager
def meta_parameters():
    """Build modules whose parameters are on the meta device and whose buffers and other
    tensors are real (Note [parameters only]); ``initialize`` gives the parameters values."""
    moved: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(original) -> (original, meta)

    def to_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if param.is_meta:
            return None
        if id(param) in moved:  # swapped already, or replaced by a stand-in below
            return moved[id(param)][1]
        meta = _meta_like(param)
        if meta is None:  # a Parameter subclass that cannot be rebuilt: left real, initialize copies it
            return None
        try:
            swap_values(param, meta)
        except RuntimeError:  # the tensor is shared in a way swap refuses: a new object stands in
            meta.__dict__.update(param.__dict__)
            moved[id(param)] = (param, meta)
            return meta
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def swap_values(param: torch.Tensor, other: torch.Tensor) -> None:
    """``param`` takes ``other``'s data (and ``other`` takes param's), each keeping its own Python
    attributes: ``torch.utils.swap_tensors`` exchanges ``__dict__`` too, which would move marks
    such as transformers' ``_is_hf_initialized`` or DeepSpeed's ``ds_*`` to the other object."""
    own, theirs = dict(param.__dict__), dict(other.__dict__)
    torch.utils.swap_tensors(param, other)
    param.__dict__.clear()
    param.__dict__.update(own)
    other.__dict__.clear()
    other.__dict__.update(theirs)


def _meta_like(param: nn.Parameter) -> nn.Parameter | None:
    try:
        return type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    except Exception:  # third-party subclasses take other arguments
        return None


def _safetensors():
    try:
        import safetensors
    except ModuleNotFoundError:
        raise RuntimeConfigError("reading .safetensors weights needs the safetensors package, which is not installed",
                                 hint="pip install safetensors") from None
    return safetensors


class WeightSource:
    """Named tensors from a ``.safetensors`` file, a Hugging Face checkpoint directory (one
    file or sharded with an index), a torch file, or an in-memory state dict. Files are
    opened per tensor, so only the tensor being read is ever mapped (Note [materialize per
    unit]). Every error names the file."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor]):
        self._state: Mapping[str, torch.Tensor] | None = None
        self._file_of: dict[str, Path] = {}
        self.label = "the given state dict"
        if isinstance(source, Mapping):
            self._state = source
            return
        path = Path(source)
        self.label = repr(str(path))
        if path.is_dir():
            index = path / INDEX_FILE
            single = path / "model.safetensors"
            if index.is_file():
                self._file_of = _read_index(index)
            elif single.is_file():
                self._index_file(single)
            elif os.path.lexists(index) or os.path.lexists(single):
                # There, but not a file to read (a FIFO would block the reader for ever): not "missing".
                there = index if os.path.lexists(index) else single
                raise RuntimeConfigError(f"weights directory {str(path)!r}: {there.name} is {_what_is(there)}, not a "
                                         "regular file", hint="put the saved file itself there (save_pretrained)")
            else:
                raise RuntimeConfigError(f"weights directory {str(path)!r} has no model.safetensors or {INDEX_FILE}",
                                         hint="save it with save_pretrained(safe_serialization=True)")
        elif path.is_file() and path.suffix == ".safetensors":
            self._index_file(path)
        elif path.is_file():
            # A torch file: mapped, not read, so tensors load one at a time on access.
            try:
                self._state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # pickle and zip errors are many types
                from zerorun.zero.checkpoint.tensor_files import load_refusal

                raise RuntimeConfigError(f"weights file {str(path)!r} cannot be loaded as a torch state dict "
                                         f"({load_refusal(exc)})", hint="pass a .safetensors file or a state dict") from None
            if not isinstance(self._state, Mapping):
                raise RuntimeConfigError(f"weights file {str(path)!r} holds a {type(self._state).__name__}, not a state dict")
        elif os.path.lexists(path):
            raise RuntimeConfigError(f"weights {str(path)!r} is {_what_is(path)}, not a regular file or directory")
        else:
            raise RuntimeConfigError(f"weights {str(path)!r} is not a file or directory")

    def _index_file(self, path: Path) -> None:
        safe_open = _safetensors().safe_open
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    self._file_of[name] = path
        except Exception as exc:  # SafetensorError and OSError
            raise RuntimeConfigError(f"weights file {str(path)!r} is not a readable safetensors file ({_first_line(exc)})",
                                     hint="the file is damaged or not safetensors") from None

    def keys(self) -> list[str]:
        return list(self._state.keys()) if self._state is not None else list(self._file_of)

    def where(self, name: str) -> str:
        """The file holding ``name`` (for error messages)."""
        return repr(str(self._file_of[name])) if name in self._file_of else self.label

    def get(self, names: list[str]) -> torch.Tensor | None:
        """The tensor stored under the first of ``names`` present (tied weights have several)."""
        for name in names:
            if self._state is not None and name in self._state:
                return self._state[name]
            if name in self._file_of:
                path = self._file_of[name]
                try:
                    with _safetensors().safe_open(str(path), framework="pt") as handle:
                        return handle.get_tensor(name)
                except Exception as exc:  # SafetensorError and OSError
                    raise RuntimeConfigError(f"weights file {str(path)!r}: tensor {name!r} cannot be read "
                                             f"({_first_line(exc)})", hint="the file is damaged or missing") from None
        return None


def _what_is(path: Path) -> str:
    """What a path that is not a regular file is, for a message: "a FIFO", "a socket", ..."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"a link that cannot be followed ({exc.strerror})"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a regular file"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _read_index(index: Path) -> dict[str, Path]:
    """The index's weight_map, each file confined to the index's own directory (Note
    [untrusted files] in checkpoint/tensor_files.py: a name from disk is data, so ``../x`` or
    an absolute path is refused rather than read)."""
    from zerorun.zero.checkpoint.tensor_files import read_small

    try:
        weight_map = json.loads(read_small(index, INDEX_LIMIT))["weight_map"]
    except Exception as exc:  # OSError, ValueError, KeyError, TypeError, CheckpointError
        raise RuntimeConfigError(f"weights index {str(index)!r} is unreadable ({_first_line(exc)})") from None
    if not isinstance(weight_map, dict):
        raise RuntimeConfigError(f"weights index {str(index)!r}: weight_map is not an object")
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or Path(file).name != file or "\\" in file:
            raise RuntimeConfigError(f"weights index {str(index)!r} maps {name!r} to {file!r}, which is not a file "
                                     "in the index's directory", hint="an index names files beside it, never paths")
        files[name] = index.parent / file
    for path in set(files.values()):
        _check_beside(index, path)
    return files


def _check_beside(index: Path, path: Path) -> None:
    """A file an index names is a regular file in the index's directory, and a symlink there
    points into that directory: a FIFO would block the reader for ever (600 s, then the hang
    watchdog), and a symlink to elsewhere would read whatever it points at."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise RuntimeConfigError(f"weights index {str(index)!r} names {path.name!r}, which cannot be read "
                                 f"({exc.strerror})", hint="copy every shard the index names beside it") from None
    if stat.S_ISLNK(info.st_mode):
        home, target = os.path.realpath(index.parent), os.path.realpath(path)
        # The Hugging Face cache links snapshots/<rev>/<file> to ../../blobs/<hash>: expected.
        blobs = os.path.join(os.path.dirname(os.path.dirname(home)), "blobs")
        if os.path.dirname(target) not in (home, blobs) and os.environ.get("RANK", "0") == "0":
            print(f"zerorun: note: weights index {str(index)!r} names {path.name!r}, a symlink to {target!r} "
                  "outside the index's directory; reading it", file=sys.stderr, flush=True)
        try:
            info = os.stat(target)
        except OSError as exc:
            raise RuntimeConfigError(f"weights index {str(index)!r} names {path.name!r}, a symlink to {target!r}, "
                                     f"which cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise RuntimeConfigError(f"weights index {str(index)!r} names {path.name!r}, which is {_what_is(path)}, not a "
                                 "regular file", hint="an index names safetensors files beside it")


def _count_not_finite(value: torch.Tensor, chunk: int = 1 << 20) -> int:
    """NaN and infinite elements of ``value``, counted a chunk at a time: one isfinite over the
    whole tensor would allocate a bool per element (tens of MiB for an embedding) at set-up's
    peak (the 201M model of tests/distributed/test_sharded_construction.py: 469 -> 534 MiB)."""
    return sum(piece.numel() - int(torch.isfinite(piece).sum()) for piece in value.reshape(-1).split(chunk))


def _persistent(model: nn.Module):
    from zerorun.zero.checkpoint.format import persistent_buffers

    return persistent_buffers(model)


def _common_prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """``"model."`` when every missing name is an unexpected one with that prefix."""
    if not missing or not unexpected:
        return None
    found = set()
    for name in missing:
        match = next((u[: -len(name)] for u in unexpected if u.endswith(name) and len(u) > len(name)), None)
        if match is None:
            return None
        found.add(match)
    return found.pop() if len(found) == 1 else None


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter or buffer is registered under (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    return names


def _on_meta(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_meta


class Materializer:
    def __init__(self, model: nn.Module, device: torch.device, *, weights=None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, seed: int = 0):
        self.model = model
        self.device = device
        spec = weights if isinstance(weights, Weights) else Weights(weights)
        self.cast = spec.cast
        self.source = WeightSource(spec.source) if weights is not None else None
        self.param_init_fn = param_init_fn
        self.aliases = _aliases(model)
        if self.source is not None:
            self._check_names(self.source, spec.strict)
        self.owners: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                self.owners.setdefault(id(tensor), []).append(module)
        self._rng = torch.Generator().manual_seed(seed)
        self._in_units: set[int] = set()  # parameters a unit took (at stage 3, frozen ones too)
        self._casts_said: set[tuple[torch.dtype, torch.dtype]] = set()  # (stored, model) pairs noted

    def ensure(self, params: list[nn.Parameter]) -> None:
        """Give ``params`` their values before a unit copies them (Note [materialize per unit])."""
        for param in params:
            self._in_units.add(id(param))
            value = self.source.get(self.aliases[id(param)]) if self.source is not None else None
            if value is not None:
                self._check_shape(param, value)
                self._assign(param, value)
            elif param.is_meta:
                self._initialize_owner(param)
        if self.device.type == "cpu":
            # The unit is about to keep only its chunk of what was just read or initialized;
            # glibc would keep the rest resident in the middle of the heap, one unit's worth
            # per unit (measured on the 201M model of tests/distributed/test_sharded_construction.py
            # at 2 ranks: 518-606 MiB of set-up growth per rank without this, 469 with it, of
            # which 403 are the shards), so hand it back each time.
            trim_host_heap()

    def finish(self) -> None:
        """Everything outside the units: frozen parameters and buffers."""
        params = [p for p in self.model.parameters()
                  if id(p) not in self._in_units and (not p.requires_grad or p.is_meta)]
        self.ensure(params)
        for module in self.model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                value = self.source.get(self.aliases.get(id(buffer), [])) if self.source is not None else None
                if value is not None:
                    self._check_shape(buffer, value)
                    module._buffers[name] = value.to(self.device, buffer.dtype)
                elif buffer.is_meta:
                    if not self._initialize_module(module) or _on_meta(module._buffers[name]):
                        raise RuntimeConfigError(
                            f"buffer {self.aliases.get(id(buffer), [name])[0]!r} is still on the meta device "
                            f"after {type(module).__name__} was initialized",
                            hint="build the model under zerorun.meta_parameters() instead of torch.device('meta'): "
                                 "it keeps buffers real (Note [parameters only] in zerorun/zero/construct.py); "
                                 "or give initialize(param_init_fn=...) that fills it, or include it in the weights")
                elif buffer.device != self.device:  # built real beside meta parameters: Note [parameters only]
                    module._buffers[name] = buffer.to(self.device)

    def _check_names(self, source: WeightSource, strict: bool) -> None:
        """Note [strict weights]: which of the model's tensors the weights lack, and which of
        theirs the model has no name for, counted exactly before any value is read."""
        present = self._present = set(source.keys())
        known = set()
        missing = []
        needed = {id(t) for _, t in _persistent(self.model)} | {id(p) for p in self.model.parameters()}
        for tensor_id, names in self.aliases.items():
            known.update(names)
            if tensor_id in needed and not present.intersection(names):
                missing.append(names[0])
        unexpected = [name for name in source.keys() if name not in known]
        if not missing and not unexpected:
            return
        total = len(needed)
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's {total} parameters and buffers are missing "
                         f"(first: {', '.join(map(repr, missing[:3]))})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors have no name in the model (first: {', '.join(map(repr, unexpected[:3]))})")
        message = f"weights from {source.label}: " + "; ".join(parts)
        prefix = _common_prefix(missing, unexpected)
        hint = (f"the weights' names carry a prefix {prefix!r} the model's lack: strip it from the state dict"
                if prefix else "pass weights=zerorun.Weights(source, strict=False) to initialize what is missing")
        if strict:
            raise RuntimeConfigError(message, hint=hint)
        warnings.warn(message + " (strict=False: the missing ones are initialized)", stacklevel=4)

    def _check_shape(self, param: torch.Tensor, value: torch.Tensor) -> None:
        name = self.aliases[id(param)][0]
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeConfigError(
                f"weights for {name!r} in {self._where(param)} have shape {tuple(value.shape)}, "
                f"the model's parameter has {tuple(param.shape)}",
                hint="load weights saved from the same model configuration")
        if isinstance(param, nn.Parameter) and value.dtype.is_floating_point:
            # NaN or infinity in a parameter trains nothing but NaN; only buffers (masks) hold -inf.
            bad = _count_not_finite(value)
            if bad:
                raise RuntimeConfigError(
                    f"weights for {name!r} in {self._where(param)} hold {bad} NaN or infinite value(s) of "
                    f"{value.numel()}", hint="the weights are damaged; load another copy")
        if param.dtype.is_floating_point and not (value.dtype.is_floating_point or self.cast):
            raise RuntimeConfigError(
                f"weights for {name!r} in {self._where(param)} are {_dtype_name(value.dtype)}, "
                f"the model's parameter is {_dtype_name(param.dtype)}",
                hint="pass weights=zerorun.Weights(source, cast=True) if converting them is meant")
        self._note_cast(name, param, value)

    def _note_cast(self, name: str, param: torch.Tensor, value: torch.Tensor) -> None:
        """Stored values of another dtype are converted to the model's (bf16 weights into an
        fp32 model double their memory and keep bf16's precision): said once per load and pair
        of dtypes, on rank 0, as a note: it is what from_pretrained does too, not an error."""
        pair = (value.dtype, param.dtype)
        if value.dtype == param.dtype or pair in self._casts_said:
            return
        self._casts_said.add(pair)
        if os.environ.get("RANK", "0") == "0":
            print(f"zerorun: note: weights from {self.source.label if self.source else 'the source'} are stored as "
                  f"{_dtype_name(value.dtype)}, the model's tensors are {_dtype_name(param.dtype)}: converted on load "
                  f"(first: {name!r}; said once per load)", file=sys.stderr, flush=True)

    def _where(self, tensor) -> str:
        names = self.aliases.get(id(tensor), [])
        found = next((n for n in names if n in self._present), names[0] if names else "")
        source = self.source
        if source is None:  # only values read from a source are checked against the model
            raise RuntimeError("a weight check without a weight source")
        return source.where(found)

    def _assign(self, param: nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            if param.is_meta:
                # No copy of our own: the unit copies these values into its buffer right away and
                # never writes through them (unit/storage.py), so the source's tensor can stand in.
                real = nn.Parameter(value.to(self.device, param.dtype), requires_grad=param.requires_grad)
                swap_values(param, real)
            else:
                param.copy_(value)

    def _initialize_owner(self, param: nn.Parameter) -> None:
        owner = self.owners[id(param)][0]
        if not self._initialize_module(owner):
            raise RuntimeConfigError(
                f"parameter {self.aliases[id(param)][0]!r} is on the meta device and its module "
                f"{type(owner).__name__} has no reset_parameters()",
                hint="pass initialize(..., param_init_fn=fn) that initializes a module in place "
                     "(for a Hugging Face model: param_init_fn=model._init_weights), or weights=")
        if self.source is not None:
            for other in owner.parameters(recurse=False):  # the initializer wrote every parameter
                value = self.source.get(self.aliases[id(other)])
                if value is not None and other is not param:
                    self._check_shape(other, value)
                    self._assign(other, value)

    def _initialize_module(self, module: nn.Module) -> bool:
        """Fresh memory for the module's own meta tensors, then its initializer, under the
        shared seed (Note [same values on every rank]). Parameters that already have values
        (a tied weight placed in an earlier unit) are stood in for by scratch tensors while
        the initializer runs, so it cannot overwrite them. False when there is no initializer."""
        init = (functools.partial(self.param_init_fn, module) if self.param_init_fn is not None
                else getattr(module, "reset_parameters", None))
        if init is None:
            return False
        placed = {}
        with torch.no_grad():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                empty = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                if param.is_meta:
                    swap_values(param, nn.Parameter(empty, requires_grad=param.requires_grad))
                else:
                    placed[name] = param
                    module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device)
            # Seed (and restore) only the generators init() draws from here: torch.manual_seed would
            # reseed every GPU's generator and fork_rng restore none of them (the user's CUDA seed lost).
            with torch.random.fork_rng(devices=rng_devices(self.device)):
                seed_generators(self.device, int(torch.randint(0, 2**62, (1,), generator=self._rng)))
                init()
            module._parameters.update(placed)
        return True
