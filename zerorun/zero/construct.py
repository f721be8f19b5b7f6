"""Sharded construction: give a model built on the meta device real values one unit at a time,
and stream pretrained weights into any model, each rank reading only what its units need.

    with torch.device("meta"):
        model = GPT(config)
    engine = zerorun.initialize(model, optimizer, config, weights="model.safetensors")

Note [materialize per unit]: unit/partition.py builds the units one after another; just before a
unit copies its parameters into its flat buffer, ``Materializer.ensure`` gives those
parameters values: read from the weights source by name, or, for a parameter the source lacks
(or with no source), by running the owning module's ``reset_parameters()`` (or the
``param_init_fn`` given to initialize) on fresh memory. The unit then keeps only its chunk
(stage 3), so a rank's memory during set-up is its shards plus about one unit, never the whole
model. A parameter keeps its Python identity through this (``torch.utils.swap_tensors``), so an
optimizer built on the meta model's parameters still names them.

Note [same values on every rank]: nothing is broadcast for a materialized model. Every rank
builds the units in the same order and initializes modules under the same seed
(``config.seed``, else 0) in a forked RNG, so random initialization yields identical values
everywhere; weights come from the same file on every rank. An eager model given ``weights=``
is broadcast from rank 0 first as usual, so what the weights lack agrees across ranks too.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from zerorun.errors import RuntimeConfigError
from zerorun.zero.host_memory import trim_host_heap


class WeightSource:
    """Named tensors from a ``.safetensors`` file, a Hugging Face checkpoint directory (one
    file or sharded with an index), a torch file, or an in-memory state dict. Files are
    opened per tensor, so only the tensor being read is ever mapped (Note [materialize per
    unit])."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor]):
        self._state: Mapping[str, torch.Tensor] | None = None
        self._file_of: dict[str, Path] = {}
        if isinstance(source, Mapping):
            self._state = source
            return
        path = Path(source)
        if path.is_dir():
            index = next((path / n for n in ("model.safetensors.index.json",) if (path / n).is_file()), None)
            single = path / "model.safetensors"
            if index is not None:
                weight_map = json.loads(index.read_text())["weight_map"]
                self._file_of = {name: path / file for name, file in weight_map.items()}
            elif single.is_file():
                self._index_file(single)
            else:
                raise RuntimeConfigError(f"weights directory {str(path)!r} has no model.safetensors or "
                                         "model.safetensors.index.json",
                                         hint="save it with save_pretrained(safe_serialization=True)")
        elif path.is_file() and path.suffix == ".safetensors":
            self._index_file(path)
        elif path.is_file():
            # A torch file: mapped, not read, so tensors load one at a time on access.
            self._state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        else:
            raise RuntimeConfigError(f"weights {str(path)!r} is not a file or directory")

    def _index_file(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                self._file_of[name] = path

    def get(self, names: list[str]) -> torch.Tensor | None:
        """The tensor stored under the first of ``names`` present (tied weights have several)."""
        for name in names:
            if self._state is not None and name in self._state:
                return self._state[name]
            if name in self._file_of:
                from safetensors import safe_open

                with safe_open(str(self._file_of[name]), framework="pt") as handle:
                    return handle.get_tensor(name)
        return None


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter or buffer is registered under (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    return names


class Materializer:
    def __init__(self, model: nn.Module, device: torch.device, *, weights=None,
                 param_init_fn: Callable[[nn.Module], None] | None = None, seed: int = 0):
        self.model = model
        self.device = device
        self.source = WeightSource(weights) if weights is not None else None
        self.param_init_fn = param_init_fn
        self.aliases = _aliases(model)
        self.owners: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                self.owners.setdefault(id(tensor), []).append(module)
        self._rng = torch.Generator().manual_seed(seed)
        self.initialized: list[str] = []  # parameters the source lacked, initialized instead

    def ensure(self, params: list[nn.Parameter]) -> None:
        """Give ``params`` their values before a unit copies them (Note [materialize per unit])."""
        for param in params:
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
        params = [p for p in self.model.parameters() if not p.requires_grad or p.is_meta]
        self.ensure(params)
        for module in self.model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                value = self.source.get(self.aliases.get(id(buffer), [])) if self.source is not None else None
                if value is not None:
                    module._buffers[name] = value.to(self.device, buffer.dtype)
                elif buffer.is_meta:
                    if not self._initialize_module(module) or module._buffers[name].is_meta:
                        raise RuntimeConfigError(
                            f"buffer {self.aliases.get(id(buffer), [name])[0]!r} is still on the meta device "
                            f"after {type(module).__name__} was initialized",
                            hint="give initialize(param_init_fn=...) that fills it, or include it in the weights")
        if self.source is not None and self.initialized:
            warnings.warn(f"{len(self.initialized)} parameter(s) were not in the weights and were initialized "
                          f"instead, e.g. {self.initialized[0]!r}", stacklevel=3)

    def _check_shape(self, param: nn.Parameter, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeConfigError(
                f"weights for {self.aliases[id(param)][0]!r} have shape {tuple(value.shape)}, "
                f"the model's parameter has {tuple(param.shape)}",
                hint="load weights saved from the same model configuration")

    def _assign(self, param: nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            if param.is_meta:
                # No copy of our own: the unit copies these values into its buffer right away and
                # never writes through them (unit/storage.py), so the source's tensor can stand in.
                real = nn.Parameter(value.to(self.device, param.dtype), requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, real)
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
            self.initialized.append(self.aliases[id(param)][0])
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
        init = self.param_init_fn or getattr(module, "reset_parameters", None)
        if init is None:
            return False
        placed = {}
        with torch.no_grad():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                empty = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                if param.is_meta:
                    torch.utils.swap_tensors(param, nn.Parameter(empty, requires_grad=param.requires_grad))
                else:
                    placed[name] = param
                    module._parameters[name] = nn.Parameter(empty, requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._rng)))
                init(module) if self.param_init_fn else init()
            module._parameters.update(placed)
        return True
