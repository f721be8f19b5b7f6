"""pytest tests/unit/test_preemption_grace.py — Note [preemption grace] in zerorun/worker/preemption_grace.py.

The launcher reads the partition's preemption GraceTime from ``scontrol -o show partition``
(the record below is what slurm-wlm 22.05 printed for the test cluster's low partition), says it
at start-up and hands it to the workers; rank 0 names a save that took longer than it, once.
"""

from __future__ import annotations

import subprocess

import torch

import zerorun
from zerorun.launch import signals, slurm
from zerorun.worker import preemption_grace

LOW = ("PartitionName=low AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
       "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=30 Hidden=NO MaxNodes=UNLIMITED "
       "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] PriorityJobFactor=1 "
       "PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=REQUEUE State=UP "
       "TotalCPUs=8 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED")


def test_the_grace_of_a_requeueing_partition_is_read_from_its_record():
    assert slurm.partition_grace(slurm.parse_job_record(LOW)) == 30
    assert slurm.partition_grace(slurm.parse_job_record(LOW.replace("PreemptMode=REQUEUE", "PreemptMode=OFF"))) is None
    assert slurm.partition_grace(slurm.parse_job_record(LOW.replace("GraceTime=30", "GraceTime=0"))) is None
    assert slurm.partition_grace({"PreemptMode": "CANCEL", "GraceTime": "5"}) == 5


def test_outside_a_slurm_job_scontrol_is_not_asked(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("asked")))
    assert signals.read_partition_grace({"SLURM_JOB_PARTITION": "low"}) is None
    assert signals.read_partition_grace({"SLURM_JOB_ID": "7"}) is None


def test_a_missing_scontrol_means_no_grace_not_an_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert signals.read_partition_grace({"SLURM_JOB_ID": "7", "SLURM_JOB_PARTITION": "low"}) is None


def test_a_save_longer_than_the_grace_is_named_once(monkeypatch):
    monkeypatch.setattr(preemption_grace, "_said", False)
    env = {preemption_grace.GRACE_ENV: "30", preemption_grace.PARTITION_ENV: "low"}
    assert preemption_grace.note_save_time(12.0, env) is None
    line = preemption_grace.note_save_time(41.25, env)
    assert line is not None and "41.2 s" in line and "partition low's preemption grace time of 30 s" in line
    assert preemption_grace.note_save_time(50.0, env) is None  # once per process
    assert preemption_grace.grace_seconds({}) is None
    assert preemption_grace.grace_seconds({preemption_grace.GRACE_ENV: "soon"}) is None


def test_the_engines_save_prints_the_line_when_the_grace_is_shorter(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preemption_grace, "_said", False)
    monkeypatch.setenv(preemption_grace.GRACE_ENV, "1e-9")  # any real save takes longer
    monkeypatch.setenv(preemption_grace.PARTITION_ENV, "low")
    model = torch.nn.Linear(3, 2)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
    engine.save_checkpoint(tmp_path)
    assert "longer than partition low's preemption grace time of 1e-09 s" in capsys.readouterr().err
    monkeypatch.delenv(preemption_grace.GRACE_ENV)
    engine.save_checkpoint(tmp_path, tag="again")
    assert "preemption grace" not in capsys.readouterr().err


def fresh(monkeypatch) -> None:
    monkeypatch.setattr(preemption_grace, "_said", False)
    monkeypatch.setattr(preemption_grace, "_steps_seen", 0)
    monkeypatch.setattr(preemption_grace, "_step_s", None)


def test_one_step_plus_a_save_longer_than_the_grace_is_named_once(monkeypatch):
    """Issue 39: a save on preemption waits for the step in progress; only the save's own time was
    compared with the grace, so a 20 s step and a 15 s save under a 30 s grace said nothing."""
    fresh(monkeypatch)
    env = {preemption_grace.GRACE_ENV: "30", preemption_grace.PARTITION_ENV: "low"}
    assert [preemption_grace.note_step_time(20.0, env) for _ in range(3)] == [None, None, None]  # a step fits
    line = preemption_grace.note_save_time(15.0, env)
    assert line is not None and "one step (20.0 s) plus a save (15.0 s)" in line
    assert "partition low's preemption grace time of 30 s" in line
    assert preemption_grace.note_save_time(15.0, env) is None  # once per process
    fresh(monkeypatch)
    assert preemption_grace.note_save_time(15.0, env) is None  # no step timed yet: the save alone fits


def test_a_step_longer_than_the_grace_is_named_after_the_first_steps(monkeypatch):
    fresh(monkeypatch)
    env = {preemption_grace.GRACE_ENV: "30"}
    assert preemption_grace.note_step_time(90.0, env) is None  # warm-up steps are not judged
    assert preemption_grace.note_step_time(90.0, env) is None
    line = preemption_grace.note_step_time(31.0, env)
    assert line is not None and "one step (31.0 s), before any save, takes longer than the partition's" in line
    assert preemption_grace.note_step_time(99.0, env) is None and preemption_grace.note_save_time(1.0, env) is None
    fresh(monkeypatch)
    assert [preemption_grace.note_step_time(1.0, {}) for _ in range(5)] == [None] * 5  # no grace: nothing


def test_the_engine_names_a_step_longer_than_the_grace(monkeypatch, capsys):
    fresh(monkeypatch)
    monkeypatch.setenv(preemption_grace.GRACE_ENV, "1e-9")  # any real step takes longer
    model = torch.nn.Linear(3, 2)
    engine = zerorun.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero": {"stage": 1}})
    for _ in range(preemption_grace.CHECK_AT_STEP):
        engine.backward(engine(torch.ones(4, 3)).sum())
        engine.step()
    err = capsys.readouterr().err
    assert err.count("before any save, takes longer than the partition's preemption grace time of 1e-09 s") == 1


def test_a_requeued_start_compares_the_previous_starts_step_and_save_with_the_grace(tmp_path):
    """Issue 39, at start-up: the run directory a requeued start continues holds the previous
    start's step times and its last save; one step plus the save longer than the grace is said
    before anything starts."""
    import json

    (tmp_path / "logs").mkdir()
    steps = [{"kind": "step", "rank": rank, "step": n, "step_time_s": 9.0 if n == 1 else 12.0}
             for n in range(1, 6) for rank in (0, 1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, steps)) + "\n")
    (tmp_path / "logs" / "rank0.log").write_text(
        "zerorun: checkpoint step5 saved to /c/step5 in 4.50 s (1.0 MiB from 2 rank(s))\n"
        "zerorun: checkpoint step10 saved to /c/step10 in 21.25 s (1.0 MiB from 2 rank(s))\n")
    assert preemption_grace.previous_start((tmp_path / "metrics.jsonl").read_text().splitlines(),
                                           (tmp_path / "logs" / "rank0.log").read_text().splitlines()) == (12.0, 21.25)
    line = preemption_grace.start_up_line(str(tmp_path), 30, "low")
    assert line == ("at this job's previous start, one step (12.0 s) plus a save (21.2 s) takes longer than partition "
                    "low's preemption grace time of 30 s: a save on preemption waits for the step in progress, so it "
                    "would be cut off and the requeued job would resume from the last complete checkpoint (ask for a "
                    "longer GraceTime, or make steps shorter)")
    assert preemption_grace.start_up_line(str(tmp_path), 60, "low") is None
    assert preemption_grace.start_up_line(str(tmp_path / "first-start"), 30, "low") is None


def test_the_launcher_says_the_previous_starts_figures_at_a_requeued_start(tmp_path, monkeypatch):
    import json

    from zerorun.launch import prepare as prepare_module
    from zerorun.launch.plan import Target
    from zerorun.launch.prepare import LaunchOptions, prepare

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "step", "rank": 0, "step": n, "step_time_s": 40.0}) + "\n" for n in range(1, 5)))
    (run_dir / "logs" / "rank0.log").write_text("")
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(prepare_module, "read_partition_grace", lambda environ: ("low", 30))
    options = LaunchOptions(target=Target(script="train.py"), nproc=1, run_dir=str(run_dir), launcher="local",
                            config_overrides={"checkpoint.on_signal": True, "checkpoint.dir": "ckpt"})
    job = prepare(options, environ={}, cwd=str(tmp_path))
    assert any(note.startswith("at this job's previous start, one step (40.0 s), before any save, takes longer")
               for note in job.notes), job.notes
