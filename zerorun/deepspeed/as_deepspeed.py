"""``zerorun --as-deepspeed``: the job's workers ``import deepspeed`` and get ``zerorun.deepspeed``.

    zerorun --nproc 2 --as-deepspeed main.py --deepspeed ...      # a DeepSpeed program, unchanged
    pytest tests/unit/test_deepspeed_surface.py tests/e2e/test_as_deepspeed_hf.py

transformers and Accelerate import ``deepspeed`` by its own name and ask ``importlib.metadata``
for its version, so no import rewrite in the user's script can reach them. The launcher puts
``shim/`` first on the workers' PYTHONPATH; it holds two things:

* ``deepspeed/__init__.py``, which calls ``install()``: ``sys.modules["deepspeed"]`` becomes
  ``zerorun.deepspeed`` and a finder maps every ``deepspeed.X`` import onto the module object of
  ``zerorun.deepspeed.X`` (the same object, not a second copy, so an ``isinstance`` or an enum
  compared across the two names agrees);
* ``deepspeed-<version>.dist-info/METADATA``: the distribution ``importlib.metadata`` finds, with
  the DeepSpeed version whose API zerorun.deepspeed follows and a local label saying it is
  zerorun's (``0.19.8+zerorun``), so ``>=0.9.3``-style checks pass and the origin is visible.

Nothing changes for a process started without the flag. A real DeepSpeed installed beside it is
shadowed only in this job's workers, and the launcher says so (``shadowed_deepspeed``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Mapping
from pathlib import Path

# The DeepSpeed release whose names and behaviour zerorun.deepspeed follows (docs/deepspeed.md).
DEEPSPEED_API_VERSION = "0.19.8"
SHIM_DIR = Path(__file__).resolve().parent / "shim"
ALIAS = "deepspeed"
TARGET = "zerorun.deepspeed"
ENV_FLAG = "ZERORUN_AS_DEEPSPEED"


def version() -> str:
    """``deepspeed.__version__`` under the flag: DeepSpeed's API version, labelled as zerorun's."""
    from zerorun import __version__

    return f"{DEEPSPEED_API_VERSION}+zerorun.{__version__}"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``deepspeed.X`` -> the already-imported (or now imported) ``zerorun.deepspeed.X``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        if importlib.util.find_spec(real) is None:
            return None  # ModuleNotFoundError names deepspeed.X, as without the alias
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        real = importlib.import_module(TARGET + spec.name[len(ALIAS):])
        # The import system overwrites __spec__ on what we return; exec_module puts it back.
        spec.loader_state = real.__spec__
        return real

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Make ``import deepspeed`` (and every ``deepspeed.X``) mean zerorun.deepspeed in this process."""
    module = importlib.import_module(TARGET)
    sys.modules[ALIAS] = module
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a worker of an ``--as-deepspeed`` job gets: the shim directory first on
    PYTHONPATH (ahead of the user's entries, which stay), and the flag itself."""
    existing = environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(SHIM_DIR) + (os.pathsep + existing if existing else ""), ENV_FLAG: "1"}


def shadowed_deepspeed() -> str | None:
    """A real DeepSpeed this interpreter would import without the flag (its version and place),
    else None: the launcher names it, so nobody wonders which engine a job ran on."""
    from importlib import metadata

    for dist in metadata.distributions(name=ALIAS):
        where = Path(str(dist.locate_file(""))).resolve()
        if where != SHIM_DIR:
            return f"DeepSpeed {dist.version} at {where}"
    return None
