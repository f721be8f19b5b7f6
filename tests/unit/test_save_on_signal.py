"""pytest tests/unit/test_save_on_signal.py — checkpoint.on_signal in one process (world size 1, no launcher).

The multi-node path (launcher -> agent -> SIGUSR1 to every worker, requeue, resume) runs on a
real Slurm in tests/e2e/test_slurm_jobs.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import zerorun
from zerorun.worker import save_on_signal


@pytest.fixture
def armed(monkeypatch):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    monkeypatch.setattr(save_on_signal, "_armed", False)
    monkeypatch.setattr(save_on_signal, "_requested", False)
    monkeypatch.setenv(save_on_signal.ENV_NAME, "1")
    yield
    if save_on_signal._term_timer is not None:
        save_on_signal._term_timer.cancel()  # it would end this test process later
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def engine_for(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3)
    config = {"zero": {"stage": 1}, "checkpoint": {"dir": str(tmp_path / "ckpt"), "on_signal": True}}
    return zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def train_step(engine):
    loss = engine(torch.ones(2, 7)).sum()
    engine.backward(loss)
    engine.step()


def test_sigusr1_saves_at_the_next_step_and_stops_the_worker(tmp_path, armed):
    engine = engine_for(tmp_path)
    train_step(engine)
    assert not (tmp_path / "ckpt" / "latest").exists()  # no signal, no save (the directory itself is taken at start)
    os.kill(os.getpid(), signal.SIGUSR1)  # noted only: the process lives on
    with pytest.raises(SystemExit) as stopped:
        train_step(engine)
    assert stopped.value.code == 0
    assert (tmp_path / "ckpt" / "global_step2").is_dir()


def test_unarmed_workers_never_pay_for_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(save_on_signal, "_armed", False)
    monkeypatch.delenv(save_on_signal.ENV_NAME, raising=False)
    assert not save_on_signal.arm()
    engine = engine_for(tmp_path)
    assert not save_on_signal.due(engine)


def test_in_a_slurm_job_the_first_sigterm_waits_for_the_verdict_and_is_no_save(tmp_path, armed, monkeypatch):
    """Note [a worker's SIGTERM under Slurm]: Slurm's SIGTERM to the step does not kill at once;
    the launcher's SIGUSR1 that follows (a preemption) saves; the TERM alone saves nothing."""
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(save_on_signal, "TERM_WAIT_S", 60.0)
    engine = engine_for(tmp_path)
    os.kill(os.getpid(), signal.SIGTERM)  # the test process lives on
    train_step(engine)
    assert not (tmp_path / "ckpt" / "latest").exists()  # no save (the directory is taken at start)
    os.kill(os.getpid(), signal.SIGUSR1)  # the verdict: preempted, save
    with pytest.raises(SystemExit):
        train_step(engine)
    assert (tmp_path / "ckpt" / "global_step2").is_dir()


WAITER = """
import os, signal, sys, time
from zerorun.worker import save_on_signal
save_on_signal.TERM_WAIT_S = 0.5
assert save_on_signal.arm({"ZERORUN_SAVE_ON_SIGNAL": "1", "SLURM_JOB_ID": "42"})
os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "verdict":
    os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(3)
print("alive")
"""


@pytest.mark.parametrize("verdict", ["verdict", "none"])
def test_without_a_verdict_a_slurm_sigterm_still_ends_the_worker(verdict):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WAITER, verdict], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if verdict == "verdict":
        assert done.returncode == 0 and "alive" in done.stdout, done.stderr
    else:
        assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
