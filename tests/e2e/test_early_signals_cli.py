"""pytest tests/e2e/test_early_signals_cli.py — a signal in the launcher's first instant is acted on.

Note [signals from the first instant] (zerorun/launch/early_signals.py): Slurm's timer can send
SIGUSR1 within a second of the start, before the launcher has planned anything. Each test
starts the real CLI, waits only until the process has a handler for the signal
(/proc/PID/status, SigCgt: the first thing ``main`` does), sends it, and checks what follows:
with checkpoint.on_signal every rank saves at its first step and the job stops saying so;
without it, and for SIGTERM, nothing starts and the last line says why. Never a death by the
signal's default action.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (signum - 1) & 1)


def launch_and_signal(tmp: Path, signum: int, config: str, steps: int = 50) -> subprocess.CompletedProcess:
    (tmp / "train.py").write_text((REPO / "zerorun" / "templates" / "train.py").read_text())
    (tmp / "c.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERORUN_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "zerorun", "--nproc", "2", "--no-dashboard", "--run-dir", str(tmp / "run"),
           "--config", "c.yaml", "train.py", "--steps", str(steps)]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not handles(proc.pid, signum) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_usr1_at_start_with_on_signal_saves_at_the_first_step(tmp_path):
    done = launch_and_signal(tmp_path, signal.SIGUSR1,
                             f"checkpoint: {{dir: {tmp_path / 'ckpts'}, on_signal: true}}\n", steps=100_000)
    assert done.returncode == 128 + signal.SIGUSR1, done.stdout + done.stderr
    # Saved at the first step boundary after every rank reported a step (Note [save request waits
    # for training]), long before the 100,000 steps end.
    assert (tmp_path / "ckpts" / "latest").read_text().strip().startswith("global_step")
    last = done.stderr.strip().splitlines()[-1]
    assert "every rank saved a checkpoint and stopped" in last, done.stderr
    # Outside Slurm a SIGUSR1 is someone's checkpoint request, not a time limit.
    assert "time limit" not in last and "SIGUSR1" in last, last
    # The summary's header says the same, not "finished" (exit 138: the job did not finish).
    assert "zerorun summary (stopped on SIGUSR1; checkpoint saved after" in " ".join(done.stdout.split()), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stopping_signal_at_start_starts_nothing_and_says_so(tmp_path, signum):
    done = launch_and_signal(tmp_path, signum, "zero: {stage: 1}\n")
    assert done.returncode == 128 + signum, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("before any worker started; nothing was started"), done.stderr
    assert signal.Signals(signum).name in last
    assert not (tmp_path / "run" / "logs").exists()
