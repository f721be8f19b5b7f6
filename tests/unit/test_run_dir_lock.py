"""pytest tests/unit/test_run_dir_lock.py — run directories and checkpoint directories a live job holds.

Issue 38 items 1 and 4, without starting workers: ``prepare`` (what every launch and --dry-run
runs) refuses a named run directory a live launch holds, gives a default one a fresh name beside
it, and lets a requeued Slurm start continue once the previous start has ended (Note [one launch
per run directory] in zerorun/launch/run_dir.py); a checkpoint.dir that is a file, under /proc or
held by a live job is refused before any worker starts, and by the engine when it starts, not at
the first save (Note [refused before training] in zerorun/zero/checkpoint/owner.py). The holders
are child processes, ended by their own pids.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import zerorun
from zerorun.errors import CheckpointError, ConfigError, LaunchError
from zerorun.launch import run_dir
from zerorun.launch.plan import Target
from zerorun.launch.prepare import LaunchOptions, prepare, write_run_dir
from zerorun.zero.offload import scratch

HOLDER = r'''
import sys, time
from pathlib import Path
kind, path = sys.argv[1], sys.argv[2]
if kind == "run":
    from zerorun.launch import run_dir
    run_dir.take(path, "launch 0123abcd")
else:
    from zerorun.zero.checkpoint import owner
    owner.claim(Path(path), "slurm777")
print("held", flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 300)
'''


@pytest.fixture
def hold():
    started = []

    def start(kind, path, seconds=None):
        argv = [sys.executable, "-c", HOLDER, kind, str(path)] + ([str(seconds)] if seconds is not None else [])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _prepare(tmp_path, environ=None, **options):
    (tmp_path / "train.py").touch()
    return prepare(LaunchOptions(target=Target(script="train.py"), nproc=2, **options), environ=environ or {},
                   cwd=str(tmp_path))


def test_a_named_run_dir_a_live_launch_holds_is_refused(tmp_path, hold):
    holder = hold("run", tmp_path / "shared")
    with pytest.raises(LaunchError) as caught:
        _prepare(tmp_path, run_dir=str(tmp_path / "shared"))
    assert f"run directory {tmp_path / 'shared'} is in use by launch 0123abcd (pid {holder.pid} on " in str(caught.value)
    holder.kill()
    holder.wait()
    job = _prepare(tmp_path, run_dir=str(tmp_path / "shared"))  # a dead launch's lock is taken over
    write_run_dir(job)
    assert job.plan.run_dir == str(tmp_path / "shared") and (tmp_path / "shared" / "config.json").is_file()


def test_a_requeued_start_waits_for_the_previous_start_then_continues_its_run_dir(tmp_path, hold, monkeypatch):
    held = tmp_path / "zerorun-runs" / "slurm-4242"
    holder = hold("run", held, seconds=2)
    started = time.monotonic()
    job = _prepare(tmp_path, environ={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert job.plan.run_dir == str(held) and holder.poll() is not None
    assert time.monotonic() - started >= 1.0  # it waited for the previous start to end
    monkeypatch.setattr(run_dir, "REQUEUE_WAIT_S", 0.5)
    hold("run", tmp_path / "zerorun-runs" / "slurm-4243")
    job = _prepare(tmp_path, environ={"SLURM_JOB_ID": "4243", "SLURM_RESTART_COUNT": "1"})
    assert job.plan.run_dir.startswith(f"{tmp_path / 'zerorun-runs' / 'slurm-4243'}-")  # still held: its own
    assert any("slurm-4243 is in use by launch 0123abcd" in note for note in job.notes)


def test_workers_record_scratch_per_launch_and_the_sweep_spares_a_live_directory(tmp_path, monkeypatch):
    job = _prepare(tmp_path, run_dir=str(tmp_path / "run"))
    launch = job.plan.workers[0].env[scratch.LAUNCH_ID_ENV]
    assert launch == run_dir.launch_id(job.token) and job.token not in launch
    nvme = tmp_path / "nvme"
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("ZERORUN_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv(scratch.LAUNCH_ID_ENV, launch)
    placement = scratch.placement_directory(str(nvme), 0, "optim", "key")
    mine = placement.parent  # this process holds its lock
    assert (tmp_path / "run" / "scratch" / launch / "rank0").read_text().strip() == str(mine)
    assert scratch.sweep_recorded(tmp_path / "run", [0], launch) == [] and mine.is_dir()  # alive: spared
    other = scratch.records_folder(tmp_path / "run", "feedbeef")
    assert other != scratch.records_folder(tmp_path / "run", launch)
    placement.rmdir()
    scratch.remove_if_empty(mine)


def test_a_checkpoint_dir_that_can_never_hold_checkpoints_is_refused_before_start(tmp_path):
    (tmp_path / "a-file").write_text("x")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "below", "/proc/self/ckpt"):
        with pytest.raises(ConfigError) as caught:
            _prepare(tmp_path, config_overrides={"checkpoint.dir": str(where), "checkpoint.interval_steps": 5})
        assert "checkpoint.dir: " in str(caught.value) and "\n" not in str(caught.value)


def test_a_checkpoint_dir_a_live_job_holds_is_refused_before_start_and_by_the_engine(tmp_path, hold):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = hold("checkpoint", ckpt)
    with pytest.raises(ConfigError, match=rf"checkpoint.dir '{ckpt}' is in use by job slurm777 \(pid {holder.pid} on "):
        _prepare(tmp_path, config_overrides={"checkpoint.dir": str(ckpt), "checkpoint.interval_steps": 5})
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="is in use by job slurm777"):  # before any step, not at the first save
        zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           {"checkpoint": {"dir": str(ckpt), "interval_steps": 20}})


def test_a_failed_first_save_does_not_claim_a_previous_checkpoint_is_intact(tmp_path):
    from zerorun.zero.checkpoint.save import _after_a_failure

    assert "intact" not in _after_a_failure(tmp_path / "none-yet")
    model = torch.nn.Linear(3, 2)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    engine.save_checkpoint(tmp_path / "ckpt")
    assert _after_a_failure(tmp_path / "ckpt") == "the previous checkpoint (global_step0) is intact"


def test_the_lock_probe_never_drops_this_process_own_lock(tmp_path):
    run_dir.take(tmp_path / "mine", "launch test")
    assert run_dir.holder(tmp_path / "mine") is None
    seen = subprocess.run(
        [sys.executable, "-c", "import sys; from zerorun.launch import run_dir; print(run_dir.holder(sys.argv[1]))",
         str(tmp_path / "mine")], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert seen.startswith(f"launch test (pid {os.getpid()} on ")  # still held after asking twice
