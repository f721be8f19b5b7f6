"""pytest tests/e2e/test_launch.py — the real ``zerorun`` CLI launching local CPU workers.

Each test starts the CLI as a subprocess, exactly as a user would. Failure tests use workers
that do not import torch, so a spawn costs well under a second.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from launch_helpers import (
    FAILER,
    assert_no_job_processes,
    job_processes,
    kill_group,
    run_cli,
    start_cli,
    wait_for_files,
)

pytestmark = pytest.mark.slow

TRAIN = r'''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(7, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
for step in range(3):
    x = torch.randn(4, 7, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad); p.grad /= world
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(gathered[0], t) for t in gathered), "ranks diverged"
assert os.path.exists(os.environ["ZERORUN_CONFIG"])
from zerorun.telemetry import get_recorder
assert get_recorder().writer.fd > 2  # the launcher's pipe, taken out of the environment at boot
print("ARGS " + repr(sys.argv[1:]) + f" rank={rank} local={os.environ['LOCAL_RANK']} world={world}", flush=True)
import zerorun
zerorun.leave_together()  # barrier, then destroy without gloo's exit abort (Note [clean exit])
'''


def test_two_cpu_workers_train_to_completion(tmp_path):
    (tmp_path / "train_job.py").write_text(TRAIN)
    run_dir = tmp_path / "run"
    args = ["--lr", "3e-4", "a b", "it's", "$(echo no)"]
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "train_job.py", *args], tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "step 2 loss" in log
        assert f"ARGS {args!r} rank={rank} local={rank} world=2" in log
    assert json.loads((run_dir / "config.json").read_text())["zero"]["stage"] == 0
    assert "[rank1] step 0 loss" in done.stdout or "step 0 loss" in done.stdout


def test_module_mode_and_dry_run(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hello.py").write_text("import os, sys\nprint('hello from', os.environ['RANK'], sys.argv[1:])\n")
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(tmp_path / "r"), "-m", "mypkg.hello", "--x", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hello from 1 ['--x', '1']" in (tmp_path / "r" / "logs" / "rank1.log").read_text()

    dry = run_cli(["--nproc", "2", "--dry-run", "--run-dir", str(tmp_path / "dry"), "-m", "mypkg.hello"], tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "world size 2 on 1 host(s)" in dry.stdout
    assert "rank 1 (local 1):" in dry.stdout and "-m mypkg.hello" in dry.stdout
    assert "ZERORUN_RUN_TOKEN=***" in dry.stdout
    assert not (tmp_path / "dry").exists()  # dry run starts and writes nothing


@pytest.mark.parametrize("mode", ["exit3", "raise"])
def test_failing_worker_ends_job_with_root_cause(tmp_path, mode):
    (tmp_path / "failer.py").write_text(FAILER)
    run_dir = tmp_path / "run"
    proc = start_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "failer.py", mode, "1"], tmp_path)
    try:
        out, err = proc.communicate(timeout=60)
        ended = time.time()
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    failed_at = float((run_dir / "failed_at").read_text())
    assert ended - failed_at < 5.0, f"job took {ended - failed_at:.1f} s to end"
    assert "first failure: rank 1 on host localhost" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("zerorun: error: rank 1 on host localhost failed:")
    if mode == "exit3":
        assert "exit code 3" in last and "  | giving up now" in err
    else:
        assert "traceback:" in err and "ValueError: bad batch in rank 1" in err
        assert 'failer.py", line' in err
    # Rank 1 wrote its pid before failing; on a busy machine rank 0 may be stopped before it got
    # that far, and the scan of the run's processes covers it either way.
    pids = [int(path.read_text()) for path in (run_dir / "pid0", run_dir / "pid1") if path.exists()]
    assert pids, "rank 1 writes its pid before it fails"
    assert_no_job_processes(run_dir, pids)


def test_sigkilled_worker_ends_job_within_5s(tmp_path):
    (tmp_path / "failer.py").write_text(FAILER)
    run_dir = tmp_path / "run"
    proc = start_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "failer.py", "sleep", "-1"], tmp_path)
    try:
        wait_for_files([run_dir / "pid0", run_dir / "pid1"], proc=proc)
        victim = int((run_dir / "pid1").read_text())
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        assert time.time() - killed < 5.0
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    assert "rank 1 on host localhost failed: signal SIGKILL" in err
    assert_no_job_processes(run_dir, [victim, int((run_dir / "pid0").read_text())])


def test_sigint_to_launcher_stops_everything(tmp_path):
    (tmp_path / "failer.py").write_text(FAILER)
    run_dir = tmp_path / "run"
    proc = start_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "failer.py", "sleep", "-1"], tmp_path)
    try:
        wait_for_files([run_dir / "pid0", run_dir / "pid1"], proc=proc)
        # The process scan used after teardown does see this job's workers while they run.
        assert len(job_processes(run_dir)) >= 2
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert time.time() - sent < 5.0
    finally:
        kill_group(proc)
    assert proc.returncode == 130
    assert "interrupted" in err
    assert_no_job_processes(run_dir, [int((run_dir / f"pid{r}").read_text()) for r in (0, 1)])


def _one_line_error(done, fragment):
    assert done.returncode != 0
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("zerorun: hint:")]
    assert lines == [lines[0]] and lines[0].startswith("zerorun: error: "), done.stderr
    assert fragment in lines[0]
    assert "Traceback" not in done.stderr + done.stdout


def test_bad_inputs_get_one_clear_line(tmp_path):
    (tmp_path / "ok.py").write_text("print('never runs')\n")
    (tmp_path / "hosts").write_text("node-a slots=2\nnode-b slots=two\n")
    _one_line_error(run_cli(["--nproc", "2", "missing.py"], tmp_path), "script missing.py not found")
    _one_line_error(run_cli(["--hostfile", "hosts", "ok.py"], tmp_path), "hosts line 2: slots must be a positive integer")
    _one_line_error(
        run_cli(["--gpus", "2", "ok.py"], tmp_path, env={"CUDA_VISIBLE_DEVICES": ""}),
        "--gpus 2 asks for 2 GPU(s) but this machine has 0 visible",
    )
    _one_line_error(run_cli(["--include", "localhost:5", "ok.py"], tmp_path), "slot 5 of 'localhost' does not exist")
    _one_line_error(run_cli(["--nproc", "2"], tmp_path), "no script given")
    assert not (tmp_path / "zerorun-runs").exists()


def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: the agent's stdin EOF must do it."""
    (tmp_path / "failer.py").write_text(FAILER)
    run_dir = tmp_path / "run"
    proc = start_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "failer.py", "sleep", "-1"], tmp_path)
    try:
        wait_for_files([run_dir / "pid0", run_dir / "pid1"], proc=proc)
        pids = [int((run_dir / f"pid{r}").read_text()) for r in (0, 1)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert_no_job_processes(run_dir, pids, within_s=5.0)
    finally:
        kill_group(proc)


def test_grandchildren_left_behind_are_ended_and_do_not_hang_the_job(tmp_path):
    """A worker that exits 0 but leaves a child holding its pipes: the job still ends, child included."""
    (tmp_path / "leaver.py").write_text(
        "import os, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "open(os.path.join(os.environ['ZERORUN_RUN_DIR'], 'child' + os.environ['RANK']), 'w').write(str(child.pid))\n"
        "print('leaving a child behind', flush=True)\n"
    )
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = run_cli(["--nproc", "2", "--no-dashboard", "--run-dir", str(run_dir), "leaver.py"], tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert_no_job_processes(run_dir, [int((run_dir / f"child{r}").read_text()) for r in (0, 1)])
