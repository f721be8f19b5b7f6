"""pytest tests/unit/test_offload_io.py — NVMe offload under ordinary storage faults.

One process, a tiny model with its optimizer state in files. What they prove: a truncated or
removed unit file, a short read, EIO and ENOSPC each raise one StorageError line naming the
rank, the file and the bytes moved (never a silent NaN from a stale buffer); every pool buffer
is back after the error and nothing waits on the pool (no hang at exit); scratch lives under
per-process names (two jobs of one allocation never share one), a dead process's removed
at the next start-up and by the launcher's sweep; the
free-space check is per file system with sane numbers.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zerorun
from zerorun.errors import RuntimeConfigError, StorageError
from zerorun.zero.offload import file_io, scratch


@pytest.fixture(autouse=True)
def _own_job(monkeypatch, tmp_path):
    """A job of its own per test (Note [scratch names]: the name comes from the run directory)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("ZERORUN_RUN_DIR", str(run_dir))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def _engine(nvme, *, buffers=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {
        "zero": {"stage": 2, "reduce_bucket_size": 272, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(nvme), "buffer_count": buffers, "buffer_size": 3 * 272}}})


def _step(engine):
    engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
    engine.step()


def _drain(engine):
    """Wait until the update worker, the reader and the writer have nothing left to run."""
    placement = engine.records[0].state_home
    for worker in (engine.updater._worker, placement._reader, placement._writer):
        worker.submit(lambda: None).result(timeout=60)


def _unit_files(nvme):
    return sorted(nvme.glob("zerorun-*-rank0/optim*/unit*.bin"))


@pytest.mark.parametrize("fault", ["truncate to 0", "truncate to half", "delete"])
def test_a_damaged_unit_file_is_one_error_line_and_every_buffer_comes_back(tmp_path, fault):
    nvme = tmp_path / "nvme"
    engine = _engine(nvme)
    _step(engine)
    engine.quiesce()
    files = _unit_files(nvme)
    assert len(files) >= 2
    size = files[0].stat().st_size
    if fault == "delete":
        files[0].unlink()
    else:
        os.truncate(files[0], 0 if fault == "truncate to 0" else size // 2)
    with pytest.raises(StorageError) as caught:
        _step(engine)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"rank 0: NVMe read of {str(files[0])!r} moved ")
    if fault == "delete":
        assert f"moved 0 of {size} bytes (No such file or directory)" in message
    else:
        kept = 0 if fault == "truncate to 0" else size // 2
        assert f"moved {kept} of {size} bytes (the file ends at {kept} bytes: truncated)" in message
    pool = engine.records[0].state_home.pool
    _drain(engine)  # the threads are not stuck
    assert pool.available == pool.count  # Note [pool on failure]
    with pytest.raises(StorageError):  # and nothing waits on it again
        pool.take()


def test_every_step_before_a_fault_trains_normally(tmp_path):
    engine = _engine(tmp_path / "nvme")
    for _ in range(3):
        _step(engine)
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())


def test_eio_and_short_reads_are_reported_with_the_bytes_moved(tmp_path, monkeypatch):
    path = tmp_path / "unit0.bin"
    path.write_bytes(bytes(1000))
    target = memoryview(bytearray(1000))
    calls = []

    def short_then_eio(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:
            return 300  # a short read: the loop must go on, not stop
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(file_io.os, "preadv", short_then_eio)
    with pytest.raises(StorageError, match=r"^rank 3: NVMe read of .*unit0.bin' moved 300 of 1000 bytes \(Input/output error\)$"):
        file_io.read_exactly(path, target, rank=3)
    assert calls == [0, 300]


def test_a_full_disk_stops_a_write_with_the_bytes_written(tmp_path, monkeypatch):
    path = tmp_path / "unit0.bin"
    path.write_bytes(bytes(1000))
    moved = []

    def then_enospc(fd, buffers, offset):
        if moved:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        moved.append(offset)
        return 512

    monkeypatch.setattr(file_io.os, "pwritev", then_enospc)
    with pytest.raises(StorageError, match=r"moved 512 of 1000 bytes \(No space left on device\)$"):
        file_io.write_exactly(path, memoryview(bytes(1000)), rank=0)


def test_a_write_failure_ends_the_pool_and_the_next_read_says_why(tmp_path, monkeypatch):
    nvme = tmp_path / "nvme"
    engine = _engine(nvme)
    _step(engine)
    engine.quiesce()

    def enospc(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(file_io.os, "pwritev", enospc)
    with pytest.raises(StorageError, match=r"NVMe write of .* \(No space left on device\)"):
        for _ in range(3):
            _step(engine)
            engine.quiesce()
    pool = engine.records[0].state_home.pool
    _drain(engine)
    assert pool.available == pool.count


_HOLDER = r"""
import os, sys, time
from zerorun.zero.offload import scratch
directory = scratch.placement_directory(sys.argv[1], 0, "optim", "zero.offload_optimizer.nvme_path")
(directory / "unit0.bin").write_bytes(bytes(4096))
print(directory, flush=True)
if sys.argv[2] == "die":
    os._exit(0)  # like SIGKILL: no atexit, no finalizer; the kernel drops the lock
sys.stdin.read()  # alive until the test closes stdin
"""


def _holder(nvme, how, env):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(nvme), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    return proc, Path(proc.stdout.readline().strip())


def test_two_processes_of_one_slurm_job_never_remove_each_others_scratch(tmp_path, monkeypatch):
    """Two job steps of one allocation, one nvme_path."""
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    nvme = tmp_path / "nvme"
    other, theirs = _holder(nvme, "live", {**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert (theirs / "unit0.bin").is_file()
        engine = _engine(nvme)
        mine = engine.records[0].state_home.directory
        assert mine.parent != theirs.parent and mine.parent.name.startswith("zerorun-slurm4243-")
        assert (theirs / "unit0.bin").stat().st_size == 4096, "the live job's scratch was removed"
        del engine
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert scratch.sweep_dead(nvme) == [str(theirs.parent)]  # once its process is gone


def test_a_dead_processs_scratch_is_removed_by_the_next_start_and_a_live_ones_kept(tmp_path):
    nvme = tmp_path / "nvme"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    dead, left = _holder(nvme, "die", env)
    dead.wait(timeout=60)
    assert (left / "unit0.bin").is_file()
    (nvme / "zerorun-notours-rank0").mkdir()  # not named like ours: never touched
    engine = _engine(nvme)
    assert not left.parent.exists()
    assert (nvme / "zerorun-notours-rank0").is_dir()
    mine = engine.records[0].state_home.directory.parent
    assert mine.name == scratch.rank_directory(nvme, 0).name
    second = _engine(nvme)  # a second engine of the process keeps its own files, beside the first's
    assert engine.records[0].state_home.directory != second.records[0].state_home.directory
    assert engine.records[0].state_home.directory.exists()
    recorded = (tmp_path / "run" / "scratch" / "rank0").read_text().strip()
    assert recorded == str(mine)
    del engine, second
    lone = scratch.placement_directory(str(nvme), 5, "optim", "key")
    scratch.remove_if_empty(lone.parent)
    assert lone.parent.exists()  # a placement still uses it
    lone.rmdir()
    scratch.remove_if_empty(lone.parent)  # the last placement takes the directory and its lock file
    assert not lone.parent.exists() and lone.parent not in scratch._held


_SWEEPER = r"""
import sys
from pathlib import Path
from zerorun.zero.offload import scratch
print(len(scratch.sweep_dead(Path(sys.argv[1]))), flush=True)
"""


def test_a_sweep_while_another_rank_makes_its_directory_leaves_it_alone(tmp_path, monkeypatch):
    """Two ranks of one host start together: one sweeps while the other has made its lock file
    and not yet locked it (CI on bec512c failed this way: "is not writable (No such file or
    directory)"). The sweep runs in a second process, at that instant, every time."""
    import fcntl
    import subprocess
    import sys
    import types

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    swept = []

    def lockf_after_a_sweep(fd, flags):
        swept.append(subprocess.run([sys.executable, "-c", _SWEEPER, str(nvme)], capture_output=True,
                                    text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True).stdout)
        return fcntl.lockf(fd, flags)

    monkeypatch.setattr(scratch, "fcntl", types.SimpleNamespace(lockf=lockf_after_a_sweep, LOCK_EX=fcntl.LOCK_EX,
                                                                LOCK_NB=fcntl.LOCK_NB))
    directory = scratch.placement_directory(str(nvme), 7, "optim", "zero.offload_optimizer.nvme_path")
    assert swept == ["0\n"], "the sweep removed a directory being made"
    assert directory.is_dir() and (directory.parent / scratch.LOCK_FILE).is_file()
    monkeypatch.undo()
    directory.rmdir()
    scratch.remove_if_empty(directory.parent)
    assert not directory.parent.exists()


def test_job_keys():
    assert scratch.job_key({"SLURM_JOB_ID": "4242"}) == "slurm4242"
    assert scratch.job_key({"SLURM_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm4242a3"
    assert scratch.job_key({"ZERORUN_RUN_DIR": "/a/b"}) == scratch.job_key({"ZERORUN_RUN_DIR": "/a/b"})
    assert scratch.job_key({"ZERORUN_RUN_DIR": "/a/b"}) != scratch.job_key({"ZERORUN_RUN_DIR": "/a/c"})
    assert scratch.job_key({"SLURM_JOB_ID": "../x"}).startswith("pid")  # never a path


def test_the_launcher_sweep_removes_recorded_scratch_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    records = run_dir / "scratch"
    records.mkdir(parents=True)
    ours = tmp_path / "nvme" / "zerorun-run0123abcd-0badcafe-rank1"
    (ours / "optim0").mkdir(parents=True)
    precious = tmp_path / "precious"
    precious.mkdir()
    (ours / ".lock").touch()  # every scratch directory of ours has one (Note [scratch names])
    (records / "rank1").write_text(str(ours) + "\n")
    (records / "rank2").write_text(str(precious) + "\n")  # a record that names something else
    assert scratch.sweep_recorded(run_dir) == [str(ours)]
    assert not ours.exists() and precious.exists()
    assert not any(records.iterdir())


def test_free_space_is_checked_per_file_system_for_every_local_rank(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 0, 8 << 10))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeConfigError) as caught:
        _engine(tmp_path / "nvme")
    message = str(caught.value)
    assert "its file system has 8.0 KiB free" in message and "the 2 rank(s) of this host need" in message
    assert "0.0 GiB" not in message


def test_human_bytes():
    assert scratch.human_bytes(512) == "512 bytes"
    assert scratch.human_bytes(300 << 10) == "300.0 KiB"
    assert scratch.human_bytes(3 << 30) == "3.0 GiB"


def test_an_nvme_path_whose_parent_is_missing_is_refused_and_the_last_component_is_created(tmp_path, monkeypatch,
                                                                                            capsys):
    """A mistyped mount point is refused, not created as a chain of directories on the root disk;
    run by hand (no launcher to say it before start), creating the last component is said once."""
    monkeypatch.delenv("ZERORUN_RUN_DIR")
    mistyped = tmp_path / "mnt" / "nvme"
    assert "neither does its parent" in scratch.nvme_path_problem(mistyped)
    with pytest.raises(RuntimeConfigError, match="a mistyped mount point"):
        _engine(mistyped)
    assert not (tmp_path / "mnt").exists()
    fresh = tmp_path / "nvme"
    assert scratch.nvme_path_problem(fresh) is None
    engine = _engine(fresh)
    assert engine.records[0].state_home.directory.parent.parent == fresh
    said = [line for line in capsys.readouterr().err.splitlines() if "created" in line]
    assert said == [f"zerorun: note: zero.offload_optimizer.nvme_path: created {fresh} (its parent exists)"]
    del engine
