"""pytest -m slurm tests/e2e/test_slurm_jobs.py (long: not in the default run) — zerorun on a real (private) Slurm cluster, no SSH.

A module fixture starts munged, slurmctld and two slurmd daemons (nodes n1 and n2, both this
host; slurm_cluster.py), and where slurmdbd and mariadb-server are installed a private mariadbd
and slurmdbd, so ``sacct`` works (the accounting test skips with the reason otherwise). No sshd is started: every node is reached by srun. The training job is
slurm_train.py (ZeRO-2, 2 ranks); its losses are compared with a local ``zerorun --nproc 2``
run of the same script, which sees the same batches.
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch_helpers import REPO, channel_files, channel_files_of
from slurm_cluster import NODES, SlurmCluster, slurm_available

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.long]  # a real Slurm

TRAIN = Path(__file__).with_name("slurm_train.py")
BIN = Path(sys.executable).parent
STEPS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    started = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield started
    started.stop()


def job_env(cluster: SlurmCluster) -> dict:
    env = cluster.env
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("ZERORUN_SSH_OPTS", None)
    return env


def zerorun_cmd(*args: str) -> str:
    return " ".join([str(BIN / "zerorun"), "--no-dashboard", *args])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses and final parameters of a local 2-rank run of slurm_train.py (no Slurm)."""
    out = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([str(BIN / "zerorun"), "--no-dashboard", "--launcher", "local", "--nproc", "2",
                           str(TRAIN), str(STEPS), str(out)], cwd=out, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / "losses.json").read_text()), json.loads((out / "world.json").read_text())


def assert_same_training(out: Path, reference) -> None:
    losses, world = json.loads((out / "losses.json").read_text()), json.loads((out / "world.json").read_text())
    assert world["world_size"] == 2 and world["nodes"] == ["n1", "n2"], world  # one rank per node
    assert losses == reference[0]  # bit-identical: same batches, same reduction order
    assert world["params"] == reference[1]["params"]


def test_salloc_two_nodes_trains_like_a_local_run(cluster, reference, tmp_path):
    done = cluster.run(["salloc", "-N2", "--quiet", *zerorun_cmd(str(TRAIN), str(STEPS), str(tmp_path)).split()],
                       cwd=tmp_path, env=job_env(cluster), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_training(tmp_path, reference)


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def final_state(cluster: SlurmCluster, job_id: str) -> str | None:
    """The job's state once it has ended for good (not requeued), from the jobcomp file; else None.

    A requeued job cancelled while it waits to start again leaves no jobcomp record of its own
    (the file's last line for it says PENDING, from the requeue), so then the controller's
    record, kept for MinJobAge after the end, says how it ended."""
    if cluster.run(["squeue", "-h", "-j", job_id]).stdout.strip():
        return None
    lines = cluster.jobcomp.read_text().splitlines() if cluster.jobcomp.exists() else []
    states = [line.split("JobState=")[1].split()[0] for line in lines if f"JobId={job_id} " in line]
    if states and states[-1] in FINAL_STATES:
        return states[-1]
    controller = cluster.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"]).stdout.split()
    return controller[-1] if controller and controller[-1] in FINAL_STATES and states else None


def wait_job(cluster: SlurmCluster, job_id: str, timeout_s: float = 120.0) -> str:
    return wait_for(lambda: final_state(cluster, job_id), timeout_s, f"job {job_id} to end")


def sbatch(cluster: SlurmCluster, cwd: Path, script: str, *options: str) -> str:
    path = cwd / "job.sh"
    path.write_text("#!/bin/bash\n" + script + "\n")
    done = cluster.run(["sbatch", "--parsable", "-o", str(cwd / "slurm-%j.out"), *options, str(path)],
                       cwd=cwd, env=job_env(cluster), timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_sbatch_two_nodes_trains_like_a_local_run(cluster, reference, tmp_path):
    job = sbatch(cluster, tmp_path, "exec " + zerorun_cmd(str(TRAIN), str(STEPS), str(tmp_path)), "-N2")
    state = wait_job(cluster, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-2000:]
    assert_same_training(tmp_path, reference)


def test_srun_one_launcher_per_node_and_srun_python_train_the_same(cluster, reference, tmp_path):
    launchers, plain = tmp_path / "launchers", tmp_path / "plain"
    launchers.mkdir(), plain.mkdir()
    done = cluster.run(["srun", "-N2", "--ntasks-per-node=1", *zerorun_cmd(str(TRAIN), str(STEPS), str(launchers)).split()],
                       cwd=launchers, env=job_env(cluster), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_training(launchers, reference)
    assert (launchers / "zerorun-runs").is_dir()
    done = cluster.run(["srun", "-N2", "-n2", str(BIN / "python"), str(TRAIN), str(STEPS), str(plain)],
                       cwd=plain, env=job_env(cluster), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_training(plain, reference)


def summary_rows(text: str) -> dict[int, list[str]]:
    """Rank -> the cells of its row in the end-of-run summary table printed in ``text``."""
    rows = {}
    for line in text.split("zerorun summary", 1)[1].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) > 3 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_srun_ntasks_per_node_1_node_0_shows_and_records_every_rank(cluster, tmp_path):
    """Note [one view under srun]: node 0's launcher prints the one summary, with every rank
    of every node, and its metrics.jsonl and ``zerorun report`` cover them; node 1's launcher
    prints its workers' lines and one line pointing at node 0's summary."""
    steps = 5
    # Wide enough for the table with a column per collective, whose cells must all be real too:
    # a rank that missed the engine's first broadcast read "-" there (Note [every collective counted]).
    done = cluster.run(["srun", "-N2", "--ntasks-per-node=1", *zerorun_cmd(str(TRAIN), str(steps), str(tmp_path)).split()],
                       cwd=tmp_path, env={**job_env(cluster), "COLUMNS": "200"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("zerorun summary") == 1, out  # node 0's only: node 1's would repeat it
    rows = summary_rows(out)
    assert sorted(rows) == [0, 1], out
    assert rows[0][1:3] == ["n1", str(steps)] and rows[1][1:3] == ["n2", str(steps)], rows
    assert "broadcast s" in out, out
    assert not any("?" in cell or cell == "-" for row in rows.values() for cell in row), str(rows)  # real figures
    assert out.count("job throughput:") == 1
    assert "zerorun: node 1: its rank 1 is in the job-wide summary in node 0's output (n1)" in out
    assert "no job-wide view" not in out and "may be missing" not in out
    run = tmp_path / "zerorun-runs"
    node0 = next(run.glob("slurm-*/node0"))
    records = [json.loads(line) for line in (node0 / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["host"], r["step"]) for r in records if r["kind"] == "step") == [
        (rank, host, step) for rank, host in ((0, "n1"), (1, "n2")) for step in range(1, steps + 1)]
    assert not (node0 / "job-view.json").exists()  # removed at the end
    report = subprocess.run([str(BIN / "zerorun"), "report", "--format", "terminal", str(node0)], capture_output=True,
                            text=True, timeout=60, env={**job_env(cluster), "COLUMNS": "120"})
    assert report.returncode == 0, report.stderr
    table = {int(words[0]): words[1:3] for words in map(str.split, report.stdout.splitlines())
             if len(words) > 3 and words[0].isdigit() and words[2].isdigit()}
    assert table == {0: ["n1", str(steps)], 1: ["n2", str(steps)]} and "2 ranks," in report.stdout, report.stdout
    assert live_workers(tmp_path) == []


def test_srun_ntasks_per_node_1_without_node_0_in_reach_keeps_the_per_node_views(cluster, tmp_path):
    """A node that cannot reach node 0's view (here: each node's run directory elsewhere, as on
    a filesystem the nodes do not share) trains on, prints one line saying so and its own
    summary; node 0's summary names the node it lacks. Nothing waits longer than a few seconds."""
    runs = tmp_path / "runs"
    command = zerorun_cmd("--run-dir", f"{runs}/base-$SLURM_NODEID", str(TRAIN), str(STEPS), str(tmp_path))
    started = time.monotonic()
    done = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "bash", "-c", f"exec {command}"], cwd=tmp_path,
                       env=job_env(cluster), timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert len(json.loads((tmp_path / "losses.json").read_text())) == STEPS
    assert out.count("node 1: no job-wide view on node 0 (") == 1, out
    assert "base-1/node0/job-view.json did not appear" in out and "this node shows its own rank 1" in out
    assert "node 1 (n2): it did not connect, so its rank 1 may be missing here" in out
    assert out.count("zerorun summary") == 2 and "job-wide summary" not in out  # each node its own, as before
    assert not list(runs.glob("*/node0/job-view.json"))
    assert elapsed < 60, elapsed  # the connect window (120 s) is not waited out at the end
    assert live_workers(tmp_path) == []


RAISES_ON_N2 = r"""
import time, zerorun, torch, torch.distributed as dist
model = torch.nn.Linear(3, 2)
engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
if engine.rank == 1:
    time.sleep(2)
    raise ValueError("bad batch on rank 1")
dist.all_reduce(torch.ones(1))  # rank 0 fails of rank 1's exit, a moment after it
"""


def test_srun_ntasks_per_node_1_node_0_names_the_rank_of_node_1_that_failed_first(cluster, tmp_path):
    """Note [one cause under srun]: rank 1 raises on n2, rank 0 on n1 fails of it a moment
    later; node 0's launcher, which supervises rank 0 only, names rank 1 on n2 with its traceback."""
    (tmp_path / "fail.py").write_text(RAISES_ON_N2)
    done = cluster.run(["srun", "-l", "-N2", "--ntasks-per-node=1", *zerorun_cmd("fail.py").split()],
                       cwd=tmp_path, env=job_env(cluster), timeout=120)
    assert done.returncode != 0
    node0 = [line[3:] for line in done.stderr.splitlines() if line.startswith("0: ")]
    closing = [line for line in node0 if line.startswith("zerorun: error:")]
    assert len(closing) == 1 and "rank 1 on host n2 failed: exit code 1 (its log: " in closing[0], done.stderr[-3000:]
    assert "/node1/logs/rank1.log" in closing[0]
    panel = "\n".join(node0)
    assert "first failure: rank 1 on host n2: exit code 1 (its log: " in panel, panel
    assert "ValueError: bad batch on rank 1" in panel and "rank 0 on host n1" not in panel
    assert "zerorun summary (failed" in done.stdout


def test_two_launchers_on_one_node_are_refused_at_once(cluster, tmp_path):
    started = time.monotonic()
    done = cluster.run(["srun", "-N1", "-n2", *zerorun_cmd(str(TRAIN), str(STEPS), str(tmp_path)).split()],
                       cwd=tmp_path, env=job_env(cluster), timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerorun: error:")]
    assert errors and all("2 zerorun launchers on node n1" in line for line in errors), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "losses.json").exists() and not list(tmp_path.glob("pid.*"))
    # Refused before any worker starts: srun's own start-up is most of this (1.8 s measured).
    assert elapsed < 10, elapsed


def live_workers(out: Path) -> list[int]:
    pids = [int(p.read_text()) for p in out.glob("pid.*") if p.read_text().strip()]
    return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def busy_agent_steps(cluster: SlurmCluster, job: str) -> list[str]:
    """The job's steps with at least a second of CPU time, from sstat (JobID|AveCPU lines)."""
    done = cluster.run(["sstat", "-a", "-n", "-P", "-j", job, "--format=JobID,AveCPU"])
    steps = []
    for line in done.stdout.splitlines():
        step, _, cpu = line.partition("|")
        if step.split(".")[-1].isdigit() and cpu and cpu not in ("00:00:00", "00:00.000"):
            steps.append(step)
    return steps


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def started_training(out: Path) -> bool:
    return len(list(out.glob("pid.*"))) == 2 and (out / "losses.json").exists()


@pytest.mark.parametrize("how", ["salloc", "sbatch"])
def test_scancel_ends_every_worker_within_10_s(cluster, tmp_path, how):
    """...and, issue #31, /dev/shm holds none of the job's host-channel files after it
    (Note [shm cleanup]): both "nodes" are this host, so the two ranks share /dev/shm, and at
    stage 2 their gradient reduce-scatter opens the host channel (the launcher's config, not
    the script's, decides the stage: without --set it is 0, whose all-reduce opens none)."""
    command = zerorun_cmd("--set", "zero.stage=2", str(TRAIN), "100000", str(tmp_path), "0.2")
    shm_before = channel_files()
    if how == "salloc":
        proc = subprocess.Popen(["salloc", "-N2", "--quiet", "-J", "scancel-me", *command.split()], cwd=tmp_path,
                                env=job_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        job = wait_for(lambda: cluster.run(["squeue", "-h", "-n", "scancel-me", "-o", "%i"]).stdout.strip(), 60,
                       "the salloc job")
    else:
        job = sbatch(cluster, tmp_path, "exec " + command, "-N2")
    try:
        wait_for(lambda: started_training(tmp_path), 120, "both ranks to train")
        pids = live_workers(tmp_path)
        assert len(pids) == 2
        if how == "salloc":
            # Both nodes' workers run inside srun steps, so Slurm accounts their CPU time there
            # (sstat, which needs no slurmdbd: the cluster may run without accounting).
            wait_for(lambda: len(busy_agent_steps(cluster, job)) == 2, 60, "CPU time in both agent steps")
        cancelled = time.monotonic()
        assert cluster.run(["scancel", job]).returncode == 0
        wait_for(lambda: not live_workers(tmp_path), 10, f"workers {pids} to end after scancel")
        gone_after = time.monotonic() - cancelled
        assert gone_after < 10
        if how == "salloc":
            err = proc.communicate(timeout=60)[1].decode(errors="replace")
            assert proc.returncode == 143, err[-2000:]
        else:
            wait_job(cluster, job, timeout_s=60)
            err = (tmp_path / f"slurm-{job}.out").read_text()
        assert "zerorun: cancelled (" in err, err[-2000:]  # not a worker failure
        # The job has ended: what its workers' pids name is gone (other jobs may run beside).
        assert channel_files_of(channel_files() - shm_before, pids) == []
    finally:
        cluster.run(["scancel", job])
        if how == "salloc":
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


CHECKPOINT_CONFIG = "zero: {stage: 2}\ncheckpoint: {dir: ckpt, on_signal: true, requeue: true, resume: true}\n"


def test_time_limit_signal_saves_requeues_and_resumes_bit_exactly(cluster, tmp_path):
    """USR1 to the batch script (what --signal=B:USR1@N sends before the time limit, sent here with
    scancel --batch so the test need not wait for Slurm's timer): every rank saves, the job
    requeues itself, and the second start resumes from the checkpoint."""
    steps = 12
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "zerorun.yaml").write_text(CHECKPOINT_CONFIG)
    # checkpoint.resume wants the directory to exist on the first start (the engine's rule).
    (reference / "ckpt").mkdir()
    (tmp_path / "ckpt").mkdir()
    done = cluster.run(["salloc", "-N2", "--quiet",
                        *zerorun_cmd("--config", "zerorun.yaml", str(TRAIN), str(steps), str(reference)).split()],
                       cwd=reference, env=job_env(cluster), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    (tmp_path / "zerorun.yaml").write_text(CHECKPOINT_CONFIG)
    job = sbatch(cluster, tmp_path, "exec " + zerorun_cmd("--config", "zerorun.yaml", str(TRAIN), str(steps),
                                                          str(tmp_path), "1.0"),
                 "-N2", "--requeue", "--open-mode=append")
    wait_for(lambda: started_training(tmp_path), 120, "both ranks to train")
    assert cluster.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
    wait_for(lambda: list((tmp_path / "ckpt").glob("global_step*")), 60, "the checkpoint on SIGUSR1")
    assert len(json.loads((tmp_path / "losses.json").read_text())) < steps  # saved mid-way, not at the end
    # Slurm holds a requeued job back for a while (BeginTime); let it start now.
    wait_for(lambda: "requeued" in (tmp_path / f"slurm-{job}.out").read_text(), 60, "the requeue")
    requeued_at = time.monotonic()

    def started_again() -> bool:
        # Not at once: the first start's batch step must be cleaned up on n1 before the same job
        # id starts there again (nudged within a second, the second start failed at once).
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if state == "PENDING" and time.monotonic() - requeued_at > 10:
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        if final_state(cluster, job) is not None:
            return True  # ended (the assertions below say how)
        return "resumed from" in (tmp_path / f"slurm-{job}.out").read_text()

    try:
        wait_for(started_again, 120, "the requeued job to resume")
        state = wait_job(cluster, job, timeout_s=120)
    except AssertionError as err:
        queue = cluster.run(["scontrol", "-o", "show", "job", job]).stdout
        raise AssertionError(f"{err}\n{queue}\n{(tmp_path / f'slurm-{job}.out').read_text()[-3000:]}") from None
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert "time limit near (SIGUSR1): every rank saved a checkpoint and stopped" in log, log[-3000:]
    assert f"job {job} requeued" in log, log[-3000:]
    assert "zerorun: resumed from" in log, log[-3000:]
    assert state == "COMPLETED", log[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses == json.loads((reference / "losses.json").read_text())
    assert json.loads((tmp_path / "world.json").read_text())["params"] == \
        json.loads((reference / "world.json").read_text())["params"]
    # Both starts wrote to one run directory (with accounting on, as on a site with slurmdbd).
    assert [run.name for run in (tmp_path / "zerorun-runs").iterdir()] == [f"slurm-{job}"]


def test_a_real_time_limit_signal_reaches_zerorun_which_saves_and_requeues(cluster, tmp_path):
    """sbatch --time=1 --signal=B:USR1@50: Slurm's own timer (it runs every few seconds to half a
    minute) sends SIGUSR1 to the batch script well before the limit; zerorun saves and requeues."""
    (tmp_path / "zerorun.yaml").write_text(CHECKPOINT_CONFIG)
    (tmp_path / "ckpt").mkdir()
    job = sbatch(cluster, tmp_path, "exec " + zerorun_cmd("--config", "zerorun.yaml", str(TRAIN), "1000",
                                                          str(tmp_path), "0.5"),
                 "-N2", "--time=1", "--signal=B:USR1@50", "--requeue", "--open-mode=append")
    log = tmp_path / f"slurm-{job}.out"
    try:
        wait_for(lambda: log.exists() and f"job {job} requeued" in log.read_text(), 75, "the save and requeue")
    finally:
        cluster.run(["scancel", job])
    text = log.read_text()
    assert "time limit near (SIGUSR1): every rank saved a checkpoint and stopped" in text, text[-3000:]
    assert list((tmp_path / "ckpt").glob("global_step*"))

    def cancelled() -> str | None:
        # A scancel that lands while the first run is still completing misses the requeued
        # job, which then waits as pending: cancel again until it has ended for good.
        cluster.run(["scancel", job])
        return final_state(cluster, job)

    wait_for(cancelled, 180, f"job {job} to end")


FAILER = r"""
import os, sys, time, zerorun, torch
model = torch.nn.Linear(3, 2)
engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
if engine.rank == 1:
    time.sleep(2)
    open("failed_at", "w").write(repr(time.time()))
    raise ValueError("bad batch on rank 1")
time.sleep(300)
"""


def test_a_rank_that_raises_ends_the_job_within_10_s_with_the_root_cause(cluster, tmp_path):
    (tmp_path / "fail.py").write_text(FAILER)
    started = time.monotonic()
    done = cluster.run(["salloc", "-N2", "--quiet", *zerorun_cmd("fail.py").split()], cwd=tmp_path,
                       env=job_env(cluster), timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank 1 on host n2 failed: exit code 1" in done.stderr
    assert "ValueError: bad batch on rank 1" in done.stderr
    # From the raise to salloc's exit: teardown of both nodes (grace 3 s) and the end of the steps.
    ended_after = time.time() - float((tmp_path / "failed_at").read_text())
    assert ended_after < 10, ended_after
    assert time.monotonic() - started < 90


SACCT_FIELDS = ("JobID", "JobName", "NodeList", "State", "ExitCode")


def sacct_rows(cluster: SlurmCluster, job: str) -> list[dict[str, str]]:
    """The job's and its steps' records in accounting, once all of them have ended (slurmctld
    sends them to slurmdbd a moment after the job ends); else []."""
    done = cluster.run(["sacct", "-j", job, f"--format={','.join(SACCT_FIELDS)}", "-P", "-n"])
    rows = [dict(zip(SACCT_FIELDS, line.split("|"), strict=True)) for line in done.stdout.splitlines() if line]
    # "CANCELLED by 0" and the like: the first word is the state.
    ended = rows and all(row["State"].split()[0] in FINAL_STATES for row in rows)
    return rows if ended else []


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_sacct_names_the_failing_nodes_step_as_failed(cluster, tmp_path, failing_rank):
    """One rank raises under sbatch -N2: the launcher (the batch step, n1, with its own agent)
    and an agent step on n2 (``srun python -m zerorun.launch.agent``). The agent exits with the
    status of a worker that failed on its own, so the failing node's record is FAILED with that
    exit code; an agent the launcher stopped because of another node's failure ends 0."""
    if cluster.accounting is not None:
        pytest.skip(cluster.accounting)
    (tmp_path / "fail.py").write_text(FAILER.replace("engine.rank == 1", f"engine.rank == {failing_rank}"))
    job = sbatch(cluster, tmp_path, "exec " + zerorun_cmd("fail.py"), "-N2")
    state = wait_job(cluster, job)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    node = NODES[failing_rank]
    assert state == "FAILED", log[-2000:]
    assert f"rank {failing_rank} on host {node} failed: exit code 1" in log, log[-2000:]
    rows = wait_for(lambda: sacct_rows(cluster, job), 60, f"job {job}'s records in sacct")
    by_id = {row["JobID"]: row for row in rows}
    agent_steps = [row for row in rows if row["JobName"] == "zerorun-agent"]
    summary = "\n".join("|".join(row.values()) for row in rows)
    assert by_id[job]["State"] == "FAILED" and by_id[job]["ExitCode"] == "1:0", summary
    # The launcher's step: the batch script on n1, which exits 1 whichever rank failed.
    assert by_id[f"{job}.batch"]["NodeList"] == "n1" and by_id[f"{job}.batch"]["State"] == "FAILED", summary
    # One step runs n2's workers; the pre-flight check before it is a step of its own.
    assert [row["NodeList"] for row in agent_steps] == ["n2"], summary
    checks = [row for row in rows if row["JobName"] == "zerorun-check"]
    assert checks and all(row["State"] == "COMPLETED" for row in checks), summary
    if failing_rank == 1:
        assert agent_steps[0]["State"] == "FAILED" and agent_steps[0]["ExitCode"] == "1:0", summary
    else:  # n1's worker failed; n2's agent was stopped by the launcher, and says so
        assert agent_steps[0]["State"] == "COMPLETED" and agent_steps[0]["ExitCode"] == "0:0", summary


def test_two_jobs_on_one_node_at_once_do_not_collide_on_ports(cluster, tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for out in outs:
        out.mkdir()
        procs.append(subprocess.Popen(
            ["salloc", "-N1", "-w", "n1", "--quiet", *zerorun_cmd("--nproc", "2", str(TRAIN), "4", str(out), "1.0").split()],
            cwd=out, env=job_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [proc.communicate(timeout=180) for proc in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-2000:]
    ports = {json.loads(next(out.glob("zerorun-runs/*/plan.json")).read_text())["master_port"] for out in outs}
    assert len(ports) == 2  # derived from two different job ids (Note [Slurm port])
    assert all(len(json.loads((out / "losses.json").read_text())) == 4 for out in outs)


def test_the_sbatch_template_runs_as_a_new_user_would(cluster, tmp_path):
    env = job_env(cluster)
    done = subprocess.run([str(BIN / "zerorun"), "init", "--slurm"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "sbatch job.sbatch" in done.stdout, done.stderr
    # As written: whole nodes (--exclusive), whatever their CPU count (4 here).
    done = cluster.run(["sbatch", "--parsable", "job.sbatch"], cwd=tmp_path, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    state = wait_job(cluster, job, timeout_s=180)
    log = (tmp_path / f"zerorun-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert "rank 1" in log or "│    1 │ n2" in log, log[-3000:]
    assert list((tmp_path / "zerorun-runs").glob("*/logs/rank1.log"))


def test_the_init_train_py_runs_under_srun_python_without_the_launcher(cluster, tmp_path):
    """Issue 39: the ``zerorun init`` train.py under ``srun -N2 -n2 python train.py`` read
    WORLD_SIZE (unset there) before ``initialize`` and failed "batch.train_batch_size = 4: must
    equal ... = 8"; initialize, which knows the world, now checks the batch sizes."""
    env = job_env(cluster)
    done = subprocess.run([str(BIN / "zerorun"), "init"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    done = cluster.run(["srun", "-N2", "-n2", str(BIN / "python"), "train.py", "--steps", "3"], cwd=tmp_path,
                       env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3/3  loss" in done.stdout, done.stdout[-2000:]


def test_a_time_limit_signal_in_the_first_seconds_requeues_without_a_kill_then_completes(cluster, reference, tmp_path):
    """--time=2 --signal=B:USR1@110: Slurm's timer fires within the first seconds (it may send the
    signal up to a minute early), before or while the launcher plans; the launcher has handled
    USR1 from its first line (Note [signals from the first instant]), so the batch step is not
    killed by it: the save waits for the first step, the job requeues, and in the end completes
    with the losses of an uninterrupted run.

    slurmctld checks time limits on its periodic sweep, so the signal may come tens of seconds in:
    the first start pauses 20 s a step (3 steps, about a minute, under the 2-minute limit), and a
    requeued start does not pause, so one start soon finishes before its own signal."""
    (tmp_path / "zerorun.yaml").write_text(CHECKPOINT_CONFIG)
    (tmp_path / "ckpt").mkdir()
    job = sbatch(cluster, tmp_path, "exec " + zerorun_cmd("--config", "zerorun.yaml", str(TRAIN), str(STEPS),
                                                          str(tmp_path), "20.0", "first-start"),
                 "-N2", "--time=2", "--signal=B:USR1@110", "--requeue", "--open-mode=append")
    log = tmp_path / f"slurm-{job}.out"
    requeues = {"seen": 0, "at": time.monotonic()}

    def ended() -> str | None:
        seen = log.read_text().count(f"job {job} requeued") if log.exists() else 0
        if seen > requeues["seen"]:
            requeues.update(seen=seen, at=time.monotonic())
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        # A requeued job waits (BeginTime); started again too soon after the requeue, while the
        # first start's batch step is still being cleaned up on n1, it fails at once.
        if state == "PENDING" and seen and time.monotonic() - requeues["at"] > 10:
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            requeues["at"] = time.monotonic()
        return final_state(cluster, job)

    try:
        state = wait_for(ended, 480, f"job {job} to complete")
    finally:
        cluster.run(["scancel", job])
    text = log.read_text()
    assert "time limit near (SIGUSR1)" in text and f"job {job} requeued" in text, text[-3000:]
    assert state == "COMPLETED", text[-3000:]
    assert_same_training(tmp_path, reference)


@pytest.mark.timeout(900)
def test_the_sbatch_template_saves_requeues_and_resumes_counting_each_step_once(cluster, tmp_path):
    """The `zerorun init --slurm` job, its train.py given more steps so the signal lands mid-run:
    SIGUSR1 to the batch script (as --signal=B:USR1@120 would send it) saves, requeues; the
    requeued start resumes from the checkpoint and prints every step from there to the total,
    so across both starts each step 1..N is printed exactly once."""
    env = job_env(cluster)
    done = subprocess.run([str(BIN / "zerorun"), "init", "--slurm"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = 400  # 5 to 30 steps/s on this 2-core machine shared with other jobs
    script = tmp_path / "job.sbatch"
    script.write_text(script.read_text().replace("    train.py\n", f"    train.py --steps {steps}\n"))
    done = cluster.run(["sbatch", "--parsable", "job.sbatch"], cwd=tmp_path, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    log = tmp_path / f"zerorun-{job}.out"
    wait_for(lambda: log.exists() and f"step 100/{steps} " in log.read_text(), 300, "a hundred steps")
    assert cluster.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
    wait_for(lambda: f"job {job} requeued" in log.read_text(), 60, "the save and requeue")
    requeued_at = time.monotonic()

    def ended() -> str | None:
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if state == "PENDING" and time.monotonic() - requeued_at > 10:
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
        return final_state(cluster, job)

    try:
        state = wait_for(ended, 400, f"job {job} to complete")
    finally:
        cluster.run(["scancel", job])
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    assert "zerorun: resumed from" in text, text[-3000:]
    printed = [int(n) for n in re.findall(rf"\bstep (\d+)/{steps} +loss", text)]
    assert sorted(printed) == list(range(1, steps + 1)), [n for n in printed if printed.count(n) > 1][:10]
    assert [run.name for run in (tmp_path / "zerorun-runs").iterdir()] == [f"slurm-{job}"]
