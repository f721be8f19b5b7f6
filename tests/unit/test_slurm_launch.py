"""pytest tests/unit/test_slurm_launch.py — the launcher's plans inside Slurm (faked environments, no Slurm).

The environments are test_slurm.py's, recorded on a real Slurm 22.05: an srun task, a batch
script and a salloc shell.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_slurm import BATCH, SALLOC, SRUN_TASK

from zerorun.errors import LaunchError
from zerorun.launch import job_hosts, prepare as prepare_module, slurm
from zerorun.launch.commands import on_host
from zerorun.launch.job_hosts import choose_launcher
from zerorun.launch.prepare import LaunchOptions, dry_run_text, prepare
from zerorun.launch.signals import signal_meaning
from zerorun.launch.plan import Target


@pytest.fixture
def job_dir(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.setattr(job_hosts.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(job_hosts.socket, "gethostname", lambda: "login1")
    monkeypatch.setattr(job_hosts.socket, "getfqdn", lambda: "login1.cluster")
    return tmp_path


def prep(job_dir, environ, **options):
    return prepare(LaunchOptions(target=Target(script="train.py"), **options), environ=environ, cwd=str(job_dir))


@pytest.mark.parametrize("requested, env, hostfile, mode", [
    (None, None, False, "ssh"),  # outside Slurm: this machine (or a hostfile over ssh)
    (None, SALLOC, False, "srun"),
    (None, BATCH, False, "srun"),
    (None, SRUN_TASK, False, "step"),
    (None, SALLOC, True, "ssh"),  # an explicit hostfile wins
    ("ssh", SALLOC, False, "ssh"),
    ("local", SRUN_TASK, False, "local"),
    ("slurm", SALLOC, False, "srun"),
])
def test_the_launcher_follows_where_it_runs(requested, env, hostfile, mode):
    assert choose_launcher(requested, slurm.detect(env) if env else None, hostfile) == mode


@pytest.mark.parametrize("requested, env, hostfile, message", [
    ("slurm", None, False, "not inside a Slurm allocation"),
    ("slurm", SALLOC, True, "drop --hostfile"),
    ("ssh", SRUN_TASK, False, "whole job from every task"),
    ("pdsh", None, False, "--launcher must be one of ssh, slurm, local"),
])
def test_launcher_choices_that_cannot_work_are_one_line_errors(requested, env, hostfile, message):
    with pytest.raises(LaunchError, match=message):
        choose_launcher(requested, slurm.detect(env) if env else None, hostfile)


def test_salloc_reaches_every_node_by_srun_with_more_workers_than_tasks(job_dir):
    job = prep(job_dir, {**SALLOC, "SLURM_JOB_CPUS_PER_NODE": "8(x2)"}, nproc=2)
    assert [(n.host, n.reach, len(n.workers)) for n in job.plan.nodes] == [("n1", "srun", 2), ("n2", "srun", 2)]
    assert job.plan.world_size == 4 and job.plan.master_addr == "n1"
    assert job.plan.master_port == slurm.master_port(3, None)
    assert {w.env["OMP_NUM_THREADS"] for w in job.plan.workers} == {"4"}  # 8 CPUs per node, 2 workers
    command = job.node_commands()["n2"]
    assert command[:1] == ["srun"] and "-w" in command and command[command.index("-w") + 1] == "n2"
    assert {"--export=ALL", "--kill-on-bad-exit=1", "--nodes=1", "--ntasks=1", "--whole"} <= set(command)
    assert command[-3:] == [job.plan.python, "-m", "zerorun.launch.agent"]
    # In sacct the workers' step and the checks beside it (pre-flight, sweep) are told apart by name.
    check = on_host("srun", "n2", "/", ["true"])
    assert "--job-name=zerorun-agent" in command and "--whole" not in check
    assert "--job-name=zerorun-check" in check and "--overlap" in check


def test_the_batch_script_runs_its_own_node_locally(job_dir):
    job = prep(job_dir, BATCH)
    assert [(n.host, n.reach) for n in job.plan.nodes] == [("n1", "local"), ("n2", "srun")]
    assert job.plan.master_addr == "n1"


def test_user_threads_and_port_win(job_dir):
    job = prep(job_dir, {**SALLOC, "OMP_NUM_THREADS": "3"}, nproc=2, master_port=4242)
    assert job.plan.master_port == 4242
    assert all("OMP_NUM_THREADS" not in w.env for w in job.plan.workers)


def test_srun_zerorun_runs_only_its_own_node_of_one_job(job_dir):
    job = prep(job_dir, {**SRUN_TASK, "SLURM_CPUS_PER_TASK": "4"}, nproc=2)
    assert [(n.host, n.node_rank, n.reach) for n in job.plan.nodes] == [("n2", 1, "local")]
    assert [w.rank for w in job.plan.workers] == [2, 3]
    assert job.plan.world_size == 4
    assert (job.plan.master_addr, job.plan.master_port) == ("n1", slurm.master_port(1, 0))
    assert job.plan.run_dir == str(job_dir / "zerorun-runs" / "slurm-1.0" / "node1")
    assert {w.env["OMP_NUM_THREADS"] for w in job.plan.workers} == {"2"}


def test_srun_zerorun_refuses_a_second_launcher_on_a_node(job_dir):
    env = {**SRUN_TASK, "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    with pytest.raises(LaunchError, match="2 zerorun launchers on node n1"):
        prep(job_dir, env)
    with pytest.raises(LaunchError, match="--include does not apply under srun"):
        prep(job_dir, SRUN_TASK, include="n1")


def test_local_ignores_the_allocation_and_ssh_still_works(job_dir):
    job = prep(job_dir, SALLOC, launcher="local", nproc=2)
    assert [(n.host, n.reach) for n in job.plan.nodes] == [("localhost", "local")]
    job = prep(job_dir, SALLOC, launcher="ssh")
    assert [n.reach for n in job.plan.nodes] == ["ssh", "ssh"]
    assert job.node_commands()["n1"][0] == "ssh"


def test_no_srun_on_path_is_a_clear_error(job_dir, monkeypatch):
    monkeypatch.setattr(job_hosts.shutil, "which", lambda name: None)
    with pytest.raises(LaunchError, match="srun is not on PATH"):
        prep(job_dir, SALLOC)


def test_dry_run_tells_the_allocation_reach_port_and_signal_plan(job_dir):
    text = dry_run_text(prep(job_dir, SALLOC))
    assert "Slurm: job 3, allocation shell (salloc)" in text
    assert "n2: reached by srun" in text and f"rendezvous port {slurm.master_port(3, None)}" in text
    assert "SIGUSR1/SIGUSR2" in text and "host n2 (node 1, srun, 1 worker(s))" in text


def test_checkpoint_on_signal_arms_every_worker(job_dir):
    (job_dir / "z.yaml").write_text("checkpoint: {dir: ckpt, on_signal: true, requeue: true}\n")
    job = prep(job_dir, SALLOC, config="z.yaml")
    assert job.save_on_signal and job.requeue
    assert all(w.env[prepare_module.SAVE_ON_SIGNAL_ENV] == "1" for w in job.plan.workers)
    assert "saves a checkpoint at the next step, then stops; then scontrol requeue" in dry_run_text(job)
    assert "SIGTERM of a preemption (the job's record says so) saves like SIGUSR1" in dry_run_text(job)


def test_signals_say_what_they_meant():
    assert signal_meaning(signal.SIGUSR1, in_slurm=True) == "time limit near (SIGUSR1)"
    # Outside Slurm nothing has a time limit.
    assert signal_meaning(signal.SIGUSR1) == "SIGUSR1 received (a checkpoint request; not a Slurm job)"
    assert signal_meaning(signal.SIGUSR1, "preempted", in_slurm=True) == "preempted (SIGUSR1)"
    assert signal_meaning(signal.SIGTERM, "cancelled", True) == "cancelled (SIGTERM, scancel)"
    assert signal_meaning(signal.SIGTERM, "time limit", True) == "time limit (SIGTERM)"
    assert signal_meaning(signal.SIGTERM, "preempted", True) == "preempted (SIGTERM)"
    assert signal_meaning(signal.SIGTERM, "node failure", True) == "node failure (SIGTERM)"
    assert signal_meaning(signal.SIGTERM, "requeued", True).startswith("preempted or requeued (SIGTERM")
    assert signal_meaning(signal.SIGTERM, None, True).startswith("signalled (SIGTERM) while Slurm still runs")
    assert signal_meaning(signal.SIGTERM) == "interrupted (SIGTERM)"
    assert signal_meaning(signal.SIGHUP).startswith("hung up")
    assert signal_meaning(signal.SIGINT) == "interrupted (Ctrl-C)"


def test_zerorun_env_reports_the_allocation_and_how_nodes_are_reached():
    from zerorun.cli.env import slurm_facts

    lines = "\n".join(slurm_facts(BATCH, "c7", "c7.cluster")["lines"])
    assert "batch script on n1" in lines and "n1: reached by local" in lines and "n2: reached by srun" in lines
    assert f"rendezvous port {slurm.master_port(2, None)}" in lines and "SIGUSR1" in lines
    step = "\n".join(slurm_facts(SRUN_TASK, "c7", "c7")["lines"])
    assert "n2: reached by this launcher" in step and "n1: reached by its own srun task's launcher" in step
    assert slurm_facts({}, "c7", "c7")["lines"] == ["Slurm: not in an allocation (no SLURM_JOB_ID)"]
    assert "cannot be read" in slurm_facts({"SLURM_JOB_ID": "x"}, "c7", "c7")["lines"][0]


def test_a_slurm_run_directory_is_named_by_the_job_and_a_requeued_start_continues_it(tmp_path):
    from zerorun.launch import slurm
    from zerorun.launch.prepare import default_run_dir

    first = slurm.detect({"SLURM_JOB_ID": "4242"})
    path = default_run_dir(str(tmp_path), first)
    assert path == str(tmp_path / "zerorun-runs" / "slurm-4242")
    Path(path).mkdir(parents=True)
    requeued = slurm.detect({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert default_run_dir(str(tmp_path), requeued) == path  # the same folder, the same metrics file
    # A second launch in one allocation (salloc) does not write into the first one's folder.
    again = default_run_dir(str(tmp_path), first)
    assert again != path and Path(again).name.startswith("slurm-4242-")
    array = slurm.detect({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_TASK_ID": "7"})
    assert Path(default_run_dir(str(tmp_path), array)).name == "slurm-4243-array7"
    assert Path(default_run_dir(str(tmp_path), None)).parent == tmp_path / "zerorun-runs"


def test_a_preemption_that_killed_the_workers_says_what_the_requeued_job_resumes_from(monkeypatch):
    from types import SimpleNamespace

    from zerorun.cli import run
    from zerorun.launch import signals, slurm

    ctx = slurm.detect({"SLURM_JOB_ID": "77"})
    asked = []
    monkeypatch.setattr(signals, "requeue_slurm_job", lambda job_id: asked.append(job_id))
    interval = '{"checkpoint": {"dir": "ckpt", "interval_steps": 5}}'
    job = SimpleNamespace(slurm=ctx, requeue=True, save_on_signal=False, config_json=interval)
    # Ended within the grace time: Slurm counts the job as ended, so the launcher requeues it.
    assert run.after_preemption(job, "preempted") == (
        "; nothing was saved on the signal: the requeued job resumes from the last interval checkpoint; job 77 requeued")
    assert asked == [77]
    assert run.after_preemption(job, "requeued").endswith("resumes from the last interval checkpoint")  # Slurm did
    assert asked == [77]
    assert run.after_preemption(SimpleNamespace(slurm=ctx, requeue=False), "preempted").endswith(
        "not requeued (checkpoint.requeue is off)")
    assert run.after_preemption(job, "cancelled") == ""
    monkeypatch.setattr(signals, "slurm_stop_cause", lambda ctx: "preempted")
    assert run.stop_reason(job, signal.SIGTERM).startswith("preempted (SIGTERM); nothing was saved on the signal")
    # No interval checkpoint configured: the line does not promise one.
    for config_json in ('{"checkpoint": {"dir": "ckpt", "interval_steps": 0}}', "{}"):
        bare = SimpleNamespace(slurm=ctx, requeue=False, save_on_signal=False, config_json=config_json)
        for said in (run.after_preemption(bare, "requeued"), run.stop_reason(bare, signal.SIGTERM)):
            assert "interval checkpoint" not in said, said
            assert "the last checkpoint the script saved, if any, else from the start" in said, said


@pytest.mark.parametrize("first_failure, status", [(None, 0), (1, 1), (-15, 143), (-9, 137), (300, 255)])
def test_an_agent_ends_with_its_first_failed_workers_status(first_failure, status):
    """A Slurm step of a node whose worker failed ends FAILED in sacct, not COMPLETED."""
    from zerorun.launch.agent import exit_status

    assert exit_status(first_failure) == status


def test_an_agent_records_the_failure_of_its_own_workers_not_the_ones_it_stopped():
    import sys
    import threading
    import time

    from zerorun.launch.agent import NodeAgent

    def worker(rank: int, code: str) -> dict:
        return {"rank": rank, "argv": [sys.executable, "-c", code], "env": {}}

    failing = NodeAgent([worker(0, "raise SystemExit(3)")], emit=lambda event: None, grace_s=1.0)
    failing.start()
    failing.wait()
    assert failing.first_failure == 3
    stopped = NodeAgent([worker(0, "import time; time.sleep(60)")], emit=lambda event: None, grace_s=1.0)
    stopped.start()
    time.sleep(0.5)
    threading.Thread(target=stopped.stop).start()
    stopped.wait()
    assert stopped.first_failure is None  # ended by the launcher's stop: its step ends as told


@pytest.mark.parametrize("cause, header", [("cancelled", "cancelled"), ("preempted", "preempted"),
                                           ("node failure", "ended by a node failure"), (None, "failed")])
def test_the_summary_header_says_how_slurm_ended_the_job_as_the_closing_line_does(tmp_path, cause, header):
    """Issue 39: scancel killed the workers, the closing line said "cancelled" and the summary's
    header "failed". The supervisor asks Slurm once before the summary; a real failure stays one."""
    import io

    from zerorun.launch.plan import build_plan
    from zerorun.launch.supervisor import Failure, Supervisor
    from zerorun.ui.live import JobView

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir=str(tmp_path),
                      token="t", master_port=29500, local_names={"localhost"})
    out = io.StringIO()
    view = JobView(run_dir=tmp_path, token="T", world_size=2, dashboard=False, stream=out)
    asked = []
    supervisor = Supervisor(plan, view, slurm_ending=lambda: asked.append(1) or cause)
    supervisor._failure = Failure("localhost", 1, "killed by SIGTERM")
    supervisor._name_slurm_ending()
    view.stop(failed=True)
    assert f"zerorun summary ({header} after" in out.getvalue()
    assert asked == [1]
    # A job that finished is not asked about.
    supervisor._failure = None
    supervisor._name_slurm_ending()
    assert asked == [1]
    # One that saved on a preemption and stopped did not finish.
    from zerorun.launch.supervision_state import SaveRequest

    supervisor._save.move(SaveRequest.PASSED_ON)
    supervisor._name_slurm_ending()
    assert asked == [1, 1]


def test_a_worker_line_with_torchs_own_rank_prefix_is_shown_with_one_prefix(tmp_path):
    """Issue 39: torch's uncaught-exception lines carry "[rank1]:", and the plain mode printed
    "[rank1] [rank1]: Traceback"."""
    import io

    from zerorun.ui.live import JobView

    out = io.StringIO()
    view = JobView(run_dir=tmp_path, token="T", world_size=2, dashboard=False, stream=out)
    view.on_output("h0", 1, "[rank1]: Traceback (most recent call last):")
    view.on_output("h0", 1, "[rank0]: another rank's prefix stays")
    view.on_output("h0", -1, "[rank1]: the agent's own line stays")
    view.stop(failed=False)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["[rank1] Traceback (most recent call last):", "[rank1] [rank0]: another rank's prefix stays",
                         "[zerorun] [rank1]: the agent's own line stays"]


def test_scancel_during_the_pre_flight_is_a_cancellation_not_a_pre_flight_problem(monkeypatch, tmp_path):
    """Issue 39: scancel under salloc while the pre-flight's srun probes ran was reported as
    "pre-flight found 2 problems ... has expired", exit 2. Slurm's record says the job is ending:
    the job stopped before any worker started (run.py: "cancelled (SIGTERM, scancel) before any
    worker started", exit 143). A pre-flight problem in a running job stays one."""
    from types import SimpleNamespace

    from zerorun.cli import run
    from zerorun.launch import preflight, run_job, signals

    def expired(*args, **kwargs):
        raise LaunchError("pre-flight found 2 problems: n1: srun: error: Job 12 has expired; n2: ...")

    monkeypatch.setattr(preflight, "preflight", expired)
    ctx = slurm.detect({"SLURM_JOB_ID": "12"})
    job = SimpleNamespace(slurm=ctx, save_on_signal=False, requeue=False, plan=SimpleNamespace(run_dir=str(tmp_path)),
                          options=SimpleNamespace(ssh_port=None), ssh_options=[], config_json="{}")
    monkeypatch.setattr(signals, "slurm_stop_cause", lambda ctx: "cancelled")
    result = run_job.execute(job)
    assert not result.started and result.signal == signal.SIGTERM
    assert run.stop_reason(job, result.signal) == "cancelled (SIGTERM, scancel)"
    outcome = run.outcome_of(job, result)
    assert outcome.state.name == "NOT_STARTED" and outcome.exit_code == 143
    monkeypatch.setattr(signals, "slurm_stop_cause", lambda ctx: None)
    with pytest.raises(LaunchError, match="pre-flight found 2 problems"):
        run_job.execute(job)


def test_a_node_set_down_that_returns_at_once_is_a_node_failure_not_a_preemption(monkeypatch):
    """Issue 39: a node set DOWN and straight back leaves the job's record saying only that it
    was requeued (PENDING, Restarts one more) and no node down, and the line said "preempted or
    requeued"; accounting keeps NODE_FAIL for the run that ended."""
    from zerorun.launch import signals

    ctx = slurm.detect({"SLURM_JOB_ID": "31"})
    requeued = "JobId=31 JobState=PENDING Reason=BeginTime Restarts=1 PreemptTime=None"
    monkeypatch.setattr(signals, "scontrol_show", lambda kind, name, timeout_s=3.0:
                        requeued if kind == "job" else f"NodeName={name} State=IDLE")
    monkeypatch.setattr(signals, "sacct_states", lambda job_id: ["NODE_FAIL", "PENDING"])
    assert signals.slurm_stop_cause(ctx) == "node failure"
    assert signal_meaning(signal.SIGTERM, signals.slurm_stop_cause(ctx), in_slurm=True) == "node failure (SIGTERM)"
    monkeypatch.setattr(signals, "sacct_states", lambda job_id: ["PREEMPTED", "PENDING"])
    assert signals.slurm_stop_cause(ctx) == "requeued"  # Slurm requeued it: the launcher must not again
    monkeypatch.setattr(signals, "sacct_states", lambda job_id: [])  # no accounting: what the record says
    assert signals.slurm_stop_cause(ctx) == "requeued"
    assert slurm.requeue_cause(["REQUEUED", "PENDING"]) is None


@pytest.mark.parametrize("on_signal", [True, False])
def test_a_preemption_before_the_agent_steps_existed_is_acted_on_once_every_rank_joined(monkeypatch, on_signal):
    """Issue 39, Note [a preemption before the steps]: a preemption in the first seconds signals
    no step (there was none yet) and the job trained through the grace, nothing saved. Once every
    rank has joined, the supervisor asks the job's record once: with on_signal every rank saves,
    else the job stops (SIGTERM) and run.py requeues it."""
    import time
    from types import SimpleNamespace

    from zerorun.cli import run
    from zerorun.launch import signals
    from zerorun.launch.plan import build_plan
    from zerorun.launch.supervisor import Supervisor

    plan = build_plan({"localhost": [0, 1]}, Target(script="t.py"), python="py", cwd="/w", run_dir="/r",
                      token="t", master_port=29500, local_names={"localhost"})
    asked = []
    supervisor = Supervisor(plan, SimpleNamespace(), preempted_already=lambda: asked.append(1) or True,
                            is_preemption=(lambda: True) if on_signal else None)
    supervisor._running = {0, 1}
    supervisor._handle("localhost", {"t": "joined", "rank": 0})
    assert asked == []  # not before every rank has joined: a step may not exist yet
    supervisor._handle("localhost", {"t": "joined", "rank": 1})
    deadline = time.monotonic() + 10
    while not (supervisor._checkpoint_signal or supervisor._interrupt.is_set()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asked == [1]
    if on_signal:
        assert supervisor._checkpoint_signal == signal.SIGTERM and not supervisor._interrupt.is_set()
    else:
        assert supervisor._interrupt.is_set() and supervisor._signal == signal.SIGTERM
    # The closing line of a job stopped on a preemption: requeued with what it had.
    ctx = slurm.detect({"SLURM_JOB_ID": "88"})
    requeued = []
    monkeypatch.setattr(signals, "requeue_slurm_job", lambda job_id: requeued.append(job_id))
    monkeypatch.setattr(signals, "slurm_stop_cause", lambda ctx: "preempted")
    job = SimpleNamespace(slurm=ctx, requeue=True, save_on_signal=False, config_json="{}")
    assert run.requeue_after_stop(job, signal.SIGTERM) == "; job 88 requeued" and requeued == [88]
    assert run.requeue_after_stop(job, signal.SIGINT) == "" and requeued == [88]
