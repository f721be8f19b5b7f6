"""pytest -m slurm tests/e2e/test_slurm_preemption.py (long) — a preempted zerorun job loses nothing.

The private cluster of slurm_cluster.py, set up to preempt (Note [preempting cluster]: partitions
low and high, preempt/partition_prio, PreemptMode=REQUEUE, GraceTime on low). A 2-node zerorun
job of slurm_train.py runs in low; once it has trained a few steps a job in high takes both
nodes. With a grace time, Slurm SIGTERMs the agent steps (not the batch script); the launcher
asks Slurm why (Note [why Slurm sent SIGTERM]), every rank saves on the spot, the job is
requeued and resumes, and every step's loss and the final parameters are bit-identical to an
uninterrupted local run. With GraceTime 0 Slurm requeues at once and the job resumes from its
last interval checkpoint, each step counted once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, slurm_available
from test_slurm_jobs import BIN, TRAIN, final_state, job_env, sbatch, wait_for, wait_job, zerorun_cmd

from launch_helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.long]

STEPS = 30


def start_cluster(tmp: Path, grace_time: int) -> SlurmCluster:
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    return SlurmCluster(tmp / "slurm", grace_time=grace_time).start()


def reference_run(tmp: Path) -> tuple[dict, dict]:
    out = tmp / "reference"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([str(BIN / "zerorun"), "--no-dashboard", "--launcher", "local", "--nproc", "2",
                           str(TRAIN), str(STEPS), str(out)], cwd=out, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "losses.json").read_text()), json.loads((out / "world.json").read_text())


def preempt_and_finish(cluster: SlurmCluster, tmp: Path, config: str, after_steps: int = 8) -> tuple[str, str]:
    """Run the low job, preempt it after ``after_steps`` steps (0: as soon as Slurm runs it, before
    the launcher has started its steps), let it resume and end; (job id, its log)."""
    out = tmp / "job"
    out.mkdir()
    (out / "zerorun.yaml").write_text(config)
    (out / "ckpt").mkdir()
    job = sbatch(cluster, out, "exec " + zerorun_cmd("--config", "zerorun.yaml", str(TRAIN), str(STEPS), str(out),
                                                     "0.5"),
                 "-N2", "--ntasks-per-node=1", "--exclusive", "--requeue", "--open-mode=append")
    log = out / f"slurm-{job}.out"
    if after_steps:
        wait_for(lambda: (out / "losses.json").exists()
                 and len(json.loads((out / "losses.json").read_text())) >= after_steps, 180, f"{after_steps} steps")
    else:
        wait_for(lambda: cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip() == "RUNNING", 60,
                 "the job to run")
    high = cluster.run(["sbatch", "--parsable", "-p", "high", "-N2", "--exclusive", "-o", str(tmp / "high.out"),
                        "--wrap", "sleep 2"], cwd=tmp, env=job_env(cluster), timeout=30)
    assert high.returncode == 0, high.stderr
    preempted_at = time.monotonic()

    def started_again() -> bool:
        # Slurm holds a requeued job back (BeginTime); start it once the high job is done.
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if state == "PENDING" and time.monotonic() - preempted_at > 10:
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        return final_state(cluster, job) is not None or (log.exists() and "resumed from" in log.read_text()) or (
            log.exists() and log.read_text().count("zerorun: run directory") >= 3)  # a second start

    try:
        wait_for(started_again, 240, "the preempted job to resume")
        state = wait_job(cluster, job, timeout_s=240)
    except AssertionError as err:
        record = cluster.run(["scontrol", "-o", "show", "job", job]).stdout
        raise AssertionError(f"{err}\n{record}\n{log.read_text()[-4000:] if log.exists() else ''}") from None
    text = log.read_text()
    assert state == "COMPLETED", text[-4000:]
    return job, text


def preempted_and_resumed(tmp: Path, grace_time: int, config: str, after_steps: int = 8):
    """The reference run, then a cluster with ``grace_time`` and ``preempt_and_finish`` on it:
    (job id, its log, the log of its first start, the reference)."""
    reference = reference_run(tmp)
    cluster = start_cluster(tmp, grace_time=grace_time)
    try:
        job, log = preempt_and_finish(cluster, tmp, config, after_steps)
    finally:
        cluster.stop()
    assert "resumed from" in log, log[-4000:]
    return job, log, log[:log.index("resumed from")], reference


def assert_bit_identical(out: Path, reference: tuple[dict, dict]) -> None:
    losses = json.loads((out / "losses.json").read_text())
    assert sorted(map(int, losses)) == list(range(STEPS))
    assert losses == reference[0]
    assert json.loads((out / "world.json").read_text())["params"] == reference[1]["params"]


def test_preempted_with_a_grace_time_saves_requeues_and_resumes_bit_exactly(tmp_path):
    job, log, first_run, reference = preempted_and_resumed(
        tmp_path, 30, "zero: {stage: 2}\ncheckpoint: {dir: ckpt, on_signal: true, requeue: true, resume: true}\n")
    # Note [preemption grace]: the start says how long a save on preemption may take.
    assert "Slurm: partition low preempts with a 30 s grace time" in first_run, first_run[-3000:]
    closing = [line for line in first_run.splitlines() if line.startswith("zerorun: preempted")]
    assert closing and closing[-1].startswith("zerorun: preempted (SIGTERM): every rank saved a checkpoint and stopped"), \
        first_run[-3000:]
    assert f"job {job} requeued" in closing[-1]
    # No interval saves: the one checkpoint is the save on the signal, mid-way.
    saved = int((tmp_path / "job" / "ckpt" / "latest").read_text().strip().removeprefix("global_step"))
    assert 8 <= saved < STEPS
    assert_bit_identical(tmp_path / "job", reference)
    runs = list((tmp_path / "job" / "zerorun-runs").iterdir())
    assert [run.name for run in runs] == [f"slurm-{job}"]  # the requeued start continued it


def test_preempted_without_a_grace_time_resumes_from_the_interval_checkpoint(tmp_path):
    job, log, first_run, reference = preempted_and_resumed(
        tmp_path, 0,
        "zero: {stage: 2}\ncheckpoint: {dir: ckpt, interval_steps: 5, on_signal: true, requeue: true, resume: true}\n")
    assert "grace time" not in first_run  # GraceTime=0: no grace to fit a save in, so none is named
    assert "zerorun: preempted or requeued (SIGTERM; Slurm requeued the job)" in first_run, first_run[-3000:]
    resumed = log[log.index("resumed from"):].splitlines()[0]
    assert "/global_step5 " in resumed or "/global_step10 " in resumed or "/global_step15 " in resumed, resumed
    assert_bit_identical(tmp_path / "job", reference)


def test_preempted_before_the_steps_exist_is_requeued_with_what_it_had_and_ends_bit_exactly(tmp_path):
    """Issue 39, Note [a preemption before the steps] (launch/supervisor.py): preempted while the
    launcher starts, the job trained through the grace (no agent step existed to get Slurm's
    SIGTERM) and restarted from step 0. Now either the launcher got the SIGTERM itself before any
    worker started (nothing started; requeued), or it finds the preemption in the job's record
    once every rank has joined (every rank saves at its first step; requeued and resumed), or the
    grace runs out before a rank made a step (requeued with nothing saved); each
    way the job ends at step 30, each step's loss bit-identical to an uninterrupted run."""
    reference = reference_run(tmp_path)
    cluster = start_cluster(tmp_path, grace_time=60)
    try:
        job, log = preempt_and_finish(
            cluster, tmp_path, "zero: {stage: 2}\ncheckpoint: {dir: ckpt, on_signal: true, requeue: true, resume: true}\n",
            after_steps=0)
    finally:
        cluster.stop()
    assert f"job {job} requeued" in log, log[-4000:]
    first_run = log[:log.index(f"job {job} requeued")]
    if "nothing was started" in first_run:
        assert "zerorun: preempted (SIGTERM) before any worker started; nothing was started; job" in first_run
    elif "nothing was saved on the signal" in first_run:
        # Preempted while the batch script started, the launcher came up late in the grace: its
        # ranks had not made a step when Slurm's grace ran out, so the job was requeued with
        # nothing saved and starts again from step 0 (seen on a loaded machine).
        assert "SIGTERM: the ranks have not all made a step yet" in first_run, first_run[-3000:]
        assert not (tmp_path / "job" / "ckpt" / "latest").exists()
    else:
        assert "Slurm preempted the job before its steps started" in first_run, first_run[-3000:]
        closing = [line for line in first_run.splitlines() if line.startswith("zerorun: preempted")]
        assert closing[-1].startswith("zerorun: preempted (SIGTERM): every rank saved a checkpoint and stopped"), \
            first_run[-3000:]
        saved = int((tmp_path / "job" / "ckpt" / "latest").read_text().strip().removeprefix("global_step"))
        assert 1 <= saved < 8, saved  # at the first steps, not trained through the grace
    assert_bit_identical(tmp_path / "job", reference)
