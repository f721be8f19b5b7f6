"""pytest tests/unit/test_monitor.py — the monitor series (telemetry/monitor.py) and its three sinks.

TensorBoard files are read back with tensorboard's own reader; W&B with a stand-in module that
records what ``wandb.init`` and ``log`` were given (the real package is tested in
tests/e2e/test_monitor_export.py when installed).
"""

from __future__ import annotations

import csv
import sys
import types

import pytest

from zerorun.config import load_config
from zerorun.telemetry import events
from zerorun.telemetry.monitor import CsvSink, Monitor, SeriesBuilder, TensorBoardSink, open_sinks


def step(rank, n, loss, *, t=0.5, samples=4, waited=0.1, lr=1e-3):
    return {"rank": rank, "kind": "step", "step": n, "step_time_s": t, "loss": loss, "lr": lr, "samples": samples,
            "waited_s": waited, "host": "h", "t": 1.0}


def sample(rank, rss, comm):
    return {"rank": rank, "kind": "sample", "mem": {"rss": rss, "rss_peak": rss + 1}, "comm": comm,
            "host": "h", "t": 1.0, "comm_seconds_total": 0.0, "entered_seq": 1}


def test_a_step_is_written_once_every_rank_reported_it_with_job_and_rank_figures():
    builder = SeriesBuilder(2)
    assert builder.add(sample(0, 100, {"all_gather": [2, 1000, 0.5]})) == []
    assert builder.add(sample(1, 200, {"all_gather": [2, 1000, 0.25]})) == []
    assert builder.add(step(0, 1, 2.0, t=0.5)) == []  # rank 1 has not reported step 1 yet
    assert builder.add(step(1, 1, 4.0, t=0.8)) == []  # nor sent the sample that follows its steps
    assert builder.add(sample(0, 100, {})) == []
    scalars = {tag: (value, n) for tag, value, n in builder.add(sample(1, 200, {}))}
    assert scalars["train/loss"] == (3.0, 1)  # mean of the ranks' own losses
    assert scalars["train/step_time_s"] == (0.8, 1)  # the slowest rank
    assert scalars["train/samples_per_s"] == (pytest.approx(8 / 0.8), 1)
    assert scalars["train/lr"] == (1e-3, 1)
    assert scalars["rank0/memory_bytes"] == (100.0, 1) and scalars["rank1/memory_bytes"] == (200.0, 1)
    assert scalars["rank1/memory_peak_bytes"] == (201.0, 1)
    assert scalars["rank0/comm_share"] == (pytest.approx(0.2), 1)
    assert scalars["rank1/comm_bytes"] == (1000.0, 1) and scalars["rank0/comm_seconds"] == (0.5, 1)
    # A step only rank 0 reached (the job failed) is written at the end with what there is.
    builder.add(step(0, 2, 1.0))
    assert {tag for tag, _, _ in builder.flush()} >= {"train/loss", "rank0/loss"}


def test_bytes_sent_on_each_link_class_per_step_per_rank_and_for_the_job():
    builder = SeriesBuilder(2)
    builder.add({**step(0, 1, 2.0), "sent_within": 300, "sent_between": 1000})
    builder.add({**step(1, 1, 2.0), "sent_within": 100, "sent_between": 3000})
    builder.add(sample(0, 100, {}))
    scalars = {tag: value for tag, value, _ in builder.add(sample(1, 100, {}))}
    assert scalars["rank0/sent_within_host_bytes"] == 300.0 and scalars["rank1/sent_between_hosts_bytes"] == 3000.0
    assert scalars["train/sent_within_host_bytes"] == 400.0 and scalars["train/sent_between_hosts_bytes"] == 4000.0
    # A script without an engine reports no link bytes: no series, rather than zeros.
    builder.add(step(0, 2, 1.0))
    assert not any("sent_" in tag for tag, _, _ in builder.flush())


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    sink = TensorBoardSink(tmp_path / "tb")
    monitor = Monitor(1, [sink])
    for n, loss in enumerate([2.5, 2.0, 1.5], start=1):
        monitor.add(step(0, n, loss))
        monitor.add(sample(0, 100, {}))
    monitor.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert "rank0/comm_share" in acc.Tags()["scalars"]


def test_csv_files_follow_deepspeeds_layout_one_file_per_series(tmp_path):
    sink = CsvSink(tmp_path / "csv")
    monitor = Monitor(1, [sink])
    monitor.add(step(0, 1, 2.5))
    monitor.add(step(0, 2, 2.0))
    monitor.close()
    with open(tmp_path / "csv" / "train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "train/loss"], ["1", "2.5"], ["2", "2.0"]]


def test_wandb_gets_deepspeeds_project_group_and_team(tmp_path, monkeypatch):
    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    fake = types.ModuleType("wandb")
    fake.init = init
    fake.__spec__ = types.SimpleNamespace(name="wandb")  # found by importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "wandb", fake)
    section = load_config({"train_batch_size": 2, "wandb": {"enabled": True, "project": "p", "group": "g",
                                                              "team": "t"}}, world_size=1).monitor
    assert section.wandb.enabled and not section.tensorboard.enabled
    import dataclasses

    sinks, problems = open_sinks(dataclasses.asdict(section), base=tmp_path, run_dir=tmp_path)
    assert problems == []
    monitor = Monitor(1, sinks)
    monitor.add(step(0, 1, 2.5))
    monitor.close()
    assert calls["init"]["project"] == "p" and calls["init"]["group"] == "g" and calls["init"]["entity"] == "t"
    assert calls["log"][0][0] == 1 and calls["log"][0][1]["train/loss"] == 2.5 and calls["finished"]


def test_a_missing_package_is_one_line_and_the_job_goes_on(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    sinks, problems = open_sinks({"tensorboard": {"enabled": True, "output_path": "", "job_name": "j"},
                                  "csv": {"enabled": True, "output_path": "", "job_name": "j"}},
                                 base=tmp_path, run_dir=tmp_path)
    assert [type(s).__name__ for s in sinks] == ["CsvSink"]
    assert len(problems) == 1 and "pip install 'zerorun[monitor]'" in problems[0]


def test_deepspeed_sections_map_with_deepspeeds_meanings():
    config = load_config({"train_batch_size": 2, "tensorboard": {"enabled": True, "output_path": "logs/",
                                                                 "job_name": "run1"},
                          "csv_monitor": {"enabled": True, "job_name": "c"}}, world_size=1)
    assert config.monitor.tensorboard.output_path == "logs/" and config.monitor.tensorboard.job_name == "run1"
    assert config.monitor.csv.enabled and config.monitor.csv.job_name == "c"
    assert not any("tensorboard" in note for note in config.notes)  # no longer "no effect"


def test_the_monitor_record_is_checked_like_every_other():
    good = {"v": 1, "rank": 0, "host": "h", "t": 1.0, "kind": "monitor",
            "monitor": {"tensorboard": {"enabled": True, "output_path": "/x", "job_name": "j"}}}
    events.validate(good, 2)
    for bad in ({"tensorboard": {"enabled": True, "command": "rm"}}, {"other": {}}, {"csv": {"job_name": 3}}):
        with pytest.raises(events.SchemaError):
            events.validate({**good, "monitor": bad}, 2)


def test_a_launcher_config_asking_for_a_missing_writer_is_refused_before_start(monkeypatch):
    import importlib.util
    import json

    from zerorun.cli.run import check_monitor_packages
    from zerorun.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    check_monitor_packages(json.dumps({"monitor": {"csv": {"enabled": True}}}))  # needs nothing
    with pytest.raises(ConfigError, match="needs tensorboard") as caught:
        check_monitor_packages(json.dumps({"monitor": {"tensorboard": {"enabled": True}}}))
    assert "zerorun[monitor]" in caught.value.hint
