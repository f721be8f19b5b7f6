"""pytest tests/unit/test_save_progress.py — a save is progress the launcher can see.

A save on slow storage writes for minutes with no step and no collective; the hang watchdog
killed it as hung. Now the save reports ``record_activity("saving", bytes written so far)``
after every unit, each telemetry sample carries it, the collector keeps it per rank
(``RankView.activity``), and malformed activity is rejected by the schema.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import zerorun
import zerorun.telemetry as telemetry
from zerorun.telemetry import events
from zerorun.telemetry.collector import Collector
from zerorun.telemetry.recorder import PipeWriter, Recorder

TOKEN = "tok-19"


class _Activities:
    enabled = False

    def __init__(self):
        self.seen = []

    def record_activity(self, what, nbytes):
        self.seen.append((what, nbytes))

    def record_step(self, **fields):
        pass

    def set_memory_breakdown(self, breakdown):
        pass

    def set_total_steps(self, total_steps):
        pass

    def observe_collectives(self):
        pass  # get_recorder() subscribes the process's recorder to the collectives


def test_a_save_reports_growing_bytes_then_ends_its_activity(tmp_path, monkeypatch):
    capture = _Activities()
    monkeypatch.setattr(telemetry, "_recorder", capture)
    monkeypatch.setattr(telemetry, "_created", True)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                {"zero": {"stage": 2, "reduce_bucket_size": 272}})
    engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(tmp_path)
    saving = [n for what, n in capture.seen if what == "saving"]
    assert len(saving) >= 3 and saving == sorted(saving) and saving[-1] > saving[0]
    assert capture.seen[-1] == (None, 0)


def test_samples_carry_the_activity_and_the_collector_keeps_it(tmp_path):
    read_fd, write_fd = os.pipe()
    try:
        rec = Recorder(PipeWriter(write_fd), token=TOKEN, rank=0, host="h", world_size=1, interval_s=60)
        rec.record_activity("saving", 4096)
        rec.send_sample()
        rec.record_activity(None, 0)
        rec.send_sample()
        os.set_blocking(read_fd, False)
        lines = os.read(read_fd, 1 << 20).splitlines()
    finally:
        os.close(read_fd)
        os.close(write_fd)
    samples = [json.loads(line) for line in lines]
    assert samples[0]["activity"] == {"what": "saving", "bytes": 4096} and "activity" not in samples[1]
    collector = Collector(token=TOKEN, world_size=1, run_dir=tmp_path)
    assert collector.ingest("h", lines[0])
    assert collector.snapshot().ranks[0].activity == ("saving", 4096)
    assert collector.ingest("h", lines[1])
    assert collector.snapshot().ranks[0].activity is None


@pytest.mark.parametrize("activity", [{"what": 3, "bytes": 1}, {"what": "saving"}, {"what": "x" * 40, "bytes": 1}, "saving"])
def test_malformed_activity_is_rejected(activity):
    message = {"v": 1, "rank": 0, "host": "h", "kind": "sample", "t": 1.0, "mem": {}, "comm": {},
               "comm_seconds_total": 0.0, "entered_seq": -1, "blocked": None, "activity": activity}
    with pytest.raises(events.SchemaError):
        events.validate(message, world_size=1)
