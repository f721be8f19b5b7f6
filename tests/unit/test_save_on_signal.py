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
from zerorun.launch import save_on_signal


@pytest.fixture
def armed(monkeypatch):
    previous = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(save_on_signal, "_armed", False)
    monkeypatch.setattr(save_on_signal, "_requested", False)
    monkeypatch.setenv(save_on_signal.ENV_NAME, "1")
    yield
    signal.signal(signal.SIGUSR1, previous)


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
    assert not (tmp_path / "ckpt").exists()  # no signal, no save
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
