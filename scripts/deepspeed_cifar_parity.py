"""python scripts/deepspeed_cifar_parity.py [--stages 0 1 2 3] [--dtypes fp32 bf16] [--record]

DeepSpeed's own cifar example under real DeepSpeed and, changed only in its import lines, under
``zerorun --nproc 2``: both on the CPU with 2 gloo ranks, same seed, same synthetic CIFAR-shaped
data (tests/data/deepspeed_cifar/SOURCE.md). Prints rank 0's loss of every step from both and
the largest relative difference; in fp32 the two must agree within 1e-4 per step.

Real DeepSpeed lives in its own virtual environment, kept out of the project's:

    python3 -m venv /work/dsvenv && /work/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /work/dsvenv/bin/pip install deepspeed==0.19.8

(``--ds-python`` names another one; its CPU accelerator compiles its Adam op on first use.)
``--record`` writes DeepSpeed's losses to tests/data/deepspeed_cifar/ds_losses.json, which
tests/e2e/test_deepspeed_cifar.py compares zerorun's against without DeepSpeed installed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "deepspeed_cifar"
RECORD = DATA / "ds_losses.json"
SEED = 0
TRAIN_SIZE = 320  # 20 steps of the example's global batch of 16
TOLERANCE = 1e-4  # relative, per step, fp32


def example_args(stage: int, dtype: str) -> list[str]:
    return ["--deepspeed", "--dtype", dtype, "--stage", str(stage), "--epochs", "1", "--log-interval", "1"]


def _env(extra_path: list[str], loss_log: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, str(DATA / "shims")])
    env.update(CIFAR_TORCH_SEED=str(SEED), CIFAR_LOSS_LOG=str(loss_log), CIFAR_SHIM_TRAIN_SIZE=str(TRAIN_SIZE),
               CIFAR_SHIM_TEST_SIZE="40", DS_ACCELERATOR="cpu")
    return env


def _losses(loss_log: Path) -> list[float]:
    path = Path(f"{loss_log}.rank0")
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def _run(command: list[str], env: dict, workdir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)


def run_zerorun(stage: int, dtype: str, workdir: Path, timeout_s: float = 600) -> tuple[list[float], str]:
    """Rank 0's losses of the import-ported example under ``zerorun --nproc 2``, and its output."""
    log = workdir / f"zerorun-{dtype}-{stage}"
    zerorun = Path(sys.executable).with_name("zerorun")
    command = [str(zerorun), "--nproc", "2", "--no-dashboard", str(DATA / "cifar10_zerorun.py"),
               *example_args(stage, dtype)]
    done = _run(command, _env([str(ROOT)], log), workdir, timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"zerorun stage {stage} {dtype} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return _losses(log), done.stdout + done.stderr


def run_deepspeed(stage: int, dtype: str, workdir: Path, ds_python: str, timeout_s: float = 900) -> list[float]:
    """Rank 0's losses of the unchanged example under DeepSpeed (torchrun starts its 2 ranks)."""
    log = workdir / f"deepspeed-{dtype}-{stage}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(DATA / "cifar10_deepspeed.py"), *example_args(stage, dtype)]
    done = _run(command, _env([], log), workdir, timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed stage {stage} {dtype} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return _losses(log)


def largest_relative_difference(ours: list[float], theirs: list[float]) -> float:
    if len(ours) != len(theirs) or not ours:
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--record", action="store_true", help=f"write DeepSpeed's losses to {RECORD}")
    args = parser.parse_args()
    version = subprocess.run([args.ds_python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                             capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if version.returncode != 0:
        print(f"error: DeepSpeed does not import with {args.ds_python} (see this file's docstring)", file=sys.stderr)
        return 2
    ds_version, torch_version = version.stdout.split()[-2:]
    print(f"DeepSpeed {ds_version} (torch {torch_version}) vs zerorun; 2 CPU ranks, {TRAIN_SIZE // 16} steps, seed {SEED}")
    recorded, failed = {}, False
    with tempfile.TemporaryDirectory(prefix="cifar-parity-") as scratch:
        workdir = Path(scratch)
        for dtype in args.dtypes:
            for stage in args.stages:
                theirs = run_deepspeed(stage, dtype, workdir, args.ds_python)
                ours, _ = run_zerorun(stage, dtype, workdir)
                recorded[f"{dtype}-stage{stage}"] = theirs
                worst = largest_relative_difference(ours, theirs)
                verdict = ("ok" if worst <= TOLERANCE else "FAIL") if dtype == "fp32" else "(bf16: not compared)"
                failed |= dtype == "fp32" and worst > TOLERANCE
                print(f"\n{dtype} stage {stage}: largest relative difference {worst:.2e} {verdict}")
                print(f"  {'step':>4}  {'DeepSpeed':>12}  {'zerorun':>12}  {'rel. diff':>9}")
                for step, (b, a) in enumerate(zip(theirs, ours, strict=False), start=1):
                    print(f"  {step:>4}  {b:>12.7f}  {a:>12.7f}  {abs(a - b) / abs(b):>9.2e}")
    if args.record:
        RECORD.write_text(json.dumps({
            "deepspeed": ds_version, "torch": torch_version, "seed": SEED, "train_size": TRAIN_SIZE,
            "world_size": 2, "note": "rank 0's loss per step of cifar10_deepspeed.py under DeepSpeed on the CPU",
            "losses": recorded}, indent=1) + "\n")
        print(f"\nrecorded DeepSpeed's losses in {RECORD}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
