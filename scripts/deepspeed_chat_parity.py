"""DeepSpeed-Chat steps 1 (SFT), 2 (DPO) and 3 (PPO), unchanged, under real DeepSpeed and under zerorun --as-deepspeed.

    python scripts/deepspeed_chat_parity.py [--record] [--ds-python /work/dsvenv/bin/python]

Both on the CPU with 2 gloo ranks, bf16, on the tiny OPT and the synthetic rm-static data of
tests/data/deepspeed_chat/fixture.py (built once, here, with this interpreter, so both arms load
the same files). DeepSpeed's side runs in its own virtual environment (never the project's):

    python3 -m venv /work/dsvenv && /work/dsvenv/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate==1.15.0
    DS_BUILD_OPS=0 /work/dsvenv/bin/pip install deepspeed==0.19.8

torchrun starts DeepSpeed's ranks through a two-line wrapper that appends ``--local_rank=N`` as
DeepSpeed's launcher does (DeepSpeed-Chat joins the process group only when it gets one).
``--record`` writes DeepSpeed's rank-0 losses and a per-tensor summary of each saved model
(``saved_summary``) to tests/data/deepspeed_chat/ds_losses.json, which
tests/e2e/test_deepspeed_chat.py compares zerorun's against without DeepSpeed installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "deepspeed_chat"
RECORD = DATA / "ds_losses.json"
STEP_SCRIPTS = {"sft": "training/step1_supervised_finetuning/main.py", "dpo": "training/step2_dpo_finetuning/main.py",
                "ppo": "training/step3_rlhf_finetuning/main.py"}
# name: (step, stage, extra arguments)
RUNS = {
    "sft-stage2": ("sft", 2, []),
    "sft-stage2-offload": ("sft", 2, ["--offload"]),
    "sft-stage3": ("sft", 3, []),
    "dpo-stage0": ("dpo", 0, []),
    "dpo-stage2": ("dpo", 2, []),
    "dpo-stage3": ("dpo", 3, []),
}
# Step 3 with the flags of DeepSpeed-Chat's opt/single_node/run_1.3b.sh (sizes made tiny); 11 of
# its 12 step-3 launch scripts pass --enable_hybrid_engine. Not recorded under DeepSpeed here.
PPO_RUNS = {
    "ppo-stage2": ("ppo", 2, []),
    "ppo-stage2-hybrid": ("ppo", 2, ["--enable_hybrid_engine"]),
    "ppo-stage3-hybrid": ("ppo", 3, ["--enable_hybrid_engine"]),
    # and with --actor_gradient_checkpointing, as 9 of the 12 launch scripts pass it
    "ppo-stage3-hybrid-ckpt": ("ppo", 3, ["--enable_hybrid_engine", "--actor_gradient_checkpointing"]),
}
RUNS.update(PPO_RUNS)
PPO_LINE = re.compile(r"Epoch: (\d+) \| Step: (\d+) \| PPO Epoch: \d+ \| Actor Loss: (\S+) \| Critic Loss: (\S+)")
ANSWER_LINE = re.compile(r"--- ans    --> step=(\d+), rank=0, (.*)")
LOSS_LINE = re.compile(r"Epoch: (\d+), Step: (\d+), Rank: 0, loss = ([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))")
LOCAL_RANK_WRAPPER = ("import os, runpy, sys\n"
                      "sys.argv = sys.argv[1:] + ['--local_rank=' + os.environ['LOCAL_RANK']]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def step_args(step: str, stage: int, extra: list[str], fixture: Path, out: Path) -> list[str]:
    if step == "ppo":
        return ppo_args(stage, extra, fixture, out)
    split = "10,0,0" if step == "sft" else "0,10,0"
    return ["--data_path", str(fixture / "Dahoas" / "rm-static"), "--data_split", split,
            "--model_name_or_path", str(fixture / "model"), "--per_device_train_batch_size", "2",
            "--per_device_eval_batch_size", "2", "--max_seq_len", "16", "--learning_rate", "1e-3",
            "--num_train_epochs", "1", "--gradient_accumulation_steps", "2" if step == "sft" else "1",
            "--zero_stage", str(stage), "--dtype", "bf16", "--output_dir", str(out), "--seed", "1234",
            "--data_output_path", str(out / "cache"), "--print_loss", "--deepspeed", *extra]


def ppo_args(stage: int, extra: list[str], fixture: Path, out: Path) -> list[str]:
    """run_1.3b.sh's arguments on the fixture: actor model/, critic (and reward) critic/."""
    return ["--data_path", str(fixture / "Dahoas" / "rm-static"), "--data_split", "0,0,10",
            "--actor_model_name_or_path", str(fixture / "model"), "--critic_model_name_or_path",
            str(fixture / "critic"), "--num_padding_at_beginning", "1", "--per_device_generation_batch_size", "2",
            "--per_device_training_batch_size", "2", "--generation_batches", "1", "--ppo_epochs", "1",
            "--max_answer_seq_len", "4", "--max_prompt_seq_len", "12", "--actor_learning_rate", "1e-3",
            "--critic_learning_rate", "1e-3", "--num_train_epochs", "1", "--lr_scheduler_type", "cosine",
            "--gradient_accumulation_steps", "1", "--actor_dropout", "0.0", "--num_warmup_steps", "2",
            "--deepspeed", "--seed", "1234", "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage),
            "--enable_ema", "--dtype", "bf16", "--output_dir", str(out), "--data_output_path", str(out / "cache"),
            "--print_answers", "--print_answers_interval", "1", *extra]


def ppo_steps(output: str) -> list[tuple[float, float]]:
    """Rank 0's (actor loss, critic loss) per PPO step."""
    return [(float(m.group(3)), float(m.group(4))) for m in PPO_LINE.finditer(output)]


def ppo_answers(output: str) -> list[str]:
    """Rank 0's decoded answers per step (--print_answers)."""
    return [m.group(2) for m in ANSWER_LINE.finditer(output)]


def saved_summary(out: Path) -> dict[str, list[float]]:
    """Per tensor of the saved ``pytorch_model.bin``: [sum, L2 norm] in float64. The saved model
    compared without keeping DeepSpeed's weights in the repository."""
    import torch

    saved = torch.load(out / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {key: [float(t.double().sum()), float(t.double().norm())] for key, t in sorted(saved.items())}


def build_fixture(where: Path) -> Path:
    subprocess.run([sys.executable, str(DATA / "fixture.py"), str(where)], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return where


def losses(output: str) -> list[float]:
    """SFT and DPO: rank 0's loss per micro-step; PPO: its actor and critic losses per step, in turn."""
    ppo = ppo_steps(output)
    return [loss for pair in ppo for loss in pair] if ppo else [float(m.group(3)) for m in LOSS_LINE.finditer(output)]


def _env(extra_path: list[str]) -> dict[str, str]:
    path = [*extra_path, str(DATA), str(DATA / "shims")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error", "DS_ACCELERATOR": "cpu"}


def run_zerorun(name: str, fixture: Path, workdir: Path, timeout_s: float = 600) -> tuple[list[float], str]:
    step, stage, extra = RUNS[name]
    out = workdir / f"zerorun-{name}"
    # DeepSpeed-Chat's --enable_tensorboard too: its config dict (built in the script) asks for
    # event files, which zerorun's launcher writes (docs/telemetry.md, "Monitoring export").
    tensorboard = ["--enable_tensorboard", "--tensorboard_path", str(workdir / f"tb-{name}")]
    command = [str(Path(sys.executable).with_name("zerorun")), "--nproc", "2", "--no-dashboard", "--as-deepspeed",
               str(DATA / STEP_SCRIPTS[step]), *step_args(step, stage, extra, fixture, out), *tensorboard]
    done = subprocess.run(command, cwd=workdir, env=_env([str(ROOT)]), capture_output=True, text=True,
                          timeout=timeout_s)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"zerorun {name} exited {done.returncode}:\n{output[-4000:]}")
    return losses(output), output


def run_deepspeed(name: str, fixture: Path, workdir: Path, ds_python: str,
                  timeout_s: float = 900) -> tuple[list[float], dict[str, list[float]]]:
    step, stage, extra = RUNS[name]
    out = workdir / f"deepspeed-{name}"
    wrapper = workdir / "with_local_rank.py"
    wrapper.write_text(LOCAL_RANK_WRAPPER)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [ds_python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(wrapper), str(DATA / STEP_SCRIPTS[step]), *step_args(step, stage, extra, fixture, out)]
    done = subprocess.run(command, cwd=workdir, env=_env([]), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"DeepSpeed {name} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return losses(done.stdout + done.stderr), saved_summary(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=[name for name in RUNS if name not in PPO_RUNS], choices=list(RUNS))
    parser.add_argument("--ds-python", default="/work/dsvenv/bin/python")
    parser.add_argument("--record", action="store_true", help=f"write DeepSpeed's losses to {RECORD}")
    parser.add_argument("--no-zerorun", action="store_true", help="run DeepSpeed only")
    args = parser.parse_args()
    version = subprocess.run([args.ds_python, "-c", "import deepspeed, torch, transformers; "
                              "print(deepspeed.__version__, torch.__version__, transformers.__version__)"],
                             capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if version.returncode != 0:
        print(f"error: DeepSpeed does not import with {args.ds_python} (see this file's docstring)", file=sys.stderr)
        return 2
    ds_version, torch_version, transformers_version = version.stdout.split()[-3:]
    previous = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    recorded, saved = previous.get("losses", {}), previous.get("saved", {})
    with tempfile.TemporaryDirectory(prefix="dschat-parity-") as scratch:
        workdir = Path(scratch)
        fixture = build_fixture(workdir / "fixture")
        for name in args.runs:
            try:
                theirs, saved[name] = run_deepspeed(name, fixture, workdir, args.ds_python)
            except RuntimeError as err:
                print(f"{name}: DeepSpeed failed: {str(err)[-600:]}")
                continue
            recorded[name] = theirs
            print(f"{name}: DeepSpeed {len(theirs)} losses {theirs[:3]} ... {theirs[-2:]}", flush=True)
            if args.record:  # after each run: a later failure keeps what was measured
                write_record(recorded, saved, ds_version, torch_version, transformers_version)
            if args.no_zerorun:
                continue
            try:
                ours, _ = run_zerorun(name, fixture, workdir)
            except RuntimeError as err:
                print(f"{name}: zerorun failed: {str(err)[-600:]}")
                continue
            worst = max((abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)), default=float("nan")) \
                if len(ours) == len(theirs) else float("inf")
            print(f"{name}: zerorun {len(ours)} losses; largest relative difference {worst:.2e}", flush=True)
    if args.record:
        print(f"recorded DeepSpeed's losses in {RECORD}")
    return 0


def write_record(recorded: dict, saved: dict, ds_version: str, torch_version: str, transformers_version: str) -> None:
    RECORD.write_text(json.dumps({
        "deepspeed": ds_version, "torch": torch_version, "transformers": transformers_version, "world_size": 2,
        "note": "rank 0's printed loss per micro-step (--print_loss) of DeepSpeed-Chat's unchanged step "
                "under DeepSpeed on the CPU, bf16, fixture.py's tiny OPT and data",
        "losses": recorded,
        "saved_note": "per tensor of the saved pytorch_model.bin (save_hf_format, then save_zero_three_model at "
                      "stage 3), rank 0: [sum, L2 norm] in float64",
        "saved": saved}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
