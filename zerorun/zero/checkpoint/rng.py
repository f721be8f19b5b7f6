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


# Note [own GPU's generator]: a rank saves the generator of the GPU it is bound to (its current
# device: worker/device.py binds it) under one key, and restores it to the GPU it is bound to
# then. Saving every visible GPU's state by index, and restoring by index, gave a rank resumed
# under another binding (all GPUs visible at save, one per rank at resume, or another order) the
# generator of another rank's GPU. Checkpoints written that way (``cuda0``, ``cuda1`` ...) are
# still restored by index, as they were saved.
OWN_GPU = "cuda"


def torch_rng() -> dict[str, torch.Tensor]:
    """The CPU generator's state, and, in a worker using CUDA, its own GPU's (Note [own GPU's
    generator])."""
    states = {whole_key(RNG, "torch"): torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[whole_key(RNG, OWN_GPU)] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def load_rng(reader: Reader, manifest: dict, rank: int) -> None:
    source = reader.file(rank_file(rank))
    torch.set_rng_state(source.read(whole_key(RNG, "torch")))
    keys = set(source.keys())
    # Only where CUDA is already in use (a GPU worker moved its model there): asking
    # is_available() or device_count() in a CPU worker on a GPU node starts the CUDA driver,
    # which Note [device contract] (zerorun/worker/device.py) promises never happens.
    if torch.cuda.is_initialized():
        own = whole_key(RNG, OWN_GPU)
        by_index = sorted((k for k in keys if k.startswith(own) and k[len(own):].isdigit()), key=lambda k: int(k[len(own):]))
        if own in keys:  # Note [own GPU's generator]
            torch.cuda.set_rng_state(source.read(own), torch.cuda.current_device())
        elif by_index:  # written before: every visible GPU's, by index
            states = [source.read(key) for key in by_index]
            torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    restore_python_rng(manifest["ranks"][rank]["rng"])


