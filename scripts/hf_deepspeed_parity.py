"""An unchanged Trainer script with Hugging Face's ZeRO-2/ZeRO-3 example configs (optimizer and scheduler
sections included) and an Accelerate loop with a DeepSpeedPlugin, under real DeepSpeed and under
zerorun --as-deepspeed.

    python scripts/hf_deepspeed_parity.py [--record] [--ds-python /work/dsvenv/bin/python]

Both on the CPU with 2 ranks, fp32: tests/data/hf_deepspeed/trainer_script.py with
``--deepspeed ds_config_zero{2,3}.json`` as shipped (DeepSpeed's AdamW over every parameter, its
WarmupLR, CPU optimizer offload, parameter offload at stage 3). DeepSpeed runs in its own
virtual environment (scripts/deepspeed_chat_parity.py says how to make it), started by torchrun.
The Accelerate loop (accelerate_script.py, ``--zero-stage 2|3``) runs the same way.
``--record`` writes DeepSpeed's logged losses and eval loss to tests/data/hf_deepspeed/ds_losses.json,
which tests/e2e/test_as_deepspeed_hf.py compares zerorun's against without DeepSpeed installed.
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "hf_deepspeed"
RECORD = DATA / "ds_losses.json"
SCRIPT = DATA / "trainer_script.py"
ACCELERATE_SCRIPT = DATA / "accelerate_script.py"


def script_args(name: str) -> tuple[Path, list[str]]:
    """'stage2' -> the Trainer script with ds_config_zero2.json; 'accelerate-stage2' -> the loop."""
    stage = name[-1]
    if name.startswith("accelerate-"):
        return ACCELERATE_SCRIPT, ["--zero-stage", stage]
    return SCRIPT, ["--deepspeed", str(DATA / f"ds_config_zero{stage}.json")]


def _env(path: list[str]) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error", "DS_ACCELERATOR": "cpu"}


def run_deepspeed(name: str, workdir: Path, ds_python: str, timeout_s: float = 900) -> dict:
    out = workdir / f"deepspeed-{name}"
    script, args = script_args(name)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(script), *args, "--out", str(out)]
    done = subprocess.run(command, cwd=workdir, env=_env([]), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed {name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads((out / "result.json").read_text())


def run_zerorun(name: str, workdir: Path, timeout_s: float = 600) -> dict:
    out = workdir / f"zerorun-{name}"
    script, args = script_args(name)
    command = [str(Path(sys.executable).with_name("zerorun")), "--nproc", "2", "--no-dashboard", "--as-deepspeed",
               str(script), *args, "--out", str(out)]
    done = subprocess.run(command, cwd=workdir, env=_env([str(ROOT)]), capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"zerorun {name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads((out / "result.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs = ["stage2", "stage3", "accelerate-stage2", "accelerate-stage3"]
    parser.add_argument("--runs", nargs="+", default=runs, choices=runs)
    parser.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--record", action="store_true", help=f"write DeepSpeed's losses to {RECORD}")
    args = parser.parse_args()
    version = subprocess.run([args.ds_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True, text=True, env=_env([]))
    if version.returncode != 0:
        print(f"error: DeepSpeed does not import with {args.ds_python}", file=sys.stderr)
        return 2
    recorded = {}
    with tempfile.TemporaryDirectory(prefix="hf-ds-parity-") as scratch:
        for name in args.runs:
            theirs = run_deepspeed(name, Path(scratch), args.ds_python)
            ours = run_zerorun(name, Path(scratch))
            recorded[name] = {"loss": theirs["loss"], "eval_loss": theirs.get("eval_loss")}
            worst = max(abs(a - b) / abs(b) for a, b in zip(ours["loss"], theirs["loss"], strict=True))
            print(f"{name}: DeepSpeed {theirs['loss']} eval {theirs.get('eval_loss')}")
            print(f"{name}: zerorun   {ours['loss']} eval {ours.get('eval_loss')}; largest relative "
                  f"difference {worst:.2e}", flush=True)
    if args.record:
        RECORD.write_text(json.dumps({"deepspeed": version.stdout.strip(), "world_size": 2,
                                      "note": "stageN: Trainer's logged losses and final eval loss of trainer_script.py "
                                              "with the shipped configs; accelerate-stageN: every micro-batch's "
                                              "loss of accelerate_script.py; under DeepSpeed on the CPU, fp32",
                                      "runs": recorded}, indent=1) + "\n")
        print(f"recorded DeepSpeed's losses in {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
