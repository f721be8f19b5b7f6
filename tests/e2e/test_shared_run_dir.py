"""pytest tests/e2e/test_shared_run_dir.py — two launches, one run directory (issue 38 item 1).

Two CPU ranks train a tiny model with optimizer state in NVMe scratch files; rank 0 holds after
step 2 until a "go" file appears, so a second launch can be tried while the first is alive.
Before, the second launch shared the run directory: it overwrote the first's scratch records,
logs, config.json and plan.json, and whichever ended first removed the other's live scratch
files. Now (Note [one launch per run directory] in zerorun/launch/run_dir.py):

- the same explicit ``--run-dir``: the second launch is refused in one line before any worker
  starts, and the first finishes with the losses of a launch alone;
- a requeued Slurm job (SLURM_JOB_ID, SLURM_RESTART_COUNT=1; no real Slurm needed: both continue
  ``zerorun-runs/slurm-JOB``): the second start waits for the first to end, then continues the
  directory; both finish with the losses of a launch alone, and no scratch is left.
"""

from __future__ import annotations

import json
import time

import pytest
from launch_helpers import kill_group, run_cli, start_cli, wait_for_files

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, sys, time, torch, zerorun
out, go, nvme = sys.argv[1], sys.argv[2], sys.argv[3]
started = time.time()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"zero": {
    "stage": 2, "reduce_bucket_size": 272,
    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2, "buffer_size": 816}}})
losses = []
for step in range(6):
    if step == 2 and engine.rank == 0:
        open(out + ".holding", "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
    data = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + engine.rank))
    loss = engine(data).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if engine.rank == 0:
    with open(out, "w") as f:
        json.dump({"losses": losses, "started": started, "ended": time.time(),
                   "run_dir": os.environ["ZERORUN_RUN_DIR"]}, f)
'''

ARGS = ["--nproc", "2", "--no-dashboard", "--hang-timeout", "300"]


def _launch(tmp_path, name, go, *, run_dir=None, env=None):
    run = ["--run-dir", str(run_dir)] if run_dir else []
    return start_cli([*ARGS, *run, "job.py", str(tmp_path / name), str(go), str(tmp_path / "nvme")], tmp_path, env=env)


def _finished(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return err


def _line_with(proc, text, timeout):
    """The first line of ``proc``'s stderr holding ``text`` (read on a thread: readline blocks)."""
    import threading

    found: list[str] = []

    def read():
        for line in proc.stderr:
            if text in line:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, f"no line with {text!r} within {timeout} s"
    return found[0]


def _solo(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "go-now").touch()
    done = run_cli([*ARGS, "--run-dir", str(tmp_path / "solo-run"), "job.py", str(tmp_path / "solo"),
                    str(tmp_path / "go-now"), str(tmp_path / "nvme")], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "solo").read_text())["losses"]


def test_a_second_launch_with_the_same_run_dir_is_refused_before_start(tmp_path):
    solo = _solo(tmp_path)
    run_dir = tmp_path / "shared"
    first = _launch(tmp_path, "first", tmp_path / "go", run_dir=run_dir)
    try:
        wait_for_files([tmp_path / "first.holding"], timeout=240, proc=first)
        config_before = (run_dir / "config.json").read_bytes()
        second = run_cli([*ARGS, "--run-dir", str(run_dir), "job.py", str(tmp_path / "second"),
                          str(tmp_path / "go-now"), str(tmp_path / "nvme")], tmp_path, timeout=120)
        assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("zerorun: error:")]
        assert len(errors) == 1 and f"run directory {run_dir} is in use by launch " in errors[0], second.stderr
        assert not (tmp_path / "second").exists() and not (tmp_path / "second.holding").exists()  # no worker ran
        assert (run_dir / "config.json").read_bytes() == config_before
        (tmp_path / "go").touch()
        _finished(first)
    finally:
        kill_group(first)
    assert json.loads((tmp_path / "first").read_text())["losses"] == solo
    assert not list((tmp_path / "nvme").glob("zerorun-*"))


def test_a_requeued_slurm_start_continues_the_run_dir_only_after_the_previous_start_ended(tmp_path):
    solo = _solo(tmp_path)
    job = {"SLURM_JOB_ID": "4242"}
    first = _launch(tmp_path, "first", tmp_path / "go", env={**job, "SLURM_RESTART_COUNT": "0"})
    second = None
    try:
        wait_for_files([tmp_path / "first.holding"], timeout=240, proc=first)
        second = _launch(tmp_path, "second", tmp_path / "go-now", env={**job, "SLURM_RESTART_COUNT": "1"})
        waiting = _line_with(second, "this requeued start waits up to 60 s for it to end", timeout=180)
        assert "slurm-4242 is in use by launch " in waiting, waiting
        time.sleep(2)  # it keeps waiting: none of its workers starts
        assert second.poll() is None and not (tmp_path / "second.holding").exists()
        (tmp_path / "go").touch()
        _finished(first)
        err = _finished(second)
    finally:
        kill_group(first)
        if second is not None:
            kill_group(second)
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("first", "second"))
    assert a["losses"] == solo and b["losses"] == solo
    assert b["started"] > a["ended"], "the requeued start ran beside the previous one"
    assert a["run_dir"] == b["run_dir"] == str(tmp_path / "zerorun-runs" / "slurm-4242"), err
    assert not list((tmp_path / "nvme").glob("zerorun-*"))
    assert not list((tmp_path / "zerorun-runs" / "slurm-4242" / "scratch").rglob("rank*"))


@pytest.mark.parametrize("where", ["a-file", "/proc/self/ckpt", "held"])
def test_an_unusable_or_held_checkpoint_dir_is_refused_before_any_worker_starts(tmp_path, where):
    """Issue 38 item 4: these used to be refused only at the first save, after the steps before it."""
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "a-file").write_text("x")
    holder = None
    if where == "held":
        import os
        import subprocess
        import sys
        (tmp_path / "held").mkdir()
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                                   "from zerorun.zero.checkpoint import owner; owner.claim(Path(sys.argv[1]), 'slurm777'); "
                                   "print('held', flush=True); time.sleep(300)", str(tmp_path / "held")],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert holder.stdout.readline().strip() == "held"
    try:
        done = run_cli([*ARGS, "--run-dir", str(tmp_path / "run"), "--set", f"checkpoint.dir={where}",
                        "--set", "checkpoint.interval_steps=20", "job.py", str(tmp_path / "out"), str(tmp_path / "go"),
                        str(tmp_path / "nvme")], tmp_path, timeout=120)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerorun: error: checkpoint.dir")]
    assert len(errors) == 1, done.stderr
    assert ("is in use by job slurm777" if where == "held" else "checkpoint.dir: ") in errors[0]
    assert not (tmp_path / "out.holding").exists() and not (tmp_path / "run" / "logs").exists()  # no worker started
