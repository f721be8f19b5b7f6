"""What a checkpoint's ``client_state`` may hold: only what loading can read back.

Used by checkpoint/save.py before a save; tests: tests/unit/test_checkpoint_safety.py.

Note [client state round trip]: engine.pt is read with ``torch.load(weights_only=True)``, the
unpickler that cannot run code from a file. It refuses arbitrary objects, so an argparse
``Namespace`` or a numpy value in ``client_state`` used to save fine and then fail every load.
The save now refuses it, naming the key and the allowed types, before anything is written;
and as a last guard the whole client state is round-tripped through that same unpickler.
"""

from __future__ import annotations

import io
import pickle

import torch

from zerorun.errors import CheckpointError

_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
ALLOWED = "None, bool, int, float, str, bytes, list, tuple, set, dict, torch.Tensor, torch.Size, torch.dtype, torch.device"
_HINT = "store plain values (vars(args) for an argparse Namespace, float(x) or x.tolist() for numpy)"


def _first_problem(value, path: str, depth: int = 0) -> tuple[str, str] | None:
    """(key path, type name) of the first value ``torch.load(weights_only=True)`` would refuse."""
    if depth > 64:
        return path, "a structure nested more than 64 levels"
    if isinstance(value, torch.Tensor):
        return None if type(value) in (torch.Tensor, torch.nn.Parameter) else (path, type(value).__qualname__)
    if type(value) in _LEAVES:
        return None
    if type(value) in (list, tuple, set):
        for i, item in enumerate(value):
            found = _first_problem(item, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None
    if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
        for key, item in value.items():
            found = _first_problem(key, f"{path} key {key!r}", depth + 1) or _first_problem(item, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
        return None
    kind = type(value)
    return path, f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def check_client_state(client_state) -> None:
    """Raise CheckpointError unless ``client_state`` would load again (Note [client state round trip])."""
    if client_state is None:
        return
    found = _first_problem(client_state, "client_state")
    if found is None:
        buffer = io.BytesIO()
        try:
            torch.save(client_state, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
            return
        except (pickle.UnpicklingError, RuntimeError, TypeError, AttributeError) as exc:
            found = ("client_state", str(exc).splitlines()[0][:120])
    path, kind = found
    raise CheckpointError(f"{path} is a {kind}, which a checkpoint could not load again; allowed: {ALLOWED}",
                          hint=_HINT)
