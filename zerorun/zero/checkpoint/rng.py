"""The random number generators' states, saved per rank and restored on the same rank.

``pytest tests/distributed/test_checkpoint_resume.py tests/unit/test_device_contract.py`` runs its
tests; checkpoint/save.py captures them (torch's in the rank's safetensors file, Python's and
NumPy's in the manifest), checkpoint/load.py restores them.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from zerorun.zero.checkpoint.format import Reader, rank_file
from zerorun.zero.checkpoint.reshard import RNG, whole_key


def python_rng() -> dict:
    state: dict[str, object] = {"python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, keys.tolist(), position, has_gauss, cached]
    return json.loads(json.dumps(state))


def restore_python_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def torch_rng() -> dict[str, torch.Tensor]:
    states = {whole_key(RNG, "torch"): torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[whole_key(RNG, f"cuda{index}")] = state
    return states



def load_rng(reader: Reader, manifest: dict, rank: int) -> None:
    source = reader.file(rank_file(rank))
    torch.set_rng_state(source.read(whole_key(RNG, "torch")))
    cuda = [k for k in source.keys() if k.startswith(f"{RNG}/cuda")]
    # Only where CUDA is already in use (a GPU worker moved its model there): asking
    # is_available() or device_count() in a CPU worker on a GPU node starts the CUDA driver,
    # which Note [device contract] (zerorun/worker/device.py) promises never happens.
    if cuda and torch.cuda.is_initialized():
        states = [source.read(whole_key(RNG, f"cuda{i}")) for i in range(len(cuda))]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    restore_python_rng(manifest["ranks"][rank]["rng"])


