"""pytest tests/unit/test_layering.py — the training runtime never imports the launcher, and
the record never imports its placements back.

What runs inside a worker (zerorun.zero, zerorun.deepspeed, zerorun.telemetry, zerorun.integrations)
takes its worker-side pieces from zerorun.worker; zerorun.launch may import the runtime, never the
other way round, so there is no import cycle between them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zerorun

PACKAGE = Path(zerorun.__file__).parent
RUNTIME = ("zero", "deepspeed", "telemetry", "integrations", "worker")


def _launch_imports(path: Path) -> list[str]:
    """Every import of zerorun.launch in a file, also those inside functions (imported lazily)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}" for name in names
                  if name == "zerorun.launch" or name.startswith("zerorun.launch.")]
    return found


def test_no_runtime_module_imports_the_launcher():
    files = [path for part in RUNTIME for path in sorted((PACKAGE / part).rglob("*.py"))]
    assert len(files) > 20  # the walk found the packages
    offenders = [line for path in files for line in _launch_imports(path)]
    assert offenders == []


def test_a_worker_runs_without_loading_the_launcher():
    """A fresh interpreter that imports the engine and the DeepSpeed surface and joins its (world
    size 1) group, arming save-on-signal and reading the Slurm step on the way, has loaded no
    zerorun.launch module."""
    code = (
        "import sys, zerorun.zero.engine, zerorun.deepspeed\n"
        "from zerorun.zero.comm.process_group import resolve_process_group\n"
        "resolve_process_group()\n"
        "print(sorted(name for name in sys.modules if name.startswith('zerorun.launch')))\n"
    )
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "ZERORUN_")) and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"ZERORUN_SAVE_ON_SIGNAL": "1", "CUDA_VISIBLE_DEVICES": ""})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The zerorun modules a file imports in any way: at the top, under TYPE_CHECKING (a cycle
    for the type checker and the reader), or inside a function."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``from . import x`` is the file's package, each dot one up
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # ``from package import module`` names a module; ``from module import name`` the module
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return found & known


def _cycle_through(module: str) -> list[str]:
    """The modules that ``module`` reaches by imports and that reach it back (empty: no cycle)."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    imports = {name: _imported_modules(path, set(files)) for name, path in files.items()}

    def reached_from(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in imports[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    return sorted(name for name in reached_from(module) if module in reached_from(name))


@pytest.mark.parametrize("module", ["zerorun.zero.unit.record", "zerorun.zero.offload.placements",
                                    "zerorun.zero.unit.placement"])
def test_no_import_cycle_between_the_record_and_its_placements(module):
    """The record holds placements and the placements take records: the protocol they share
    (unit/placement.py) imports no record, so neither side imports the other back, not even for
    the type checker."""
    assert _cycle_through(module) == []


def test_the_runtime_never_imports_the_deepspeed_shim():
    """zerorun.zero knows nothing of DeepSpeed's names: the shim attaches ds_* attributes through
    an engine hook (Note [attributes from the shim] in zerorun/deepspeed/ds_params.py), so the
    runtime imports no zerorun.deepspeed module, not even inside a function."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    offenders = sorted(f"{name} imports {imported}" for name, path in files.items() if name.startswith("zerorun.zero")
                       for imported in _imported_modules(path, set(files))
                       if imported == "zerorun.deepspeed" or imported.startswith("zerorun.deepspeed."))
    assert offenders == []


def test_a_plain_initialize_loads_no_deepspeed_module():
    """A stage-3 ``zerorun.initialize`` (world size 1), its forward, backward, step and a
    stage-3 state dict load none of zerorun.deepspeed; importing the shim afterwards attaches
    ds_* to the engine already built, frozen parameters included (Note [frozen units])."""
    code = (
        "import sys, torch, zerorun\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))\n"
        "model[0].requires_grad_(False)\n"
        "engine = zerorun.initialize(model, torch.optim.SGD(model[1].parameters(), lr=0.1),\n"
        "                            {'zero': {'stage': 3, 'param_persistence_threshold': 0}})\n"
        "engine.backward(engine(torch.randn(2, 8)).sum()); engine.step(); engine.full_state_dict()\n"
        "print(len([n for n in sys.modules if n.startswith('zerorun.deepspeed')]))\n"
        "import zerorun.deepspeed\n"
        "print(all(hasattr(p, 'ds_status') and hasattr(p, 'ds_id') for p in model.parameters()))\n"
    )
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("SLURM_", "ZERORUN_")) and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-2:] == ["0", "True"]
