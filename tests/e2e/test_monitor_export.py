"""pytest tests/e2e/test_monitor_export.py — TensorBoard, CSV and W&B output from a real job.

The demo (examples/train_gpt.py, nano GPT, 2 CPU ranks, 6 steps) under ``zerorun --nproc 2``:
- a zerorun YAML ``monitor`` section: TensorBoard event files read back with tensorboard's own
  reader (event_accumulator) and DeepSpeed-style CSV files hold the loss the script printed (the
  mean over ranks, to the 4 decimals it prints) at steps 1-6, and both ranks' memory at each;
- a DeepSpeed JSON with ``tensorboard`` and ``csv_monitor`` sections: the same, in
  ``output_path/job_name`` as DeepSpeed writes them;
- a script that gives ``initialize`` its own DeepSpeed dict (as DeepSpeed-Chat's
  ``--enable_tensorboard`` does): rank 0's engine tells the launcher, which writes;
- W&B in offline mode when ``wandb`` is installed (skipped with the reason otherwise).
One writer per job (Note [one writer] in zerorun/telemetry/monitor.py): one event file.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "examples" / "train_gpt.py")
STEPS = 6


def zerorun(args, cwd, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "WANDB_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    done = subprocess.run([sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--run-dir", "run", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def printed_losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\[rank0\] step +\d+/\d+ +loss ([0-9.]+)", out)]


def read_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    files = list(directory.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer
    acc = event_accumulator.EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_series(series: dict[str, list[tuple[int, float]]], losses: list[float]) -> None:
    assert [step for step, _ in series["train/loss"]] == list(range(1, STEPS + 1))
    assert [value for _, value in series["train/loss"]] == pytest.approx(losses, abs=6e-5)
    for rank in (0, 1):
        memory = series[f"rank{rank}/memory_bytes"]
        assert len(memory) == STEPS and all(value > 10e6 for _, value in memory)  # a CPU worker's RSS
        assert len(series[f"rank{rank}/comm_share"]) == STEPS
    assert all(value > 0 for _, value in series["train/samples_per_s"])


def read_csv(directory: Path) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for path in directory.glob("*.csv"):
        with open(path) as f:
            header, *rows = list(csv.reader(f))
        out[header[1]] = [(int(step), float(value)) for step, value in rows]
    return out


def test_yaml_monitor_section_writes_tensorboard_and_csv(tmp_path):
    config = (REPO / "zerorun/templates/zero3.yaml").read_text() + (
        "monitor:\n  tensorboard: {enabled: true, output_path: logs, job_name: demo}\n"
        "  csv: {enabled: true, output_path: logs/csv, job_name: demo}\n")
    (tmp_path / "zero3.yaml").write_text(config)
    out = zerorun(["--config", "zero3.yaml", DEMO, "--preset", "nano", "--steps", str(STEPS)], tmp_path)
    losses = printed_losses(out)
    assert len(losses) == STEPS
    check_series(read_tensorboard(tmp_path / "logs" / "demo"), losses)
    check_series(read_csv(tmp_path / "logs" / "csv" / "demo"), losses)


def test_deepspeed_json_tensorboard_and_csv_monitor_sections(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
        "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "ds_job"},
        "csv_monitor": {"enabled": True, "output_path": "csv/", "job_name": "ds_job"}}))
    out = zerorun(["--config", "ds.json", DEMO, "--preset", "nano", "--steps", str(STEPS)], tmp_path)
    losses = printed_losses(out)
    check_series(read_tensorboard(tmp_path / "tb" / "ds_job"), losses)
    check_series(read_csv(tmp_path / "csv" / "ds_job"), losses)


SCRIPT = """
import sys, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
config = {"train_batch_size": 8, "zero_optimization": {"stage": 1},
          "tensorboard": {"enabled": True, "output_path": "ds_tb/", "job_name": "in_script"}}
engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
data = torch.Generator().manual_seed(engine.rank)
for step in range(STEPS):
    loss = engine(torch.randn(4, 7, generator=data)).pow(2).mean()
    engine.backward(loss)
    engine.step()
""".replace("STEPS", str(STEPS))


def test_a_config_the_script_gives_initialize_is_written_by_the_launcher(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    zerorun(["job.py"], tmp_path)
    series = read_tensorboard(tmp_path / "ds_tb" / "in_script")
    assert [step for step, _ in series["train/loss"]] == list(range(1, STEPS + 1))
    assert len(series["rank1/memory_bytes"]) == STEPS


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed (pip install wandb): the W&B sink is covered by "
                           "tests/unit/test_monitor.py with a stand-in module")
def test_wandb_offline_run(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "wandb": {"enabled": True, "project": "zerorun-test"}}))
    zerorun(["--config", "ds.json", DEMO, "--preset", "nano", "--steps", str(STEPS)], tmp_path,
            WANDB_MODE="offline", WANDB_SILENT="true")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
