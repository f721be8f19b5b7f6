"""pytest -m long tests/e2e/test_resume_scripts.py — the scripts we ship continue where they stopped.

examples/train_gpt.py and the ``zerorun init`` train.py run under the real launcher with 2 CPU
ranks, checkpoint.interval_steps 5. One run goes to its total uninterrupted; another is stopped by
SIGTERM to the launcher after its step 12 line and started again with ``--resume``: it must
continue from the last interval checkpoint (step 10, or later if the stop came late) to its
total, and every step's loss of every rank (metrics.jsonl, full float precision) must be
bit-equal to the uninterrupted run's. Both scripts' tiny steps take about 10 ms, and the step-12
line reaches the test through the launcher's pipes later than that (an idle run was already
past step 20), so each runs to 200 steps and may have saved at any interval before the total.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 20


def env() -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZERORUN_")}
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    environ["OMP_NUM_THREADS"] = "1"
    return environ


def command(tmp: Path, run: str, script: list[str], *flags: str) -> list[str]:
    return [sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--run-dir", str(tmp / run),
            "--config", str(tmp / "ckpt.yaml"), *flags, *script]


def step_losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss of every step record in the run's metrics file."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "step" and record.get("loss") is not None:
            losses[(record["rank"], record["step"])] = record["loss"]
    return losses


def printed_steps(text: str, steps: int = STEPS) -> list[int]:
    """The step numbers of the script's ``step N/<steps>  loss ...`` lines."""
    return [int(n) for n in re.findall(rf"\bstep +(\d+)/{steps} +loss", text)]


def stop_after(cmd: list[str], cwd: Path, step: int, steps: int) -> subprocess.CompletedProcess:
    """Run the launcher and SIGTERM it as soon as the script prints its line of ``step``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if step in printed_steps(line, steps):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines) + rest, "")


def check_resume(tmp: Path, script: list[str], steps: int = STEPS, stops_at: tuple[int, ...] = (10, 15)) -> None:
    ckpt = tmp / "ckpts"
    (tmp / "ckpt.yaml").write_text(
        f"zero: {{stage: 2}}\nbatch: {{micro_batch_size: 4}}\n"
        f"checkpoint: {{dir: {ckpt}, interval_steps: 5, keep_last: 1}}\n")
    whole = subprocess.run(command(tmp, "whole", script), cwd=tmp, env=env(), capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    reference = step_losses(tmp / "whole")
    assert sorted({step for _, step in reference}) == list(range(1, steps + 1))

    for path in ckpt.iterdir():  # the uninterrupted run's checkpoints are not the second run's
        subprocess.run(["rm", "-rf", str(path)], check=True)
    stopped = stop_after(command(tmp, "first", script), tmp, 12, steps)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stdout
    saved = int((ckpt / "latest").read_text().strip().removeprefix("global_step"))
    assert saved in stops_at, saved

    resumed = subprocess.run(command(tmp, "second", script, "--resume"), cwd=tmp, env=env(), capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    second = step_losses(tmp / "second")
    # Steps saved+1 .. the total, each once, and nothing beyond it.
    assert sorted({step for _, step in second}) == list(range(saved + 1, steps + 1)), out
    assert second == {key: loss for key, loss in reference.items() if key[1] > saved}
    assert printed_steps(out, steps) == list(range(saved + 1, steps + 1)), out


@pytest.mark.long
@pytest.mark.timeout(900)
def test_train_gpt_stopped_by_sigterm_resumes_bit_exactly_to_the_total(tmp_path):
    steps = 10 * STEPS
    check_resume(tmp_path, [str(REPO / "examples" / "train_gpt.py"), "--preset", "nano", "--steps", str(steps)], steps,
                 stops_at=tuple(range(10, steps, 5)))


@pytest.mark.long
@pytest.mark.timeout(900)
def test_init_template_stopped_by_sigterm_resumes_bit_exactly_to_the_total(tmp_path):
    script = tmp_path / "train.py"
    script.write_text((REPO / "zerorun" / "templates" / "train.py").read_text())
    steps = 10 * STEPS
    check_resume(tmp_path, [str(script), "--steps", str(steps)], steps, stops_at=tuple(range(10, steps, 5)))
