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
