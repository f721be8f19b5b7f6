"""pytest tests/e2e/test_nvme_faults.py — a damaged NVMe scratch file under the real launcher.

Two CPU ranks train a tiny model with optimizer state in files. After step 3 rank 0 truncates
or deletes one of its unit files, as a full disk or a cleanup job would, and training goes on.
Before, a truncated file trained on silently (exit 0, loss NaN) and a deleted one hung
both ranks until the hang timeout. Now the job must end within 10 s of the fault with exit 1
and the error line naming the rank, the file and the bytes moved; what the ranks left in the
scratch directory is recorded for the launcher's sweep.
"""

from __future__ import annotations

import os
import time

import pytest
from launch_helpers import job_processes, run_cli

pytestmark = pytest.mark.slow

SCRIPT = r'''
import math, os, sys, time, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {
    "stage": 2, "reduce_bucket_size": 272,
    "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[2], "buffer_count": 2, "buffer_size": 816}}})
for step in range(40):
    if step == 3 and engine.rank == 0:
        engine.quiesce()
        victim = sorted(engine.records[0].state_home.directory.glob("unit*.bin"))[0]
        # The time first: once the file is damaged, rank 0 may be ended before its next line.
        with open(os.path.join(os.environ["ZERORUN_RUN_DIR"], "fault_at"), "w") as f:
            f.write(repr(time.time()))
        if sys.argv[1] == "delete":
            victim.unlink()
        else:
            os.truncate(victim, 0)
    loss = engine(torch.randn(4, 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if not math.isfinite(loss.item()):
        print("NaN loss at step", step, flush=True)
    time.sleep(0.05)
print("rank", engine.rank, "finished", flush=True)
'''


@pytest.mark.parametrize("fault", ["truncate", "delete"])
def test_a_damaged_scratch_file_ends_the_job_in_seconds_with_one_line(tmp_path, fault):
    (tmp_path / "job.py").write_text(SCRIPT)
    run_dir, nvme = tmp_path / "run", tmp_path / "nvme"
    done = run_cli(["--nproc", "2", "--no-dashboard", "--hang-timeout", "120", "--run-dir", str(run_dir),
                    "job.py", fault, str(nvme)], tmp_path, timeout=180)
    ended = time.time()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    took = ended - float((run_dir / "fault_at").read_text())
    print(f"{fault}: the job ended {took:.1f} s after the fault")
    assert took < 10, f"the job took {took:.1f} s to end after the fault"
    why = "the file ends at 0 bytes: truncated" if fault == "truncate" else "No such file or directory"
    lines = [line for line in done.stderr.splitlines() if "zerorun: error: rank 0: NVMe read of" in line]
    assert lines and lines[-1].rstrip().endswith(f"({why})"), done.stderr[-3000:]
    print(done.stderr.strip().splitlines()[-1])
    assert "optim0/unit" in lines[-1] and " moved 0 of " in lines[-1]
    assert "NaN loss" not in (run_dir / "logs" / "rank0.log").read_text()
    assert not job_processes(run_dir)
    # Rank 0 died of the exception and removed its files; rank 1, stopped by the launcher,
    # could not: its agent removed what it recorded once the workers had exited.
    assert not list(nvme.glob("zerorun-*")), list(nvme.glob("zerorun-*/*"))
    assert not list((run_dir / "scratch").rglob("rank*"))


PARAM_SCRIPT = r'''
import os, sys, time, torch, zerorun
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {
    "stage": 3, "allgather_bucket_size": 100, "offload_param": {"device": "nvme", "nvme_path": sys.argv[1]}}})
for step in range(40):
    if step == 3 and engine.rank == 0:
        engine.quiesce()
        os.truncate(sorted(engine.records[0].param_home.directory.glob("unit*.bin"))[0], 0)
    engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
    engine.step()
    time.sleep(0.05)
print("rank", engine.rank, "finished", flush=True)
'''


def test_a_truncated_parameter_file_is_named_before_it_can_be_a_bus_error(tmp_path):
    """NVMe parameter chunks are memory-mapped (Note [host shards]): reading a page past a
    truncated end is a SIGBUS, which named no file (the 1 partial probe of issue 31). Each
    gather now checks the file's size first: one line naming the rank, the file and the bytes."""
    (tmp_path / "job.py").write_text(PARAM_SCRIPT)
    run_dir = tmp_path / "run"
    done = run_cli(["--nproc", "2", "--no-dashboard", "--hang-timeout", "120", "--run-dir", str(run_dir),
                    "job.py", str(tmp_path / "nvme")], tmp_path, timeout=180)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "zerorun: error: rank 0: NVMe read of" in line]
    assert lines and "params" in lines[-1] and "/unit" in lines[-1], done.stderr[-3000:]
    assert lines[-1].rstrip().endswith("(the file ends at 0 bytes: truncated while memory-mapped)"), lines[-1]
    assert "SIGBUS" not in done.stderr
    assert "finished" not in done.stdout
    assert not job_processes(run_dir)


SHARED_SCRIPT = r'''
import os, sys, time, torch, zerorun
nvme, role, sync = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero": {
    "stage": 3, "allgather_bucket_size": 100,
    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "buffer_size": 816},
    "offload_param": {"device": "nvme", "nvme_path": nvme}}})
data = torch.Generator().manual_seed(engine.rank)
if role == "second":
    open(os.path.join(sync, "second_started"), "w").close()
for step in range(8):
    if step == 3 and role == "first":
        open(os.path.join(sync, "first_ready"), "w").close()
        deadline = time.time() + 300
        while not os.path.exists(os.path.join(sync, "second_started")) and time.time() < deadline:
            time.sleep(0.1)
    loss = engine(torch.randn(4, 16, generator=data)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    if engine.rank == 0:
        print("loss", step, repr(loss.item()), flush=True)
'''


def _losses(done, run_dir) -> list[float]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    return [float(line.split()[2]) for line in log.splitlines() if line.startswith("loss ")]


@pytest.mark.long
def test_two_jobs_of_one_slurm_allocation_on_one_nvme_path_both_finish_with_their_solo_losses(tmp_path):
    """Scratch was named by SLURM_JOB_ID and rank only, so the second job's
    start removed the first's live files and the first died. Now each launch has its own."""
    from launch_helpers import start_cli, wait_for_files

    (tmp_path / "job.py").write_text(SHARED_SCRIPT)
    nvme, sync = tmp_path / "nvme", tmp_path / "sync"
    sync.mkdir()
    env = {"SLURM_JOB_ID": "4243"}
    common = ["--launcher", "local", "--nproc", "2", "--no-dashboard", "--hang-timeout", "300"]
    solo = _losses(run_cli([*common, "--run-dir", str(tmp_path / "solo"), "job.py", str(nvme), "solo", str(sync)],
                           tmp_path, timeout=300, env=env), tmp_path / "solo")
    assert len(solo) == 8
    first = start_cli([*common, "--run-dir", str(tmp_path / "a"), "job.py", str(nvme), "first", str(sync)], tmp_path,
                      env=env)
    try:
        wait_for_files([sync / "first_ready"], timeout=300, proc=first)
        second = run_cli([*common, "--run-dir", str(tmp_path / "b"), "job.py", str(nvme), "second", str(sync)],
                         tmp_path, timeout=300, env=env)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, 9)
            first.wait()
    done_first = type(second)(first.args, first.returncode, out, err)
    assert _losses(done_first, tmp_path / "a") == pytest.approx(solo, rel=1e-6, abs=1e-7)
    assert _losses(second, tmp_path / "b") == pytest.approx(solo, rel=1e-6, abs=1e-7)
    assert not list(nvme.glob("zerorun-*")), list(nvme.glob("zerorun-*/*"))  # each removed its own
